"""The Triton sparse-attention backward with dq in its own pass against the default one, part by part.

At the benchmark shapes of ``bench/test_bench_sparse_attention.py`` (``flash``: T 16384, H 64, Kt 640;
``pro``: T 16384, H 128, Kt 1152; D 512, bf16, the same inputs), in one process: the default backward
whole and its parts (the scores kernel, the dkv kernel with dq), then the backward with its own dq pass
(:mod:`dsv4cp.kernels.sparse_attention_bwd_dq_pass_triton`) at each kv-pass tile (the pass alone, with
and without its atomics' traffic: every slot masked off) and each dq-pass tile, and whole at the fastest
of each; each whole result checked against the default's (relative Frobenius error < 1e-2 per gradient).
Prints a table (median ms, TFLOP/s with the backward's 2.5x-forward FLOPs for whole backwards and each
part's own products otherwise) and writes the rows as JSON.

Run it from the repository root on a CUDA machine::

    python -m bench.sweep_sparse_attention_dq_pass --json dq_pass.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.test_bench_sparse_attention import SHAPES, _flops_forward, _inputs
from dsv4cp.profiling.timing import benchmark

KV_TILES = {"flash": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 2), (32, 128, 4, 2),
                      (128, 64, 8, 2), (64, 256, 8, 2), (64, 128, 4, 2)],
            "pro": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2)]}
"""The kv pass's tiles (block_k, block_d, num_warps, num_stages) timed per shape."""
DQ_TILES = {"flash": [(64, 512, 32, 8, 3), (64, 512, 32, 8, 4), (64, 256, 32, 4, 3), (64, 256, 32, 4, 4)],
            "pro": [(128, 256, 32, 8, 3), (128, 256, 32, 8, 4), (128, 128, 32, 8, 3), (64, 256, 32, 4, 3)]}
"""The dq pass's tiles (block_h, block_d, block_k, num_warps, num_stages) timed per shape."""
TOLERANCE = 1e-2
BACKWARD_FLOP_FACTOR = 2.5  # DESIGN 4.3, as bench/test_bench_sparse_attention.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _time(rows: list[dict], shape, entry, name: str, fn, products: int | None, reps: int) -> dict:
    """Time ``fn`` (median of ``reps`` after a first call and 2 warm-ups), print and append its row;
    ``products``: the part's matrix products per valid (query, head, key), None for a whole backward."""
    fn()
    timing = benchmark(fn, warmup=2, reps=reps, device="cuda")
    valid = entry["valid"]
    flops = (BACKWARD_FLOP_FACTOR * _flops_forward(shape, valid) if products is None
             else products * 2.0 * shape.dim * shape.heads * valid)
    row = {"shape": shape.name, "what": name, "median_ms": timing.median_ms,
           "tflops": flops / (timing.median_ms * 1e-3) / 1e12}
    rows.append(row)
    print(f"{shape.name:5s} {name:64s} {row['median_ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)
    return row


def sweep_shape(shape, reps: int, rows: list[dict]) -> None:
    """The default backward and the dq-pass one at ``shape``, part by part and whole (rows appended)."""
    from dsv4cp.kernels import sparse_attention_bwd_dq_pass_triton as dqp
    from dsv4cp.kernels import sparse_attention_triton as sat

    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    out, lse = sat.sparse_attention_fwd(q, kv, idx, sink, scale)
    g = torch.Generator(device="cuda").manual_seed(4321)
    dout = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    bwd_args = (dout, q, kv, idx, sink, scale, out, lse)
    ref = sat.sparse_attention_bwd(*bwd_args, deterministic=False)

    def default_whole():
        return sat.sparse_attention_bwd(*bwd_args, deterministic=False)

    _time(rows, shape, entry, "default backward (whole)", default_whole, None, reps)
    base = sat.backward_plan(*bwd_args, deterministic=False)
    base.preprocess()
    starts = list(base.starts())
    _time(rows, shape, entry, "default: scores kernel", lambda: [base.scores(t0) for t0 in starts], 2, reps)
    _time(rows, shape, entry, "default: dkv kernel with dq", lambda: [base.kv_gradients(t0) for t0 in starts], 3,
          reps)
    plan = dqp.split_backward_plan(*bwd_args)
    plan.preprocess()
    for t0 in starts:
        plan.scores(t0)
    best = {}
    for tile in KV_TILES[shape.name]:
        plan.kv_pinned = dqp.KvPassConfig(*tile)
        try:
            row = _time(rows, shape, entry, f"dq pass: kv pass {tile}",
                        lambda: [plan.kv_gradients(t0) for t0 in starts], 2, reps)
            _time(rows, shape, entry, f"dq pass: kv pass {tile} no atomics",
                  lambda: [plan.kv_gradients(t0, write=False) for t0 in starts], 2, reps)
        except Exception as exc:  # noqa: BLE001 - a tile over the limits must not end the sweep
            print(f"{shape.name:5s} kv pass {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if row["median_ms"] < best.get("kv", (float("inf"),))[0]:
            best["kv"] = (row["median_ms"], tile)
    for tile in DQ_TILES[shape.name]:
        plan.dq_pinned = dqp.DqPassConfig(*tile)
        try:
            row = _time(rows, shape, entry, f"dq pass: dq pass {tile}", lambda: [plan.dq(t0) for t0 in starts], 1,
                        reps)
        except Exception as exc:  # noqa: BLE001 - a tile over the limits must not end the sweep
            print(f"{shape.name:5s} dq pass {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if row["median_ms"] < best.get("dq", (float("inf"),))[0]:
            best["dq"] = (row["median_ms"], tile)
    kv_cfg, dq_cfg = dqp.KvPassConfig(*best["kv"][1]), dqp.DqPassConfig(*best["dq"][1])

    def dq_pass_whole():
        return dqp.sparse_attention_bwd_dq_pass(*bwd_args, kv_config=kv_cfg, dq_config=dq_cfg)

    errors = {name: _rel(a, b) for name, a, b in zip(("dq", "dkv", "dsink"), dq_pass_whole(), ref)}
    row = _time(rows, shape, entry, f"dq-pass backward (whole) kv {best['kv'][1]} dq {best['dq'][1]}",
                dq_pass_whole, None, reps)
    row["rel_err_vs_default"] = errors
    verdict = "ok" if max(errors.values()) < TOLERANCE else "WRONG"
    print(f"{shape.name:5s} rel err vs default: {errors} {verdict}", flush=True)
    _time(rows, shape, entry, "default backward (whole, again)", default_whole, None, reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows (JSON)")
    parser.add_argument("--shapes", default="flash,pro", help="comma-separated: flash, pro")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per row (median reported)")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if name not in KV_TILES:
            parser.error(f"--shapes: unknown shape {name!r} (flash, pro)")
        sweep_shape(SHAPES[name], args.reps, rows)
    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
