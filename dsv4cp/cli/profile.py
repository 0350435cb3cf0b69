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
(collectives are no-ops; the rows they would have delivered are drawn at random). ``--emulate-rank all``
measures every rank in turn in this one process and prints the per-rank table (max/mean, the slowest rank);
``--out`` then gets one record per rank and a summary record (``emulated_rank`` ``"all"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.distributed as dist

from dsv4cp.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    WouldNotFitError,
    add_dist_backend_option,
    add_layer_options,
    add_machine_options,
    add_memory_options,
    add_timing_options,
    check_args_agree,
    check_memory,
    check_output_dir,
    free_bytes,
    kernel_option_values,
    kernels_line,
    layer_inputs,
    machine_from_args,
    non_negative_int,
    parse_lengths,
    positive_float,
    positive_int,
    progress_enabled,
    resolve_dist_backend,
)
from dsv4cp.cli.profile_ranks import append_to_run, emulate_in_turn, emulate_measured, measure_measured, record_of
from dsv4cp.config import DTYPES, default_dtype
from dsv4cp.cp.emulate import destroy_emulated_group, init_emulated_group
from dsv4cp.cp.launch import init_from_env, under_torchrun
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.fresh_batches import batch_bytes
from dsv4cp.harness.time import NonFiniteResult
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import Machine, no_machine_reason
from dsv4cp.model.memory_split import memory_capped_split, trade_off
from dsv4cp.profiling.compilation import COMPILE_BACKENDS
from dsv4cp.profiling.memory import peak_phase_line, phase_memory_frame
from dsv4cp.profiling.memory_snapshot import check_snapshot_request, snapshot_name
from dsv4cp.profiling.overlap import attribution_lines
from dsv4cp.profiling.progress import step_progress
from dsv4cp.sweeps.measure import check_cuda_graph, check_fresh_batches, measure_point, point_inputs, point_split
from dsv4cp.sweeps.measured_split import MAX_ROUNDS, TARGET_IMBALANCE, load_split
from dsv4cp.sweeps.spec import ALL_RANKS, MEASURED, PARTITIONS, Point, RunOptions, make_point

HELP = "time, memory and (optionally) a per-phase overlap profile of one layer step under CP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layer_options(parser, cp=True)
    parser.add_argument("--partition", choices=PARTITIONS, default="equal",
                        help="row split over the ranks: equal (T / cp rows each), balanced (contiguous "
                             "slices sized so every rank's modelled time of the timed pass is the same, refined on the "
                             "model's per-rank evaluation) or measured (balanced, then refitted on measured rank "
                             "times until max/mean <= --target-imbalance; every rank measured per round: "
                             "--emulate-rank all or torchrun)")
    parser.add_argument("--split-file", default=None,
                        help="with --partition measured: measure the split saved by an earlier measured run "
                             "(--save-split) instead of refining one")
    parser.add_argument("--save-split", default=None,
                        help="with --partition measured: write the best split and every round here (JSON)")
    parser.add_argument("--save-calibration", default=None,
                        help="with --partition measured: write the refitted calibration here (a --calibration file)")
    parser.add_argument("--target-imbalance", type=positive_float, default=TARGET_IMBALANCE,
                        help="with --partition measured: stop refining once max/mean rank time is at most this")
    parser.add_argument("--max-rounds", type=positive_int, default=MAX_ROUNDS,
                        help="with --partition measured: at most this many splits are measured")
    parser.add_argument("--max-rank-memory", type=positive_float, default=None, metavar="GIB",
                        help="keep every rank's estimated peak memory at most GIB: the balanced or measured "
                             "split moves towards equal slices until it fits (printed beside equal and balanced)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (default: forward)")
    parser.add_argument("--cp", type=positive_int, default=None,
                        help="with --emulate-rank: the number of CP ranks to emulate (a real run has one per "
                             "torchrun process)")
    parser.add_argument("--emulate-rank", type=_emulated_rank, default=None, metavar="R|R,S,...|all",
                        help="measure rank R of --cp ranks alone in this one process, collectives replaced by "
                             "no-ops: compute time and memory only, communication NOT measured; a list: those "
                             "ranks in turn (a sample of a large cp); 'all': every rank in turn, then the "
                             "per-rank table and a summary record")
    add_timing_options(parser)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time the step as CUDA-graph replays (no host overhead; traces and memory stay "
                             "eager); CUDA only")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True); --kernel-backend auto then picks "
                             "deterministic backends only (triton-deterministic for Triton)")
    parser.add_argument("--fresh-batches", type=_fresh_batch_count, default=0, metavar="N",
                        help="0 (default): every step runs on one batch, whose layout (CP layout, gathered-row "
                             "maps, RoPE tables) is built once and then reused, as by the layers of a deep model. "
                             "N >= 2: build N distinct batches of the same documents before timing and cycle the "
                             "steps (warm-up, timed, traced, memory) through them, every step building its "
                             "batch's layout again, as a one-layer model fed a new batch every step. All N "
                             "batches stay in memory (input rows, upstream gradient and, with --backward, the "
                             "input's gradient each): refused when the estimate does not fit (--force skips "
                             "that). Not with --cuda-graph; under --compile the traced layer builds the layout in "
                             "every step either way")
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
        "kernel_options": kernel_option_values(args) or None,
        "deterministic": args.deterministic, "compile": args.compile, "fresh_batches": args.fresh_batches,
    })


def run(args: argparse.Namespace) -> int:
    distributed = under_torchrun()
    backend = resolve_dist_backend(args, distributed=distributed)
    out = check_output_dir(args.out, "--out")
    trace_dir = check_output_dir(args.trace_dir, "--trace-dir")
    check_snapshot_request(args.memory_snapshot, trace_dir is not None, "--trace-dir")
    calibration = None if args.calibration is None else Calibration.load(args.calibration)
    machine = machine_from_args(args, calibration)
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
    note = None if calibration is None else calibration.rank_factors_note(point.cp)
    if note is not None and (not distributed or rank == 0):
        print(note)
    if emulated and isinstance(rank, int):
        point = dataclasses.replace(point, emulated_rank=rank)
    check_fresh_batches(point)
    check_cuda_graph(point, device)
    step_bytes = check_memory(layer_inputs(args, cp), args.ratio, cp, backward=args.backward,
                              dtype=DTYPES[point.dtype], recompute=args.recompute, device=device, force=args.force)
    split = _fixed_split(args, point)
    if args.max_rank_memory is not None and point.partition != MEASURED:
        split = _memory_capped(args, point, machine, calibration)
    _check_fresh_batch_memory(args, point, step_bytes, device, split, machine, calibration)
    if point.partition == MEASURED and split is None:
        if rank != ALL_RANKS and not distributed:
            raise ValueError("--partition measured: measures every rank of each round: emulate them all "
                             "(--emulate-rank all) or run the real ranks under torchrun; or pass --split-file")
        rounds = dict(target=args.target_imbalance, max_rounds=args.max_rounds, max_rank_bytes=_max_rank_bytes(args))
        if rank == ALL_RANKS:
            try:
                emulate_measured(args, point, device, run_options, machine, calibration, out, **rounds)
            except NonFiniteResult as err:
                return _nonfinite_failure(err)
            return 0
        status = EXIT_OK
        try:
            measure_measured(args, point, group, device, run_options, machine, calibration, out, **rounds)
        except NonFiniteResult as err:  # raised on every rank at once, so all of them reach the barrier below
            status = _nonfinite_failure(err, printed=rank == 0)
        dist.barrier(group)
        dist.destroy_process_group()
        return status
    if rank == ALL_RANKS or isinstance(rank, tuple):
        try:
            emulate_in_turn(args, point, device, run_options, machine, trace_dir, calibration, out, split=split)
        except NonFiniteResult as err:
            return _nonfinite_failure(err)
        return 0
    if emulated:
        group = init_emulated_group(cp, rank, seed=args.seed)
    status = EXIT_OK
    try:
        _measure_and_report(args, point, group, device, rank, run_options, machine, trace_dir, calibration, out,
                            split)
    except NonFiniteResult as err:  # raised on every rank at once, so all of them reach the barrier below
        status = _nonfinite_failure(err, printed=rank == 0 or emulated)
    finally:  # also on an error: the fake group must not outlive this command in the process
        if emulated:
            destroy_emulated_group(group)
    if not emulated and group is not None:
        dist.barrier(group)
        dist.destroy_process_group()
    return status


def _nonfinite_failure(err: NonFiniteResult, printed: bool = True) -> int:
    """One line naming what is not finite (when ``printed``: once per run, not per rank), and exit 1."""
    if printed:
        print(f"dsv4cp profile: error: {err}: the timed steps computed NaN or infinity, no record written",
              file=sys.stderr)
    return EXIT_FAILED


def _measure_and_report(args, point, group, device, rank, run_options, machine, trace_dir, calibration, out,
                        split) -> None:
    """Measure the point and print / write its record (rank 0, or the emulated rank)."""
    emulated = point.emulated_rank is not None
    processes = 1 if emulated else point.cp  # what the machine label and meta describe
    # a graph point warms up eagerly (at least once) before its capture, then with untimed replays
    warmup = max(args.warmup, 1) + args.warmup if point.cuda_graph else args.warmup
    with step_progress(warmup, args.reps, enabled=progress_enabled(args.progress, rank)) as on_step:
        measurement = measure_point(point, group, device, run_options, machine=machine, trace_dir=trace_dir,
                                    nsys=args.nsys_steps > 0, on_step=on_step,
                                    memory_phases=args.memory_phases, calibration=calibration,
                                    memory_snapshot=args.memory_snapshot, split=split)
    if rank == 0 or emulated:
        record = record_of(point, measurement, processes, device)
        _report(point, record, measurement.overlap)
        print(kernels_line(measurement.backends))
        if measurement.attribution is not None:
            print("\n".join(attribution_lines(measurement.attribution)))
        if record["memory_phases"] is not None:
            _report_memory_phases(record["memory_phases"])
        if args.memory_snapshot:
            ranks = [point.emulated_rank] if emulated else range(point.cp)
            print("memory snapshots (open at pytorch.org/memory_viz): "
                  + ", ".join(str(trace_dir / snapshot_name(r)) for r in ranks))
        append_to_run(args, out, record, processes, device)


def _max_rank_bytes(args: argparse.Namespace) -> int | None:
    return None if args.max_rank_memory is None else int(args.max_rank_memory * 2**30)


def _memory_capped(args: argparse.Namespace, point: Point, machine, calibration):
    """The point's policy split under ``--max-rank-memory``, printed beside equal and balanced."""
    if point.partition == "equal":
        raise ValueError("--max-rank-memory: equal slices are the split of least per-rank memory; use it with "
                         "--partition balanced or measured")
    cfg, lengths = point_inputs(point)
    policy = point_split(point, cfg, lengths, machine, calibration)
    options = KernelOptions.resolve()  # as the point's policy split is priced (measure.point_split)
    capped = memory_capped_split(cfg, point.ratio, lengths, policy, _max_rank_bytes(args), dtype=DTYPES[point.dtype],
                                 direction=point.direction, recompute=point.recompute, machine=machine,
                                 calibration=calibration, kernel_options=options)
    splits = {"equal": RowSplit.equal(point.tokens, point.cp), point.partition: policy,
              f"{point.partition} <= {args.max_rank_memory:g} GiB": capped}
    table = trade_off(cfg, point.ratio, lengths, splits, dtype=DTYPES[point.dtype], direction=point.direction,
                      recompute=point.recompute, machine=machine, calibration=calibration, kernel_options=options)
    print("modelled time / memory of the splits (estimated peak per rank):")
    print(table.drop(columns="split").to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return capped


def _fixed_split(args: argparse.Namespace, point: Point):
    """The split of ``--split-file`` (only with ``--partition measured``), or None."""
    if args.split_file is None:
        for flag in ("save_split", "save_calibration"):
            if getattr(args, flag) is not None and point.partition != MEASURED:
                raise ValueError(f"--{flag.replace('_', '-')}: only with --partition measured")
        return None
    if point.partition != MEASURED:
        raise ValueError(f"--split-file: only with --partition measured, got --partition {point.partition}")
    return load_split(args.split_file, point.cp, point.tokens)




def _fresh_batch_count(text: str) -> int:
    """argparse type of ``--fresh-batches``: 0 (one batch) or an int >= 2 (the batches cycled)."""
    value = non_negative_int(text)
    if value == 1:
        raise argparse.ArgumentTypeError("must be 0 (one batch, its layout built once) or N >= 2 distinct batches "
                                         "(every step building its layout), got '1'")
    return value


def _check_fresh_batch_memory(args: argparse.Namespace, point: Point, step_bytes: int, device: torch.device,
                              split: RowSplit | None, machine: Machine | None,
                              calibration: Calibration | None) -> None:
    """``WouldNotFitError`` naming ``--fresh-batches`` when the step's estimated peak and the N - 1 batches
    more do not fit in the device's free memory (unless ``--force``); the largest rank's rows count."""
    if not point.fresh_batches or args.force:
        return
    free = free_bytes(device)
    if free is None:
        return
    cfg, lengths = point_inputs(point)
    if split is None and (point.partition == "equal" or machine is not None):
        # a measured split is refined from the balanced one: its largest rank is about as large
        policy = point if point.partition != MEASURED else dataclasses.replace(point, partition="balanced")
        split = point_split(policy, cfg, lengths, machine, calibration)
    rows = max(split.rows(r) for r in range(point.cp)) if split is not None else point.tokens
    more = (point.fresh_batches - 1) * batch_bytes(rows, cfg.hidden, DTYPES[point.dtype], point.backward)
    if step_bytes + more > free:
        raise WouldNotFitError(
            f"--fresh-batches: {point.fresh_batches} batches need {more / 2**30:.1f} GiB per rank beside the step's "
            f"estimated peak {step_bytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on {device}; "
            "use fewer batches (or --force to try anyway)")


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
    ranks = (args.emulate_rank,) if isinstance(args.emulate_rank, int) else args.emulate_rank
    if ranks != ALL_RANKS and any(rank >= args.cp for rank in ranks):
        raise ValueError(f"--emulate-rank: must be ranks in [0, {args.cp}) of --cp {args.cp}, got {args.emulate_rank}")
    return True


def _emulated_rank(text: str) -> int | tuple[int, ...] | str:
    """argparse type of ``--emulate-rank``: a rank (an int >= 0), distinct ranks ``R,S,...`` or ``all``."""
    if text.strip().lower() == ALL_RANKS:
        return ALL_RANKS
    if "," not in text:
        return non_negative_int(text)
    ranks = tuple(non_negative_int(part) for part in text.split(","))
    if len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"ranks must be distinct, got {text!r}")
    return ranks


def _bound_text(record: dict, bound: str, ratio: str) -> str:
    """``<bound> ms (measured/bound <ratio>)`` of one of a record's two bounds."""
    over = record[ratio]
    return f"{record[bound]:.3g} ms (measured/bound {over:.2f})" if over is not None else f"{record[bound]:.3g} ms"


def _report(point: Point, record: dict, table) -> None:
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
    if record["fresh_batches"]:
        print(f"fresh batches: every step ran on the next of {record['fresh_batches']} batches and built its "
              "layout (a one-layer model fed a new batch each step); without them the layout is built once")
    if record["compile"] is not None:
        print(f"compile ({record['compile']}): first step {record['compile_s']:.2f} s, not in the timed steps; "
              f"{record['graph_breaks']} graph break(s)")
    bound_text = (f"bound at the physical limits {_bound_text(record, 'bound_ms', 'measured_over_bound')}, at "
                  f"{record['bound_machine']}'s measured ceilings "
                  f"{_bound_text(record, 'bound_measured_ms', 'measured_over_measured_bound')}"
                  if record["bound_ms"] is not None else no_machine_reason())
    print(f"model ({bound_text}); {record['tflops_per_gpu']:.3g} model TFLOP/s per GPU; "
          f"{record['tokens_per_s']:.0f} tokens/s")
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
