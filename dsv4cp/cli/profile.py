"""Measure one layer step under CP: time (DESIGN 5 protocol), peak memory, model bound, and
optionally a Kineto trace per rank with its per-phase overlap table.

Run as one process (CP = 1) or under torchrun (CP = the number of processes):

    torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile --backend nccl --preset flash --ratio 4 \\
        --tokens 65536 --overlap async --backward --trace-dir traces/ --out results/run.jsonl

Timing and tracing are separate passes: the profiler is never attached while timing.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4cp.cli.env import environment
from dsv4cp.cli.layer import parse_lengths
from dsv4cp.config import DTYPES, PRESET_NAMES, DSv4Config, default_dtype
from dsv4cp.cp.check import randomize_
from dsv4cp.cp.comm import OVERLAP_MODES
from dsv4cp.cp.launch import init_from_env, under_torchrun
from dsv4cp.cp.layout import split_rows
from dsv4cp.layer import DSv4Attention
from dsv4cp.model import estimate
from dsv4cp.ops.sparse_attention import check_backend_name
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling.memory import track_memory
from dsv4cp.profiling.nvtx import capture_range, nvtx_range
from dsv4cp.profiling.timing import benchmark
from dsv4cp.profiling.trace import capture_trace, kineto_overlap_table
from dsv4cp.workloads import PACKINGS, pack_lengths

HELP = "time, memory and (optionally) a per-phase overlap profile of one layer step under CP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--lengths", default=None)
    parser.add_argument("--packing", choices=PACKINGS, default="one")
    parser.add_argument("--doc-len", type=int, default=None, help="document length of --packing fixed")
    parser.add_argument("--overlap", choices=OVERLAP_MODES, default="async")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--l2-flush", action="store_true")
    parser.add_argument("--trace-dir", default=None, help="also capture a Kineto trace per rank here")
    parser.add_argument("--trace-steps", type=int, default=2)
    parser.add_argument("--nsys-steps", type=int, default=0,
                        help="run this many steps inside cudaProfilerStart/Stop (for nsys --capture-range=cudaProfilerApi)")
    parser.add_argument("--out", default=None, help="append the run's JSON record to this .jsonl file")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if under_torchrun():
        device = init_from_env(backend)
        group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    else:
        device, group, cp, rank = torch.device("cuda" if cuda else "cpu"), None, 1, 0
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    cfg = DSv4Config.preset(args.preset)
    lengths = (parse_lengths(args.lengths, args.tokens) if args.lengths
               else pack_lengths(args.tokens, args.packing, doc_len=args.doc_len, seed=args.seed))
    packed = PackedSeqs.from_lengths(lengths, total=args.tokens, device=device)
    cfg.check_ratio(args.ratio)
    split_rows(packed.total, cp, cfg, args.ratio, field="--tokens")
    check_backend_name(args.kernel_backend)
    direction = "fwd+bwd" if args.backward else "fwd"
    bound = estimate(cfg, args.ratio, packed.to("cpu"), cp).summary(direction)  # before measuring anything

    generator = torch.Generator().manual_seed(args.seed)
    layer = DSv4Attention(cfg, args.ratio, backend=args.kernel_backend, overlap=args.overlap,
                          recompute=args.recompute)
    randomize_(layer, generator)
    layer = layer.to(device=device, dtype=dtype)
    rows = packed.total // cp
    x = torch.randn(rows, cfg.hidden, generator=generator).to(device=device, dtype=dtype)
    x.requires_grad_(args.backward)
    upstream = torch.randn(rows, cfg.hidden, generator=generator).to(device=device, dtype=dtype)

    def step() -> None:
        with nvtx_range("step"):
            result = layer(x, packed, cp_group=group)
            if args.backward:
                loss = (result.out * upstream).sum()
                if result.indexer_loss is not None:
                    loss = loss + result.indexer_loss
                loss.backward()

    timing = benchmark(step, warmup=args.warmup, reps=args.reps, group=group, l2_flush=args.l2_flush,
                       device=device)
    with track_memory(device) as tracker:
        step()
    memory = tracker.result.to_dict()
    peaks = _gather_objects(memory, group)

    seconds = timing.median_ms / 1e3
    record = {
        "command": "profile", "preset": args.preset, "ratio": args.ratio, "tokens": args.tokens,
        "docs": len(lengths), "packing": "lengths" if args.lengths else args.packing, "cp": cp,
        "overlap": args.overlap, "recompute": args.recompute, "direction": direction,
        "dtype": str(dtype).removeprefix("torch."), "kernel_backend": args.kernel_backend,
        "timing": timing.to_dict(), "memory_per_rank": peaks,
        "model": {"bound_overlap_ms": bound.bound_overlap_s * 1e3, "bound_serial_ms": bound.bound_serial_s * 1e3,
                  "flops_imbalance": bound.flops_imbalance, "model_flops": bound.model_flops,
                  "tflops_per_gpu": bound.model_tflops_per_gpu(seconds),
                  "measured_over_bound": seconds / bound.bound_overlap_s if bound.bound_overlap_s else None},
        "env": environment(), "git_sha": _git_sha(),
    }

    if args.nsys_steps > 0:
        with capture_range():
            for _ in range(args.nsys_steps):
                step()

    table = None
    if args.trace_dir:
        capture_trace(step, args.trace_dir, steps=args.trace_steps, warmup=1, rank=rank)
        if group is not None:
            dist.barrier(group)
        if rank == 0:
            table = kineto_overlap_table(args.trace_dir)
            table.to_csv(Path(args.trace_dir) / "overlap.csv", index=False)
            record["overlap_table"] = table.to_dict(orient="records")

    if rank == 0:
        _report(record, table)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(record) + "\n")
    if group is not None:
        dist.barrier(group)
        dist.destroy_process_group()
    return 0


def _gather_objects(value, group) -> list:
    if group is None:
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _git_sha() -> str | None:
    head = Path(__file__).resolve().parents[2] / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (head.parent / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return os.environ.get("DSV4CP_GIT_SHA")


def _report(record: dict, table) -> None:
    t, m = record["timing"], record["model"]
    print(f"profile preset={record['preset']} ratio={record['ratio']} tokens={record['tokens']} docs={record['docs']} "
          f"cp={record['cp']} overlap={record['overlap']} recompute={record['recompute']} {record['direction']} "
          f"{record['dtype']} backend={record['kernel_backend']}")
    print(f"time: median {t['median_ms']:.3f} ms (p20 {t['p20_ms']:.3f}, p80 {t['p80_ms']:.3f}, {t['reps']} reps, "
          f"max over ranks)")
    print(f"model: bound {m['bound_overlap_ms']:.3f} ms (serial {m['bound_serial_ms']:.3f}); measured/bound "
          f"{m['measured_over_bound']:.2f}; {m['tflops_per_gpu']:.1f} model TFLOP/s per GPU; "
          f"FLOP imbalance {m['flops_imbalance']:.2f}")
    for rank, mem in enumerate(record["memory_per_rank"]):
        peak = mem.get("peak_allocated_bytes") or mem.get("host_peak_rss_bytes") or 0
        used = mem.get("device_used_bytes")
        print(f"rank {rank}: peak {peak / 2**30:.2f} GiB" + (f", device used {used / 2**30:.2f} GiB" if used else ""))
    if table is not None:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
