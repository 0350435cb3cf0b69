"""Sweep the Triton sparse-attention launch configurations on one GPU.

Times every candidate configuration of the forward and the backward at the benchmark shapes of
``bench/test_bench_sparse_attention.py`` (``flash``: T 16384, H 64, Kt 640; ``pro``: T 16384, H 128,
Kt 1152; D 512, bf16, same inputs, same FLOP count), checks each candidate against the torch op in fp32
on the last ``--check-tokens`` queries (bf16 tolerance of the GPU tests: relative Frobenius error
< 1e-2), prints a table of medians and TFLOP/s and writes the rows as JSON. Each row also says which
environment variables pin that configuration in any other run (the bench, ``dsv4cp profile``).

Not collected by pytest (no ``test_`` prefix); run it as a module from the repository root on a CUDA
machine (it imports ``bench.test_bench_sparse_attention``)::

    python -m bench.sweep_sparse_attention_configs --json sweep_sparse_attention.json

Every candidate compiles once (about 10-20 s each, which dominates the run); ``--shapes``, ``--only``
and ``--match`` (a regular expression on the candidates' names, e.g. ``split``) narrow the sweep;
``bench/sparse_attention_resources.py`` lists the candidates' registers, spills and shared memory on
sm_90 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The benchmark module's shapes, inputs and FLOP count, so the figures compare with its records.
from bench.test_bench_sparse_attention import SHAPES, _flops_forward, _inputs
from dsv4cp.environment import environment, machine_label
from dsv4cp.profiling.timing import benchmark  # the suite's timer: CUDA events, a sync before each call

BACKWARD_FLOP_FACTOR = 2.5  # DESIGN 4.3, as bench/test_bench_sparse_attention.py
TOLERANCE = 1e-2  # relative Frobenius error of bf16 against fp32 (tests/kernels GPU tests)


@dataclass(frozen=True)
class Candidate:
    """One launch to time: the forward's ``(block_h, block_k, num_warps, num_stages)``, its logits' layout
    (default here: the layout before the split, to compare with) and whether it loads the indices ahead, or
    the backward's first kernel (same fields), its dkv kernel ``(block_k, block_d, num_warps, num_stages)``,
    where dq is accumulated and whether the dkv kernel forms its gradient as one product. ``heads``: the
    head counts it is meant for (its dkv tiles depend on H)."""

    direction: str
    config: tuple[int, int, int, int]
    dkv: tuple[int, int, int, int] | None = None
    dq_in_dkv: bool = False
    heads: tuple[int, ...] = (64, 128)
    note: str = ""
    logits: str = "duplicated"
    one_product: bool = False
    index_ahead: bool = False
    lazy_rescale: bool = False

    @property
    def name(self) -> str:
        text = "x".join(map(str, self.config))
        if self.direction == "bwd":
            text += (" / dkv " + "x".join(map(str, self.dkv)) + (" dq-in-dkv" if self.dq_in_dkv else "")
                     + (" one-product" if self.one_product else ""))
        layout = "" if self.logits == "duplicated" else " " + self.logits.replace("_", "-") + " logits"
        return (text + layout + (" index-ahead" if self.index_ahead else "")
                + (" lazy-rescale" if self.lazy_rescale else ""))

    @property
    def env(self) -> dict[str, str]:
        """The environment that pins this candidate without keyword arguments."""
        join, flag = ",".join, lambda on: "1" if on else "0"
        if self.direction == "fwd":
            return {"DSV4CP_TRITON_FWD_CONFIG": join(map(str, self.config)),
                    "DSV4CP_TRITON_FWD_LOGITS": self.logits,
                    "DSV4CP_TRITON_FWD_INDEX_AHEAD": flag(self.index_ahead),
                    "DSV4CP_TRITON_FWD_LAZY_RESCALE": flag(self.lazy_rescale)}
        return {"DSV4CP_TRITON_BWD_CONFIG": join(map(str, self.config)),
                "DSV4CP_TRITON_DKV_CONFIG": join(map(str, self.dkv)),
                "DSV4CP_TRITON_DQ_IN_DKV": flag(self.dq_in_dkv),
                "DSV4CP_TRITON_DKV_ONE_PRODUCT": flag(self.one_product),
                "DSV4CP_TRITON_BWD_INDEX_AHEAD": flag(self.index_ahead)}


# Candidates: the ones that compile for sm_90a with Triton 3.6 (the GPU machine's) within the shared
# memory and without spills, or with the fewest (triton.compile for target cuda 90 with the launch's
# 16-byte divisibility specialisation, then cuobjdump -res-usage; no GPU needed): registers per thread,
# shared memory and stack bytes from spills in the notes (H = 64 unless a row is for 128 heads only;
# ``python -m bench.sparse_attention_resources`` prints them all). The first row of each direction and
# shape is today's default.
CANDIDATES = [
    Candidate("fwd", (64, 64, 8, 2), logits="split", index_ahead=True, note="default; 255 regs, 208 KB, 8 B stack"),
    Candidate("fwd", (64, 32, 8, 3), logits="split", index_ahead=True,
              note="rows 2 steps ahead; 228 regs, 168 KB, no spill"),
    Candidate("fwd", (64, 32, 8, 4), logits="split", index_ahead=True,
              note="rows 3 steps ahead; 228 regs, 200 KB, no spill"),
    Candidate("fwd", (64, 64, 8, 2), logits="split", index_ahead=True, lazy_rescale=True,
              note="rescale when a max rises by 2^8; 255 regs, 176 B stack"),
    Candidate("fwd", (64, 32, 8, 4), logits="split", index_ahead=True, lazy_rescale=True,
              note="255 regs, 16 B stack, 200 KB"),
    Candidate("fwd", (64, 64, 8, 2), note="the layout before: duplicated logits; 255 regs, 192 KB, no spill"),
    Candidate("fwd", (64, 32, 8, 3), note="128 KB, 40 B stack"),
    Candidate("fwd", (64, 64, 8, 2), logits="split", note="246 regs, 208 KB (H 128: 40 B stack)"),
    Candidate("fwd", (64, 32, 8, 3), logits="split", note="233 regs, 136 KB (H 128: 40 B stack)"),
    Candidate("fwd", (64, 64, 8, 1), logits="split", note="255 regs, 144 KB, no spill"),
    Candidate("fwd", (64, 64, 8, 2), index_ahead=True, note="255 regs, 192 KB, 8 B stack (H 128: 80 B)"),
    Candidate("fwd", (64, 64, 8, 1), logits="split", index_ahead=True, note="255 regs, 144 KB, 8 B stack"),
    Candidate("fwd", (64, 64, 8, 3), note="3 stages: indices a step ahead by the pipeliner; 255 regs, 192 KB"),
    Candidate("fwd", (64, 64, 8, 3), logits="split", note="3 stages; 252 regs, 208 KB (H 128: 40 B stack)"),
    Candidate("fwd", (64, 128, 8, 1), logits="slots_on_m", note="wgmma N 64; 255 regs, 208 KB, 272 B stack"),
    Candidate("fwd", (64, 128, 8, 1), logits="slots_on_m", index_ahead=True, note="255 regs, 208 KB, 408 B stack"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 2), True, heads=(64,), note="default; scores 160 regs, 1 stage"),
    Candidate("bwd", (32, 64, 8, 2), (64, 256, 8, 2), heads=(64,), note="dq kernel: mma.sync 225 regs"),
    Candidate("bwd", (32, 32, 8, 2), (64, 256, 8, 2), heads=(64,), note="dq 185 regs, 98 KB"),
    Candidate("bwd", (64, 32, 8, 2), (64, 256, 8, 2), True, heads=(64,), note="wgmma 140 regs; dkv 252 regs 224 KB"),
    Candidate("bwd", (64, 32, 8, 2), (64, 128, 8, 2), True, heads=(64,), note="dkv 153 regs, 2x p/ds reads"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 2), True, heads=(64,), one_product=True,
              note="dkv 242 regs, 208 KB, no spill"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 1), True, heads=(64,), one_product=True,
              note="dkv 254 regs, 128 KB, 1 stage"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 16, 1), True, heads=(64,), one_product=True,
              note="dkv 16 warps, 128 regs, 128 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 8, 2), True, heads=(64,), one_product=True,
              note="dkv 138 regs, 112 KB, 2x p/ds reads"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 2), True, heads=(64,), index_ahead=True,
              note="scores 186 regs; dkv 255 regs, 104 B stack"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 2), True, heads=(64,), one_product=True, index_ahead=True,
              note="scores 186 regs; dkv 230 regs, 208 KB, no spill"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 1), True, heads=(64,), one_product=True, index_ahead=True,
              note="scores 186 regs; dkv 253 regs, 128 KB, 1 stage"),
    Candidate("bwd", (64, 64, 8, 1), (64, 256, 8, 3), True, heads=(64,), one_product=True,
              note="dkv 3 stages: indices a step ahead by the pipeliner; 230 regs, 208 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 4, 2), True, heads=(64,), one_product=True,
              note="dkv 2 CTAs per SM: 4 warps, 238 regs, 112 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 4, 2), True, heads=(64,), one_product=True, index_ahead=True,
              note="dkv 2 CTAs per SM: 234 regs, 112 KB; scores 186 regs"),
    Candidate("bwd", (64, 64, 8, 1), (64, 64, 4, 2), True, heads=(64,), one_product=True,
              note="dkv 3 CTAs per SM: 130 regs, 64 KB, 8x p/ds reads"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 8, 2), True, heads=(128,), note="default; dkv 224 regs, 192 KB"),
    Candidate("bwd", (32, 64, 8, 2), (64, 128, 8, 2), heads=(128,), note="dq kernel: mma.sync"),
    Candidate("bwd", (32, 32, 8, 2), (64, 128, 8, 2), heads=(128,), note="dq 185 regs, 98 KB"),
    Candidate("bwd", (64, 32, 8, 2), (64, 128, 8, 2), True, heads=(128,), note="dkv 224 regs, 192 KB"),
    Candidate("bwd", (64, 32, 8, 2), (64, 64, 8, 2), True, heads=(128,), note="dkv 142 regs, 2x p/ds reads"),
    Candidate("bwd", (64, 32, 8, 2), (64, 128, 8, 2), True, heads=(128,), one_product=True,
              note="dkv 227 regs, 160 KB"),
    Candidate("bwd", (64, 32, 8, 2), (64, 64, 8, 2), True, heads=(128,), one_product=True,
              note="dkv 2 CTAs per SM: 112 regs, 96 KB, 2x p/ds reads"),
    Candidate("bwd", (64, 64, 8, 1), (64, 64, 8, 2), True, heads=(128,), one_product=True,
              note="dkv 2 CTAs per SM: 112 regs, 96 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 64, 4, 2), True, heads=(128,), one_product=True,
              note="dkv 2 CTAs per SM: 4 warps, 214 regs, 96 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 8, 2), True, heads=(128,), one_product=True, index_ahead=True,
              note="scores 186 regs; dkv 232 regs, 160 KB"),
    Candidate("bwd", (64, 64, 8, 1), (64, 128, 8, 3), True, heads=(128,), one_product=True,
              note="dkv 3 stages; 231 regs, 160 KB"),
]


@dataclass
class Row:
    shape: str
    direction: str
    candidate: str
    note: str
    env: dict[str, str]
    median_ms: float = float("nan")
    p20_ms: float = float("nan")
    p80_ms: float = float("nan")
    tflops: float = float("nan")
    rel_err: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    error: str = ""
    wall_s: float = float("nan")  # compile, check and timing of this candidate


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    den = b64.norm().item()
    return (a64 - b64).norm().item() / den if den > 0 else (a64 - b64).norm().item()


def fwd_call(cand: Candidate, q, kv, idx, sink, scale):
    from dsv4cp.kernels.sparse_attention_triton import sparse_attention_fwd

    bh, bk, nw, ns = cand.config
    return sparse_attention_fwd(q, kv, idx, sink, scale, block_h=bh, block_k=bk, num_warps=nw, num_stages=ns,
                                logits=cand.logits, index_ahead=cand.index_ahead, lazy_rescale=cand.lazy_rescale)


def bwd_call(cand: Candidate, dout, q, kv, idx, sink, scale, out, lse):
    from dsv4cp.kernels.sparse_attention_triton import DkvConfig, sparse_attention_bwd

    bh, bk, nw, ns = cand.config
    return sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, deterministic=False, block_h=bh,
                                block_k=bk, num_warps=nw, num_stages=ns, dkv_config=DkvConfig(*cand.dkv),
                                dq_in_dkv=cand.dq_in_dkv, dkv_one_product=cand.one_product,
                                index_ahead=cand.index_ahead)


def reference(args, dout, check_tokens: int):
    """fp32 torch forward / backward of the last ``check_tokens`` queries (every kv row kept)."""
    from dsv4cp.ops.sparse_attention_torch import sparse_attention_backward, sparse_attention_forward

    q, kv, idx, sink, scale = args
    q32, kv32 = q[-check_tokens:].float(), kv.float()
    out, lse = sparse_attention_forward(q32, kv32, idx[-check_tokens:], sink, scale)
    grads = sparse_attention_backward(dout[-check_tokens:].float(), q32, kv32, idx[-check_tokens:], sink, scale,
                                      out, lse)
    return out, lse, grads


def run_candidate(cand: Candidate, shape, entry, fwd_out, dout, ref, reps: int, warmup: int,
                  check_tokens: int) -> Row:
    """Time ``cand`` at ``shape`` (inputs ``entry``; the backward's out / lse ``fwd_out`` and ``dout``) and
    check it against ``ref`` (fp32 torch of the last ``check_tokens`` queries)."""
    row = Row(shape.name, cand.direction, cand.name, cand.note, cand.env)
    q, kv, idx, sink, scale = entry["args"]
    flops = _flops_forward(shape, entry["valid"])
    try:
        if cand.direction == "fwd":
            out, lse = fwd_call(cand, q, kv, idx, sink, scale)
            row.rel_err = {"out": rel_fro(out[-check_tokens:], ref[0]),
                           "lse": rel_fro(lse[-check_tokens:], ref[1])}
            timing = benchmark(lambda: fwd_call(cand, q, kv, idx, sink, scale), warmup=warmup, reps=reps,
                               device=q.device)
        else:
            flops *= BACKWARD_FLOP_FACTOR
            out, lse = fwd_out
            tail = slice(q.shape[0] - check_tokens, None)
            small = bwd_call(cand, dout[tail], q[tail], kv, idx[tail], sink, scale, out[tail], lse[tail])
            row.rel_err = {name: rel_fro(a.float(), b) for name, a, b in zip(("dq", "dkv", "dsink"), small, ref[2])}
            timing = benchmark(lambda: bwd_call(cand, dout, q, kv, idx, sink, scale, out, lse), warmup=warmup,
                               reps=reps, device=q.device)
    except Exception as exc:  # noqa: BLE001 - one failing candidate (OutOfResources, a bug) must not end the sweep
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return row
    row.median_ms, row.p20_ms, row.p80_ms = timing.median_ms, timing.p20_ms, timing.p80_ms
    row.tflops = flops / (row.median_ms * 1e-3) / 1e12
    row.ok = all(err < TOLERANCE for err in row.rel_err.values())
    return row


def print_row(row: Row) -> None:
    errs = " ".join(f"{k}={v:.1e}" for k, v in row.rel_err.items())
    status = "ok" if row.ok else ("ERROR " + row.error if row.error else "WRONG")
    print(f"{row.shape:5s} {row.direction} {row.candidate:38s} {row.median_ms:8.3f} ms {row.tflops:7.1f} TFLOP/s "
          f"[{errs}] {status} ({row.wall_s:.0f} s) {row.note}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows (JSON)")
    parser.add_argument("--shapes", default="flash,pro", help="comma-separated: flash, pro")
    parser.add_argument("--only", choices=("fwd", "bwd"), help="one direction only")
    parser.add_argument("--match", default="", help="only candidates whose name matches this regular expression "
                        "(e.g. one-product)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per candidate (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument("--check-tokens", type=int, default=1024, help="queries checked against torch")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in shapes:
        if name not in ("flash", "pro"):
            parser.error(f"--shapes: unknown shape {name!r} (flash, pro)")
    args.shapes = shapes
    if args.reps < 10:
        parser.error(f"--reps: at least 10 timed calls for a median, got {args.reps}")
    if args.warmup < 1:
        parser.error(f"--warmup: at least 1 (the first call compiles), got {args.warmup}")
    if args.check_tokens < 1:
        parser.error(f"--check-tokens: must be positive, got {args.check_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_sparse_attention_configs: needs a CUDA device", file=sys.stderr)
        return 2

    rows: list[Row] = []
    started = time.perf_counter()
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        entry = _inputs(shape)
        q = entry["args"][0]
        gen = torch.Generator(device=q.device).manual_seed(4321)
        dout = torch.randn(q.shape, device=q.device, generator=gen).to(q.dtype)
        ref = reference(entry["args"], dout, min(args.check_tokens, shape.tokens))
        fwd_out = fwd_call(CANDIDATES[0], *entry["args"])  # the backward's out and lse
        for cand in CANDIDATES:
            if (args.only and cand.direction != args.only) or shape.heads not in cand.heads or \
                    not re.search(args.match, cand.name):
                continue
            begin = time.perf_counter()
            row = run_candidate(cand, shape, entry, fwd_out, dout, ref, args.reps, args.warmup,
                                min(args.check_tokens, shape.tokens))
            row.wall_s = time.perf_counter() - begin
            print_row(row)
            rows.append(row)
        del entry, fwd_out, dout, ref
        torch.cuda.empty_cache()
    meta = {"device": machine_label("cuda"), "environment": environment("cuda"),
            "shapes": {n: vars(SHAPES[n]) | {"kt": SHAPES[n].kt} for n in args.shapes},
            "reps": args.reps, "warmup": args.warmup, "tolerance": TOLERANCE,
            "wall_s": time.perf_counter() - started}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": [vars(r) for r in rows]}, indent=1))
    print("best per shape and direction (correct rows only):")
    for shape_name in args.shapes:
        for direction in ("fwd", "bwd"):
            good = [r for r in rows if r.shape == shape_name and r.direction == direction and r.ok]
            if good:
                best = min(good, key=lambda r: r.median_ms)
                env = " ".join(f"{k}={v}" for k, v in best.env.items())
                print(f"  {shape_name} {direction}: {best.tflops:.1f} TFLOP/s  {env}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
