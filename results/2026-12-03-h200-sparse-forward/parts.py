"""Where the Triton sparse-attention forward's time goes, at the flash shapes of
bench/test_bench_sparse_attention.py (T 16384, H 64, D 512, Kt 640 = 128 window + 512 selected, bf16), the
default kernel (split logits, indices a step ahead, ``64,64,8,2``).

Each variant is the library kernel's source with one edit, timed side by side (CUDA events, median of 20
launches after 3):

* ``library``: unchanged;
* ``ws``: unchanged, the key loop warp-specialized (``WARP_SPECIALIZE=True``);
* ``no-rescale``: the accumulator's per-step multiply by ``alpha`` left out (128 multiplies per thread and
  step; wrong results): what the rescale costs;
* ``no-pv``: the value product left out (``acc`` stays ``acc * alpha``; wrong results): the time of the
  gathers, the logits' product and the softmax alone;
* ``same-rows``: every slot of a step gathers the step's first row (the same instructions and products,
  one kv row's traffic per step instead of 64);
* ``resident-rows``: the first step's rows gathered once before the loop and used by every step (the indices
  are still loaded a step ahead and mask the logits; no gather, no copy to wait for in the loop): the time
  of the products and the softmax without the per-step gather.

With ``--once NAME`` it launches one variant once (for ncu, which profiles the kernel its ``-k`` names).
Run from the repository root: python results/2026-12-03-h200-sparse-forward/parts.py [--once NAME]
"""

import importlib.util
import inspect
import sys
from pathlib import Path

import torch
import triton

from bench.test_bench_sparse_attention import SHAPES, _flops_forward, _inputs
from dsv4cp.kernels import sparse_attention_fwd_triton as fwd
from dsv4cp.kernels.sparse_attention_launch import LOG2E

RESCALE = "                        acc_v = acc * alpha[:, None]\n                else:"
PV = "                acc = tl.dot(p_v, kv, acc_v, input_precision=PRECISION)"
GATHER = "gather_loaded_rows(KV, rows_here, N,"
LOOP = "    for k0 in tl.range(0, kt_len, BLOCK_K, warp_specialize=WARP_SPECIALIZE):"
STEP_GATHER = "rows, valid, kv = gather_loaded_rows(KV, rows_here, N, stride_kvn, d, dmask, D, BLOCK_D, DOT_F32)"
VARIANTS = {
    "library": ([], False),
    "ws": ([], True),
    "no-rescale": ([(RESCALE, RESCALE.replace("acc * alpha[:, None]", "acc"))], False),
    "no-pv": ([(PV, PV.replace("tl.dot(p_v, kv, acc_v, input_precision=PRECISION)", "acc_v + tl.sum(p_v, 1)"
                                                                                      "[:, None].to(tl.float32)"))],
              False),
    "same-rows": ([(GATHER, GATHER.replace("rows_here,", "tl.where(rows_here >= 0, tl.max(rows_here, 0), -1),"))],
                  False),
    "resident-rows": ([(LOOP, "    _, _, kv0 = gather_loaded_rows(KV, rows_next, N, stride_kvn, d, dmask, D, BLOCK_D, "
                              "DOT_F32)\n" + LOOP),
                       (STEP_GATHER, "rows, valid, kv = rows_here, (rows_here >= 0) & (rows_here < N), kv0")], False),
}
HEADER = ("import triton\nimport triton.language as tl\n"
          "from dsv4cp.kernels._triton_gather import gather_loaded_rows, gather_rows, selected_length\n\n")
TILE = (64, 64, 8, 2)


def build(name: str):
    src = inspect.getsource(fwd._fwd_kernel)
    for old, new in VARIANTS[name][0]:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = Path("/tmp") / f"sparse_fwd_parts_{name.replace('-', '_')}.py"
    path.write_text(HEADER + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton.jit(module._fwd_kernel)


def launch(kernel, name: str, args, out, lse) -> None:
    q, kv, idx, sink, scale = args
    t, h, d = q.shape
    kernel[(t,)](q, kv, idx, sink, idx, out, lse, float(scale) * LOG2E, h, kv.shape[0], idx.shape[1], 1,
                 q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
                 D=d, BLOCK_D=d, BLOCK_H=TILE[0], BLOCK_K=TILE[1], HAS_TOPK=False, PRECISION="tf32", DOT_F32=False,
                 LOGITS="split", INDEX_AHEAD=True, LAZY_RESCALE=False, WARP_SPECIALIZE=VARIANTS[name][1],
                 num_warps=TILE[2], num_stages=TILE[3])


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
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
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    args = entry["args"]
    q = args[0]
    flops = _flops_forward(shape, entry["valid"])
    if "--once" in sys.argv:
        name = sys.argv[sys.argv.index("--once") + 1]
        kernel = build(name)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
        launch(kernel, name, args, out, lse)
        torch.cuda.synchronize()
        return
    print(f"flash: T {shape.tokens} H {shape.heads} D {shape.dim} Kt {shape.kt}, valid slots {entry['valid']}, "
          f"tile {TILE}, split logits, indices ahead", flush=True)
    ref_out, _ = fwd.sparse_attention_fwd(*args, logits="split", index_ahead=True, block_h=TILE[0],
                                          block_k=TILE[1], num_warps=TILE[2], num_stages=TILE[3])
    for name in VARIANTS:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
        try:
            kernel = build(name)
            launch(kernel, name, args, out, lse)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a variant that does not build: say so, go on
            print(f"{name:11s}: {type(err).__name__}: {str(err)[:400]}", flush=True)
            continue
        diff = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        ms = median_ms(lambda kernel=kernel, name=name, out=out, lse=lse: launch(kernel, name, args, out, lse))
        print(f"{name:11s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  out vs library {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
