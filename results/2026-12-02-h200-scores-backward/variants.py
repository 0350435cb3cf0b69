"""Variants of the keys-on-M scores backward kernel, built from the library kernels' source with one edit
each, timed side by side at the 64K flash shapes of bench/test_bench_indexer.py (CUDA events, median of
10 launches after 2), each checked against the library's heads-on-M kernel (normwise error of dq, dw, dkeys).
Run from the repository root: python results/2026-12-02-h200-scores-backward/variants.py [VARIANT:TILE ...]
(TILE = block_k,num_warps,num_stages[,maxnreg]: a register cap per thread, so that three programs fit an SM;
without arguments: every variant at every tile of VARIANT_TILES)."""

import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from bench.test_bench_indexer import SHAPES, _inputs, _selection
from dsv4cp.kernels import indexer_scores_triton as ist

sys.path.insert(0, str(Path(__file__).parent))
import whole_width_kernel  # noqa: E402  (this folder's file)

DW_PER_STEP = [
    ("dw_parts = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)", "dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)"),
    ("dw_parts += tl.maximum(st, 0.0) * g[:, None]", "dw_acc += tl.sum(tl.maximum(st, 0.0) * g[:, None], 0)"),
    ("tl.sum(dw_parts, 0)", "dw_acc"),
]
"""The edit of ``*-dw-step``: dw reduced over the step's keys at every step, not once after the loop."""
VARIANTS = {  # name -> (module, kernel, edits): "split" is the library's keys-on-M kernel (D in halves)
    "full": (whole_width_kernel, "whole_width_kernel", []),
    "full-dw-step": (whole_width_kernel, "whole_width_kernel", DW_PER_STEP),
    "split": (ist, "_gather_bwd_keys_on_m_kernel", []),
    "split-dw-step": (ist, "_gather_bwd_keys_on_m_kernel", DW_PER_STEP),
}
VARIANT_TILES = [(64, 4, 1), (64, 4, 2), (64, 4, 3), (128, 8, 2), (64, 4, 1, 168), (64, 4, 2, 168)]
HEADER = ("import triton\nimport triton.language as tl\nfrom dsv4cp.kernels._triton_gather import gather_loaded_rows, "
          "gather_rows\nfrom dsv4cp.kernels.indexer_scores_triton import _store_key_grads\n\n")
"""What a variant's source needs (it is written to its own file: triton.jit reads its functions from files)."""


def build(name: str):
    source_module, base, edits = VARIANTS[name]
    src = inspect.getsource(getattr(source_module, base))
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = Path("/tmp") / f"scores_bwd_variant_{name.replace('-', '_')}.py"
    path.write_text(HEADER + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import triton
    return triton.jit(getattr(module, base))


def launch(kernel, plan, tile) -> None:
    q, (t, hi, di) = plan.q, plan.q.shape
    kernel[(t,)](q, plan.w, plan.keys, plan.idx, plan.grad, plan.dq, plan.dw, plan.dkeys, plan.dkeys, plan.dkeys, hi,
                 plan.keys.shape[0], plan.idx.shape[1], 0, q.stride(0), q.stride(1), plan.w.stride(0),
                 plan.keys.stride(0), plan.idx.stride(0), plan.grad.stride(0), plan.dq.stride(0), plan.dq.stride(1),
                 plan.dkeys.stride(0), DI=di, BLOCK_D=di, BLOCK_H=hi, BLOCK_K=tile[0], SORTED=False, RELAXED=True,
                 PRECISION="tf32", DOT_F32=False, num_warps=tile[1], num_stages=tile[2],
                 **({"maxnreg": tile[3]} if len(tile) > 3 else {}))


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
    ref = ist.BackwardPlan.new(*args, ist.GatherBwdConfig(32, 4, 2), layout="heads_on_m")
    ref.run_kernel(0)
    ref_grads = (ref.dq.clone(), ref.dw.clone(), ref.dkeys.clone())  # dkeys before the timing adds to it
    flops = 3 * 2.0 * shape.heads * shape.dim * valid
    print(f"heads_on_m 32,4,2 (library): {median_ms(lambda: ref.run_kernel(0)):.3f} ms")
    picks = [(a.split(":")[0], tuple(map(int, a.split(":")[1].split(",")))) for a in sys.argv[1:]] or [
        (name, tile) for name in VARIANTS for tile in VARIANT_TILES]
    kernels = {}
    for name, tile in picks:
        kernels.setdefault(name, build(name))
        plan = ist.BackwardPlan.new(*args, layout="keys_on_m")  # fresh outputs: dkeys zero
        try:
            launch(kernels[name], plan, tile)
        except Exception as err:  # noqa: BLE001 - a tile over the machine's resources: say so, go on
            print(f"{name:14s} {tile}: {type(err).__name__}: {str(err)[:80]}")
            continue
        errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
                  for a, b in zip((plan.dq, plan.dw, plan.dkeys), ref_grads)]
        ms = median_ms(lambda kernel=kernels[name], plan=plan, tile=tile: launch(kernel, plan, tile))
        print(f"{name:14s} {','.join(map(str, tile)):9s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s   "
              f"errors vs heads_on_m: dq {errors[0]:.1e} dw {errors[1]:.1e} dkeys {errors[2]:.1e}", flush=True)


if __name__ == "__main__":
    main()
