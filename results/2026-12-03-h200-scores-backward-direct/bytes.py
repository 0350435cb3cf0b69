"""What the key-gradient reduction bytes cost the keys-on-M scores backward kernel, at the 64K flash shapes of
bench/test_bench_indexer.py (the library kernel at its default tile ``64,4,3``, indices a step ahead).

Each variant is the library kernel's source with one edit, timed side by side (CUDA events, median of 10
launches after 2):

* ``library``: unchanged (16.9 GB of fp32 reductions: 4 B per valid slot and head-dimension column);
* ``half-bytes``: the second half's atomics predicated off at run time (``valid & (g != g)``: the same
  instructions, 8.5 GB of reductions: what a packed 2-byte reduction would send);
* ``no-traffic``: both halves' atomics predicated off (the products, gathers and instructions stay; no
  reduction bytes): the kernel's time without its key-gradient traffic;
* ``bf16-atomics``: the key gradients rounded to bf16 and added by bf16 atomics into a bf16 ``dkeys``
  (the real packed reduction), with its error against the fp32 atomics (normwise, and per key row at the
  90th percentile).

Then how much a program that handled G consecutive queries could reduce before its atomics on this
selection: distinct (query group, key row) pairs over valid slots, G = 1 .. 64.
Run from the repository root: python results/2026-12-03-h200-scores-backward-direct/bytes.py
"""

import importlib.util
import inspect
from pathlib import Path

import torch
import triton

from bench.test_bench_indexer import SHAPES, _inputs, _selection
from dsv4cp.kernels import indexer_scores_triton as ist

CALL_0 = "_store_key_grads(dk, rows, valid, d0, m0,"
CALL_1 = "_store_key_grads(dk, rows, valid, d1, m1,"
OFF = "valid & (g != g)"  # false unless the upstream gradient is NaN: the compiler cannot drop the atomics
VARIANTS = {
    "library": [],
    "half-bytes": [(CALL_1, CALL_1.replace("valid,", OFF + ","))],
    "no-traffic": [(CALL_0, CALL_0.replace("valid,", OFF + ",")), (CALL_1, CALL_1.replace("valid,", OFF + ","))],
    "bf16-atomics": [(c, c.replace("(dk,", "(dk.to(DKEYS.dtype.element_ty),")) for c in (CALL_0, CALL_1)],
}
HEADER = ("import triton\nimport triton.language as tl\nfrom dsv4cp.kernels._triton_gather import gather_loaded_rows\n"
          "from dsv4cp.kernels.indexer_scores_triton import _store_key_grads\n\n")
TILE = (64, 4, 3)


def build(name: str):
    src = inspect.getsource(ist._gather_bwd_keys_on_m_kernel)
    for old, new in VARIANTS[name]:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = Path("/tmp") / f"scores_bwd_bytes_{name.replace('-', '_')}.py"
    path.write_text(HEADER + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton.jit(module._gather_bwd_keys_on_m_kernel)


def launch(kernel, plan, dkeys) -> None:
    q, (t, hi, di) = plan.q, plan.q.shape
    kernel[(t,)](q, plan.w, plan.keys, plan.idx, plan.grad, plan.dq, plan.dw, dkeys, dkeys, dkeys, hi,
                 plan.keys.shape[0], plan.idx.shape[1], 0, q.stride(0), q.stride(1), plan.w.stride(0),
                 plan.keys.stride(0), plan.idx.stride(0), plan.grad.stride(0), plan.dq.stride(0), plan.dq.stride(1),
                 dkeys.stride(0), DI=di, BLOCK_D=di, BLOCK_H=hi, BLOCK_K=TILE[0], SORTED=False, RELAXED=True,
                 PRECISION="tf32", DOT_F32=False, INDEX_AHEAD=True, num_warps=TILE[1], num_stages=TILE[2])


def median_ms(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    shape = SHAPES["64k"]
    entry = _inputs(shape)
    idx, grad, valid = _selection(shape, entry)
    args = (entry["q"], entry["w"], entry["keys"], idx, grad.float().contiguous(), "atomic")
    flops = 3 * 2.0 * shape.heads * shape.dim * valid
    print(f"T {shape.tokens} Hi {shape.heads} Di {shape.dim} K {shape.topk} G {shape.n_compressed}, valid slots "
          f"{valid}, fp32 reduction bytes {valid * shape.dim * 4 / 1e9:.2f} GB, tile {TILE}, indices ahead")
    ref = None
    for name in VARIANTS:
        plan = ist.BackwardPlan.new(*args, layout="keys_on_m")
        dkeys = torch.zeros_like(plan.dkeys, dtype=torch.bfloat16) if name == "bf16-atomics" else plan.dkeys
        try:
            kernel = build(name)
            launch(kernel, plan, dkeys)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a variant that does not build: say so, go on
            print(f"{name:13s}: {type(err).__name__}: {str(err)[:300]}")
            continue
        note = ""
        if ref is None:
            ref = (plan.dq.clone(), plan.dw.clone(), plan.dkeys.clone())
        elif name == "bf16-atomics":
            diff = (dkeys.float() - ref[2])
            rows = diff.norm(dim=1) / ref[2].norm(dim=1).clamp_min(1e-30)
            note = (f"dkeys vs fp32 atomics: normwise {(diff.norm() / ref[2].norm()).item():.2e}, per row median "
                    f"{rows.median().item():.2e} p90 {rows.quantile(0.9).item():.2e}; the returned bf16 dkeys of "
                    f"the fp32 sum: {((ref[2].bfloat16().float() - ref[2]).norm() / ref[2].norm()).item():.2e}")
        ms = median_ms(lambda kernel=kernel, plan=plan, dkeys=dkeys: launch(kernel, plan, dkeys))
        print(f"{name:13s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  {note}", flush=True)
    flat = torch.arange(shape.tokens, device=idx.device)[:, None].expand_as(idx)
    ok = idx >= 0
    for group in (1, 2, 4, 8, 16, 64):
        pairs = (flat[ok] // group) * shape.n_compressed + idx[ok]
        distinct = torch.unique(pairs).numel()
        print(f"queries per program {group:3d}: distinct (program, key row) pairs {distinct / valid:.3f} of the "
              f"valid slots (reduction bytes x{distinct / valid:.3f})", flush=True)


if __name__ == "__main__":
    main()
