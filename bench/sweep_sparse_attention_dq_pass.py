"""The Triton sparse-attention backward with dq in its own pass against the default one, part by part.

At the benchmark shapes of ``bench/test_bench_sparse_attention.py`` (``flash``: T 16384, H 64, Kt 640;
``pro``: T 16384, H 128, Kt 1152; D 512, bf16, the same inputs), in one process: the default backward
whole and its parts (the scores kernel, the dkv kernel with dq), then the backward with its own dq pass
(:mod:`dsv4cp.kernels.sparse_attention_bwd_dq_pass_triton`) at each kv-pass tile (the pass alone, with
and without its atomics' traffic: every slot masked off; the tiles with a fifth field run programs of
several column blocks, each slot step's scratch tile read once for all), the kv pass's atomics alone
(:func:`_atomics_alone_kernel`: the same fp32 reductions, addresses, masks and vector width, with no
scratch load and no product: how long the reductions take by themselves) and each dq-pass tile, and
whole at the fastest of each (and at the fastest tile of several column blocks); each whole result
checked against the default's (relative Frobenius error < 1e-2 per gradient). Prints a table (median ms,
TFLOP/s with the backward's 2.5x-forward FLOPs for whole backwards and each part's own products otherwise,
and for the kv-pass rows the rate of their fp32 reductions: valid slots x D x 4 bytes over the time) and
writes the rows as JSON.

Run it from the repository root on a CUDA machine::

    python -m bench.sweep_sparse_attention_dq_pass --json dq_pass.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.test_bench_sparse_attention import SHAPES, _flops_forward, _inputs
from dsv4cp.kernels._triton_gather import selected_length
from dsv4cp.profiling.timing import benchmark

KV_TILES = {"flash": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 2), (32, 128, 4, 2),
                      (128, 64, 8, 2), (64, 256, 8, 2), (64, 128, 4, 2),
                      (64, 128, 8, 2, 2), (64, 128, 8, 3, 2), (64, 128, 8, 2, 4), (64, 128, 8, 3, 4),
                      (64, 256, 8, 2, 2)],
            "pro": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2),
                    (64, 128, 8, 2, 2), (64, 128, 8, 3, 2)]}
"""The kv pass's tiles (block_k, block_d, num_warps, num_stages[, column_blocks]) timed per shape; at H = 128
four blocks of 128 columns, or two of 256, need more shared memory than an SM has
(``python -m bench.compile_kv_pass_sm90 --heads 128``)."""
ATOMICS_TILE = (64, 128, 8, 3)
"""The atomics-alone kernel's launch (block_k, block_d, num_warps, num_stages): the kv pass's ladder head."""
DQ_TILES = {"flash": [(64, 512, 32, 8, 3), (64, 512, 32, 8, 4), (64, 256, 32, 4, 3), (64, 256, 32, 4, 4)],
            "pro": [(128, 256, 32, 8, 3), (128, 256, 32, 8, 4), (128, 128, 32, 8, 3), (64, 256, 32, 4, 3)]}
"""The dq pass's tiles (block_h, block_d, block_k, num_warps, num_stages) timed per shape."""
TOLERANCE = 1e-2
BACKWARD_FLOP_FACTOR = 2.5  # DESIGN 4.3, as bench/test_bench_sparse_attention.py


@triton.jit
def _atomics_alone_kernel(IDX, TOPK, DKV, N, KT, T0, stride_it, D: tl.constexpr, BLOCK_DC: tl.constexpr,
                          BLOCK_K: tl.constexpr, HAS_TOPK: tl.constexpr):
    """The kv pass's atomics and nothing else: per (query t = T0 + pid // cdiv(D, BLOCK_DC), column block),
    over the query's slots (index row loaded a step ahead, as the pass does), fp32 atomics of a constant
    ``[BLOCK_K, BLOCK_DC]`` tile into DKV ``[N, D]`` at the slots' rows (valid slots below the query's
    length, columns below D): the pass's addresses, mask and width, without its scratch loads and products.
    IDX ``[T, KT]``; TOPK ``[T]`` (read iff HAS_TOPK)."""
    n_db: tl.constexpr = (D + BLOCK_DC - 1) // BLOCK_DC
    pid = tl.program_id(0)
    t = T0 + (pid // n_db).to(tl.int64)
    d = (pid % n_db) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dmask = d < D
    ones = tl.full([BLOCK_K, BLOCK_DC], 1.0, tl.float32)
    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)
    rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len, other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        rows = rows_next.to(tl.int64)
        rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
        valid = (rows >= 0) & (rows < N)
        tl.atomic_add(DKV + rows[:, None] * D + d[None, :], ones, mask=valid[:, None] & dmask[None, :], sem="relaxed")


def atomics_alone(plan, t0: int, out: torch.Tensor) -> None:
    """:func:`_atomics_alone_kernel` on the chunk at ``t0`` of ``plan`` (a split backward plan), into ``out``
    (fp32 ``[N, D]``), at :data:`ATOMICS_TILE`."""
    b = plan.base
    idx, (t, _, d) = b.idx, b.q.shape
    rows = min(b.chunk, t - t0)
    block_k, block_d, num_warps, num_stages = ATOMICS_TILE
    _atomics_alone_kernel[(rows * triton.cdiv(d, block_d),)](
        idx, b.topk, out, out.shape[0], idx.shape[1], t0, idx.stride(0), D=d, BLOCK_DC=block_d, BLOCK_K=block_k,
        HAS_TOPK=b.topk_length is not None, num_warps=num_warps, num_stages=num_stages)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _time(rows: list[dict], shape, entry, name: str, fn, products: int | None, reps: int,
          reductions: bool = False) -> dict:
    """Time ``fn`` (median of ``reps`` after a first call and 2 warm-ups), print and append its row;
    ``products``: the part's matrix products per valid (query, head, key), None for a whole backward;
    ``reductions``: also the rate of the kv pass's fp32 reductions (valid slots x D x 4 bytes) in GB/s."""
    fn()
    timing = benchmark(fn, warmup=2, reps=reps, device="cuda")
    valid = entry["valid"]
    flops = (BACKWARD_FLOP_FACTOR * _flops_forward(shape, valid) if products is None
             else products * 2.0 * shape.dim * shape.heads * valid)
    row = {"shape": shape.name, "what": name, "median_ms": timing.median_ms,
           "tflops": flops / (timing.median_ms * 1e-3) / 1e12}
    text = f"{shape.name:5s} {name:78s} {row['median_ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
    if reductions:
        row["reduction_gbps"] = valid * shape.dim * 4 / (timing.median_ms * 1e-3) / 1e9
        text += f" {row['reduction_gbps']:7.0f} GB/s of fp32 reductions"
    rows.append(row)
    print(text, flush=True)
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
        blocks = f"{plan.kv_pinned.column_blocks} column blocks per program"
        try:
            row = _time(rows, shape, entry, f"dq pass: kv pass {tile} ({blocks})",
                        lambda: [plan.kv_gradients(t0) for t0 in starts], 2, reps, reductions=True)
            _time(rows, shape, entry, f"dq pass: kv pass {tile} ({blocks}) no atomics",
                  lambda: [plan.kv_gradients(t0, write=False) for t0 in starts], 2, reps)
        except Exception as exc:  # noqa: BLE001 - a tile over the limits must not end the sweep
            print(f"{shape.name:5s} kv pass {tile}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        kind = "kv" if plan.kv_pinned.column_blocks == 1 else "kv_blocks"
        if row["median_ms"] < best.get(kind, (float("inf"),))[0]:
            best[kind] = (row["median_ms"], tile)
    scratch_rows = torch.zeros_like(plan.base.dkv)  # fp32 [N, D], apart from the pass's own rows
    _time(rows, shape, entry, f"atomics alone: kv pass's fp32 atomics at {ATOMICS_TILE}, no scratch load or product",
          lambda: [atomics_alone(plan, t0, scratch_rows) for t0 in starts], 0, reps, reductions=True)
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
    dq_cfg = dqp.DqPassConfig(*best["dq"][1])
    for kv_tile in [best[kind][1] for kind in ("kv", "kv_blocks") if kind in best]:
        dq_pass_whole = functools.partial(dqp.sparse_attention_bwd_dq_pass, *bwd_args,
                                          kv_config=dqp.KvPassConfig(*kv_tile), dq_config=dq_cfg)
        errors = {name: _rel(a, b) for name, a, b in zip(("dq", "dkv", "dsink"), dq_pass_whole(), ref)}
        row = _time(rows, shape, entry, f"dq-pass backward (whole) kv {kv_tile} dq {best['dq'][1]}",
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
