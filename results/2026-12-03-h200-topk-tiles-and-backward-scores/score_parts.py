"""Where the top-k's score kernel spends its time, at the 64K shape of bench/test_bench_indexer.py (T 65536,
Hi 64, Di 128, G 16384, one causal document, bf16), the default tile (64, 128, 4 warps, 3 stages): the whole
fp32 masked score matrix, every tile that sees a key.

Each variant is the library's ``_score_kernel`` source with its head loop (``_head_sum``) written inline and
one edit, timed side by side (CUDA events, median of 20 launches after 3):

* ``library``: the kernel unchanged;
* ``inline``: the head loop inline, unchanged (the same code as ``library``: a check of the method);
* ``products-only``: ``acc = q_h @ k^T + acc`` chained on the matrix unit (no weight load, no relu, no
  per-head epilogue; wrong scores): the time of the loads and the 64 products per tile alone;
* ``no-relu``: ``acc += w_h s`` (the weights' multiply-add without the max; wrong scores);
* ``no-weights``: ``acc += relu(s)`` (no weight load or multiply; wrong scores);
* ``epilogue-only``: ``s`` = the query tile itself, no product (``BLOCK_N`` = ``Di`` = 128 makes the shapes
  agree; wrong scores): the loads and the per-head epilogue alone.

With ``--once NAME`` it launches one variant once (for ncu).
Run from the repository root: python results/2026-12-03-h200-topk-tiles-and-backward-scores/score_parts.py
"""

import importlib.util
import inspect
import sys
from pathlib import Path

import torch
import triton

from bench.test_bench_indexer import SHAPES, _inputs, _vis_args
from dsv4cp.kernels import indexer_triton as it

CALL = """    acc = _head_sum(q_ptrs, q_mask, WT + rows64, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M, BLOCK_N,
                    PRECISION, DOT_F32, HEAD_PAIRS, COMPILED)
"""
LOOP = """    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(n_heads):
        qh = tl.load(q_ptrs + h * stride_qh, mask=q_mask, other=0.0)
{body}
"""
WEIGHT = "        wh = tl.load(WT + rows64 + h * stride_wh, mask=rmask, other=0.0)\n"
PRODUCT = "        s = tl.dot(qh, kt, input_precision=PRECISION)\n"
BODIES = {
    "inline": WEIGHT + PRODUCT + "        acc += wh[:, None] * tl.maximum(s, 0.0)",
    "products-only": "        acc = tl.dot(qh, kt, acc, input_precision=PRECISION)",
    "no-relu": WEIGHT + PRODUCT + "        acc += wh[:, None] * s",
    "no-weights": PRODUCT + "        acc += tl.maximum(s, 0.0)",
    "epilogue-only": WEIGHT + "        s = qh.to(tl.float32)\n        acc += wh[:, None] * tl.maximum(s, 0.0)",
}
VARIANTS = ["library", *BODIES]
HEADER = ("import triton\nimport triton.language as tl\n"
          "from dsv4cp.kernels.indexer_triton import _head_sum, _pack_keys\n\n")
TILE = it.IndexerConfig(64, 128, 4, 3)


def build(name: str):
    src = inspect.getsource(it._score_kernel)
    if name != "library":
        assert src.count(CALL) == 1, name
        src = src.replace(CALL, LOOP.format(body=BODIES[name]))
    path = Path("/tmp") / f"score_parts_{name.replace('-', '_')}.py"
    path.write_text(HEADER + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton.jit(module._score_kernel)


def launch(kernel, args, out) -> None:
    q, wt, keys, qdoc, qlim, kdoc, kj = args
    m, width = out.shape
    n_kb = triton.cdiv(width, TILE.block_n)
    kernel[(triton.cdiv(m, TILE.block_m) * n_kb,)](
        q, wt, keys, qdoc, qlim, kdoc, kj, out, qdoc, qdoc, m, width, 0, n_kb, q.shape[1],
        q.stride(0), q.stride(1), wt.stride(0), keys.stride(0), out.stride(0),
        DI=q.shape[2], BLOCK_D=q.shape[2], BLOCK_M=TILE.block_m, BLOCK_N=TILE.block_n,
        PRECISION=it._precision(q.dtype, q.device), DOT_F32=it._dot_f32(q.dtype, q.device), PACKED=False,
        IN_RANGE_ONLY=False, HEAD_PAIRS=False, COMPILED=q.is_cuda,
        num_warps=TILE.num_warps, num_stages=TILE.num_stages,
    )


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
    shape = SHAPES["64k"]
    entry = _inputs(shape)
    args = it._prepare(entry["q"], entry["w"], entry["keys"], *_vis_args(entry))
    out = torch.empty(shape.tokens, entry["keys"].shape[0], dtype=torch.float32, device="cuda")
    flops = 2.0 * shape.heads * shape.dim * entry["visible_pairs"]
    if "--once" in sys.argv:
        launch(build(sys.argv[sys.argv.index("--once") + 1]), args, out)
        torch.cuda.synchronize()
        return
    print(f"64k: T {shape.tokens} Hi {shape.heads} Di {shape.dim} G {entry['keys'].shape[0]}, visible pairs "
          f"{entry['visible_pairs']}, tile {TILE}", flush=True)
    ref = it.indexer_score_matrix(entry["q"], entry["w"], entry["keys"], *_vis_args(entry), config=TILE)
    finite = torch.isfinite(ref)
    for name in VARIANTS:
        try:
            kernel = build(name)
            launch(kernel, args, out)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a variant that does not build: say so, go on
            print(f"{name:14s}: {type(err).__name__}: {str(err)[:400]}", flush=True)
            continue
        same = torch.equal(out, ref)
        diff = ((out[finite] - ref[finite]).norm() / ref[finite].norm()).item()
        ms = median_ms(lambda kernel=kernel: launch(kernel, args, out))
        print(f"{name:14s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  scores equal to the library's: {same} "
              f"(relative difference {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
