"""Measure one layer step under CP: time (docs/design.md §5 protocol), per-rank times, peak memory, model bound,
and optionally a Kineto trace per rank with its per-phase overlap table. One sweep point, measured by
the same code as ``dsv4cp sweep`` and recorded in the same schema.

Run as one process (CP = 1) or under torchrun (CP = the number of processes):

    torchrun --nproc-per-node 2 -m dsv4cp profile --dist-backend nccl --preset flash --ratio 4 \\
        --tokens 65536 --overlap async --backward --trace-dir traces/ --out runs/profile

Timing and tracing are separate passes: the profiler is never attached while timing. With
``--cuda-graph`` (CUDA, CP = 1) the timed steps are replays of the step captured once in a CUDA graph,
the kernels' time without Python and launch overhead; memory and traced steps stay eager.

With fewer devices than ranks, ``--cp N --emulate-rank R`` measures rank R of a CP = N run alone in one
process (:mod:`dsv4cp.cp.emulate`): its compute time and peak memory, NOT its communication time
(collectives are no-ops; the rows they would have delivered are drawn at random). Run it once per rank.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist

from dsv4cp.cli.common import (
    add_dist_backend_option,
    add_layer_options,
    add_machine_options,
    add_memory_options,
    add_timing_options,
    check_args_agree,
    check_memory,
    check_output_dir,
    layer_inputs,
    machine_from_args,
    non_negative_int,
    parse_lengths,
    positive_int,
    progress_enabled,
    resolve_dist_backend,
)
from dsv4cp.config import DTYPES, default_dtype
from dsv4cp.cp.emulate import destroy_emulated_group, init_emulated_group
from dsv4cp.cp.launch import init_from_env, under_torchrun
from dsv4cp.cp.partition import POLICIES
from dsv4cp.environment import git_sha, machine_label
from dsv4cp.model.calibration import Calibration
from dsv4cp.profiling.compilation import COMPILE_BACKENDS
from dsv4cp.profiling.memory import peak_phase_line, phase_memory_frame
from dsv4cp.profiling.memory_snapshot import check_snapshot_request, snapshot_name
from dsv4cp.profiling.overlap import attribution_lines
from dsv4cp.profiling.progress import step_progress
from dsv4cp.records import RECORDS_FILE, append_record, make_record, write_meta
from dsv4cp.sweeps.measure import check_cuda_graph, measure_point
from dsv4cp.sweeps.meta import run_meta
from dsv4cp.sweeps.spec import Point, RunOptions, make_point

HELP = "time, memory and (optionally) a per-phase overlap profile of one layer step under CP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layer_options(parser, cp=True)
    parser.add_argument("--partition", choices=POLICIES, default="equal",
                        help="row split over the ranks: equal (T / cp rows each) or balanced (contiguous "
                             "slices sized so every rank's modelled time of the timed pass is the same, refined on the "
                             "model's per-rank evaluation)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (default: forward)")
    parser.add_argument("--cp", type=positive_int, default=None,
                        help="with --emulate-rank: the number of CP ranks to emulate (a real run has one per "
                             "torchrun process)")
    parser.add_argument("--emulate-rank", type=non_negative_int, default=None, metavar="R",
                        help="measure rank R of --cp ranks alone in this one process, collectives replaced by "
                             "no-ops: compute time and memory only, communication NOT measured")
    add_timing_options(parser)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time the step as CUDA-graph replays (no host overhead; traces and memory stay "
                             "eager); CUDA only")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True); --kernel-backend auto then picks "
                             "deterministic backends only (triton-deterministic for Triton)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, choices=COMPILE_BACKENDS,
                        metavar="BACKEND", help="run the layer under torch.compile (BACKEND one of "
                        f"{', '.join(COMPILE_BACKENDS)}; default inductor); the compiling first step is timed apart")
    add_dist_backend_option(parser)
    add_machine_options(parser)
    add_memory_options(parser)
    parser.add_argument("--calibration", default=None,
                        help="JSON of measured/bound phase factors (dsv4cp model --calibrate) that --partition "
                             "balanced equalises; recorded in the record")
    parser.add_argument("--trace-dir", default=None, help="also capture a Kineto trace per rank here")
    parser.add_argument("--trace-steps", type=positive_int, default=2, help="steps recorded in the Kineto trace")
    parser.add_argument("--nsys-steps", type=non_negative_int, default=0,
                        help="run this many steps inside cudaProfilerStart/Stop "
                             "(for nsys --capture-range=cudaProfilerApi)")
    parser.add_argument("--memory-phases", action="store_true",
                        help="one more step recording each phase's allocated memory at entry and exit and its "
                             "peak, per rank (where the peak sits; CUDA allocator, host RSS on CPU)")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help="one more step recording the CUDA allocator's history, written per rank as "
                             "TRACE_DIR/memory_snapshot_rank<r>.pickle (open it in pytorch.org/memory_viz); CUDA "
                             "only, needs --trace-dir")
    parser.add_argument("--out", default=None,
                        help="run directory: append the record to OUT/records.jsonl (meta.json written once)")


def point_from_args(args: argparse.Namespace, cp: int, device: torch.device) -> Point:
    """The sweep point the flags describe; ``ValueError`` naming the flag when they cannot form one."""
    if args.pad_to_multiple != 1:
        raise ValueError(f"--pad-to-multiple: profile measures unpadded documents, got {args.pad_to_multiple}")
    lengths = parse_lengths(args.lengths)
    tokens = args.tokens or (sum(lengths) if lengths else args._tokens_default)
    if lengths is not None:
        packing = "lengths:" + ",".join(map(str, lengths))
    elif args.packing == "fixed":
        packing = f"fixed:{args.doc_len or max(1, tokens // 8)}"
    else:
        packing = args.packing
    dtype = args.dtype or next(name for name, value in DTYPES.items() if value == default_dtype(device))
    return make_point({
        "preset": args.preset, "ratio": args.ratio, "cp": cp, "tokens": tokens, "packing": packing,
        "loss": args.loss, "overlap": args.overlap, "kernel_backend": args.kernel_backend,
        "recompute": args.recompute, "pass": "fwd+bwd" if args.backward else "fwd", "dtype": dtype,
        "seed": args.seed, "partition": args.partition, "cuda_graph": args.cuda_graph,
        "deterministic": args.deterministic, "compile": args.compile,
    })


def run(args: argparse.Namespace) -> int:
    distributed = under_torchrun()
    backend = resolve_dist_backend(args, distributed=distributed)
    out = check_output_dir(args.out, "--out")
    trace_dir = check_output_dir(args.trace_dir, "--trace-dir")
    check_snapshot_request(args.memory_snapshot, trace_dir is not None, "--trace-dir")
    machine = machine_from_args(args)
    calibration = None if args.calibration is None else Calibration.load(args.calibration)
    run_options = RunOptions(warmup=args.warmup, reps=args.reps, l2_flush=args.l2_flush,
                             trace_steps=args.trace_steps, nsys_steps=max(args.nsys_steps, 1))
    emulated = _check_emulation(args, distributed)
    if emulated:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        group, cp, rank = None, args.cp, args.emulate_rank  # the group once the flags are all checked
    elif distributed:
        device = init_from_env(backend)
        group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
        check_args_agree(args, group)
    else:
        device, group, cp, rank = torch.device("cuda" if torch.cuda.is_available() else "cpu"), None, 1, 0
    point = point_from_args(args, cp, device)
    if emulated:
        point = dataclasses.replace(point, emulated_rank=rank)
    check_cuda_graph(point, device)
    check_memory(layer_inputs(args, cp), args.ratio, cp, backward=args.backward, dtype=DTYPES[point.dtype],
                 recompute=args.recompute, device=device, force=args.force)
    if emulated:
        group = init_emulated_group(cp, rank, seed=args.seed)
    try:
        _measure_and_report(args, point, group, device, rank, run_options, machine, trace_dir, calibration, out)
    finally:  # also on an error: the fake group must not outlive this command in the process
        if emulated:
            destroy_emulated_group(group)
    if not emulated and group is not None:
        dist.barrier(group)
        dist.destroy_process_group()
    return 0


def _measure_and_report(args, point, group, device, rank, run_options, machine, trace_dir, calibration, out) -> None:
    """Measure the point and print / write its record (rank 0, or the emulated rank)."""
    emulated = point.emulated_rank is not None
    processes = 1 if emulated else point.cp  # what the machine label and meta describe
    # a graph point warms up eagerly (at least once) before its capture, then with untimed replays
    warmup = max(args.warmup, 1) + args.warmup if point.cuda_graph else args.warmup
    with step_progress(warmup, args.reps, enabled=progress_enabled(args.progress, rank)) as on_step:
        measurement = measure_point(point, group, device, run_options, machine=machine, trace_dir=trace_dir,
                                    nsys=args.nsys_steps > 0, on_step=on_step,
                                    memory_phases=args.memory_phases, calibration=calibration,
                                    memory_snapshot=args.memory_snapshot)
    if rank == 0 or emulated:
        record = make_record(point.axes(), measurement.metrics, sweep="profile", status="ok",
                             machine=machine_label(device, processes), git_sha=git_sha(),
                             resolved_backends=measurement.resolved_backends)
        _report(point, record, measurement.overlap, machine.name)
        if measurement.attribution is not None:
            print("\n".join(attribution_lines(measurement.attribution)))
        if record["memory_phases"] is not None:
            _report_memory_phases(record["memory_phases"])
        if args.memory_snapshot:
            ranks = [point.emulated_rank] if emulated else range(point.cp)
            print("memory snapshots (open at pytorch.org/memory_viz): "
                  + ", ".join(str(trace_dir / snapshot_name(r)) for r in ranks))
        if out is not None:
            if not (out / "meta.json").exists():
                options = {name: value for name, value in vars(args).items() if not name.startswith("_")}
                write_meta(out, run_meta(processes, device, {"command": "profile", **options}))
            append_record(out / RECORDS_FILE, record)


def _check_emulation(args: argparse.Namespace, distributed: bool) -> bool:
    """Whether ``--emulate-rank`` asks for rank emulation; ``ValueError`` naming the flag for a bad
    combination, before any process group exists."""
    if args.emulate_rank is None:
        if args.cp is not None:
            raise ValueError(f"--cp: only with --emulate-rank (a real run has one rank per torchrun process), "
                             f"got --cp {args.cp}")
        return False
    if distributed:
        raise ValueError(f"--emulate-rank: emulates one rank in a single process; run it without torchrun, "
                         f"got --emulate-rank {args.emulate_rank} under torchrun")
    if args.cp is None or args.cp < 2:
        raise ValueError(f"--cp: --emulate-rank needs --cp N with N >= 2 ranks, got {args.cp}")
    if args.emulate_rank >= args.cp:
        raise ValueError(f"--emulate-rank: must be a rank in [0, {args.cp}) of --cp {args.cp}, got {args.emulate_rank}")
    return True


def _report(point: Point, record: dict, table, bound_machine: str) -> None:
    print(f"profile {point.label()} (point {record['point_id']}, {record['machine']})")
    emulated = record["emulated_rank"]
    if emulated is not None:
        print(f"EMULATED rank {emulated} of cp {point.cp}, alone in one process: collectives are no-ops, so the "
              "time is this rank's compute only (communication NOT measured) and the memory is this rank's")
        print(f"time: median {record['time_ms_median']:.3f} ms (p20 {record['time_ms_p20']:.3f}, "
              f"p80 {record['time_ms_p80']:.3f}) on rank {emulated}, compute only")
    else:
        print(f"time: median {record['time_ms_median']:.3f} ms (p20 {record['time_ms_p20']:.3f}, "
              f"p80 {record['time_ms_p80']:.3f}, max over ranks); per rank "
              + ", ".join(f"{t:.3f}" for t in record["rank_time_ms_median"])
              + f" ms (imbalance {record['imbalance_max_over_mean']:.2f})")
    if record["cuda_graph"]:
        print("time: CUDA-graph replays (no host overhead); peak memory, memory phases and traced steps are eager")
    if record["deterministic"]:
        print(f"deterministic: torch.use_deterministic_algorithms(True), sparse attention "
              f"{record['resolved_backends']['sparse_attention']}")
    if record["compile"] is not None:
        print(f"compile ({record['compile']}): first step {record['compile_s']:.2f} s, not in the timed steps; "
              f"{record['graph_breaks']} graph break(s)")
    ratio = record["measured_over_bound"]
    print(f"model (bound for machine {bound_machine}): bound {record['bound_ms']:.3g} ms; measured/bound "
          + (f"{ratio:.2f}" if ratio is not None else "n/a")
          + f"; {record['tflops_per_gpu']:.3g} model TFLOP/s per GPU; {record['tokens_per_s']:.0f} tokens/s")
    for rank, (peak, used) in enumerate(zip(record["peak_allocated_bytes"], record["device_used_bytes"])):
        if emulated is not None and rank != emulated:
            continue  # not measured: only the emulated rank ran
        used_text = f", device used {used / 2**30:.2f} GiB" if used else ""
        print(f"rank {rank}: peak {(peak or 0) / 2**30:.2f} GiB{used_text}")
    if table is not None:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def _report_memory_phases(per_rank: list[dict | None]) -> None:
    """The per-phase memory table of every measured rank and, per rank, the phase holding its peak
    (None: a rank not measured here, or a device without a resettable peak)."""
    if all(mine is None for mine in per_rank):
        print("memory phases: not measurable on this device (no resettable peak)")
        return
    frame = phase_memory_frame([None if mine is None else mine["rows"] for mine in per_rank])
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for rank, mine in enumerate(per_rank):
        if mine is not None:
            print(peak_phase_line(rank, mine["peak_bytes"], mine["peak_stack"]))
