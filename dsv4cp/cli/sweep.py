"""Run a sweep spec (``sweeps/*.yaml``): every point measured and appended to RUN_DIR/records.jsonl.

On any machine (spawns --nproc gloo ranks, default: the spec's largest cp):

    dsv4cp sweep sweeps/smoke.yaml --out runs/smoke

On GPUs (the launcher's ranks; a point with a smaller cp runs on the first cp ranks):

    torchrun --nproc-per-node 2 -m dsv4cp sweep sweeps/cp_scaling.yaml --out runs/cp_scaling

A killed sweep continues with --resume (with the same spec: another one is refused, naming what
differs); an OOM or error at one point is recorded and the sweep goes on, then exits 1. One sweep at a
time writes a run directory: a second one is refused, naming the first (host, pid, start time). A
spec whose points cannot all run (tokens not divisible by cp, fewer rows per rank than the halo, ...)
is refused before anything starts; --dry-run lists every point and marks those. A spec axis
``cuda_graph: [false, true]`` times each point eagerly and as CUDA-graph replays (CUDA, CP = 1;
elsewhere such a point is recorded as an error).
With --nsys, run under ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dsv4cp.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    PROGRESS_MODES,
    add_dist_backend_option,
    add_kernel_option_argument,
    add_machine_options,
    check_output_dir,
    float_in_range,
    kernel_option_values,
    machine_from_args,
    positive_int,
    progress_enabled,
    resolve_dist_backend,
)
from dsv4cp.cp.torchrun import under_torchrun
from dsv4cp.sweeps.listing import iter_listing
from dsv4cp.sweeps.spec import (
    SweepSpec,
    cannot_run_message,
    check_points_can_run,
    expand,
    load_spec,
    with_kernel_options,
)

POINT_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)
"""``--point-timeout``'s allowed seconds: below one, a rank's ordinary start-up would time out; a week is past
any point (and a timeout beyond what ``datetime.timedelta`` holds would fail in every rank)."""

HELP = "run a sweep spec (YAML) and record every point (RUN_DIR/records.jsonl + meta.json)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec, e.g. sweeps/smoke.yaml")
    parser.add_argument("--out", default=None, help="run directory (default: runs/<spec name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue RUN_DIR with the spec it was started with: skip the points it already holds")
    parser.add_argument("--retry-errors", action="store_true",
                        help="with --resume, run points recorded as errors again")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="ranks to spawn without torchrun (default: the spec's largest cp)")
    parser.add_argument("--profile", action="store_true",
                        help="also capture a Kineto trace per point (RUN_DIR/traces/<point_id>/) and its overlap table")
    parser.add_argument("--memory-snapshot", action="store_true",
                        help="with --profile: also write each point's CUDA allocator history per rank "
                             "(RUN_DIR/traces/<point_id>/memory_snapshot_rank<r>.pickle); CUDA only")
    parser.add_argument("--nsys", action="store_true", help="also run steps inside an nsys capture range per point")
    parser.add_argument("--check", action="store_true",
                        help="also check every point's timed layer and inputs against the fp64 reference layer")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the expanded points (marking those that cannot run: exit 2 then) and exit")
    parser.add_argument("--point-timeout", type=float_in_range(*POINT_TIMEOUT_RANGE_S, " s"), default=600.0,
                        help="seconds a collective of one point may wait before the point is recorded as an error "
                             f"(from {POINT_TIMEOUT_RANGE_S[0]:g} to {POINT_TIMEOUT_RANGE_S[1]:g})")
    parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="progress bar with ETA on stderr, rank 0 only; auto: only when stderr is a terminal")
    add_kernel_option_argument(parser)
    add_dist_backend_option(parser)
    add_machine_options(parser)
    parser.add_argument("--calibration", default=None,
                        help="JSON of measured/bound phase factors (dsv4cp model --calibrate): the balanced "
                             "points' split equalises calibrated times; recorded in each record")


def run(args: argparse.Namespace) -> int:
    spec = with_kernel_options(load_spec(args.spec), kernel_option_values(args))  # each point's id says them
    rank = int(os.environ.get("RANK", "0")) if under_torchrun() else 0
    if args.dry_run:
        return _dry_run(spec, args.nproc) if rank == 0 else EXIT_OK
    # Imported here, where points are measured: the dry run above imports no torch.
    from dsv4cp.model.calibration import Calibration
    from dsv4cp.profiling.memory_snapshot import check_snapshot_request
    from dsv4cp.sweeps.runner import SweepOptions, default_nproc, run_sweep

    check_snapshot_request(args.memory_snapshot, args.profile, "--profile")
    out = Path(args.out) if args.out else Path("runs") / spec.name
    points = expand(spec)  # the one expansion: checked, then measured
    check_points_can_run(points)
    if rank == 0:
        check_output_dir(out, "--out")
    distributed = under_torchrun() or (args.nproc or default_nproc(points)) > 1
    calibration = None if args.calibration is None else Calibration.load(args.calibration)
    if rank == 0 and calibration is not None:  # per-rank factors apply at the cp they were fitted at only
        for note in sorted({calibration.rank_factors_note(point.cp) for point in points} - {None}):
            print(note)
    options = SweepOptions(
        out=out, resume=args.resume, retry_errors=args.retry_errors, profile=args.profile, nsys=args.nsys,
        memory_snapshot=args.memory_snapshot,
        check=args.check, point_timeout_s=args.point_timeout,
        dist_backend=resolve_dist_backend(args, distributed=distributed),  # refuses a flag a 1-rank run ignores
        progress=progress_enabled(args.progress, rank), machine=machine_from_args(args, calibration),
        calibration=calibration,
    )
    summary = run_sweep(spec, points, options, nproc=args.nproc)
    if rank == 0:
        print(f"sweep {spec.name}: {summary.recorded} points recorded in {out} ({summary.ok} ok, {summary.failed} "
              f"failed, {summary.skipped} skipped), {summary.resumed} already there")
        if summary.resumed_failed:
            print(f"sweep {spec.name}: {summary.resumed_failed} of the points already there had failed "
                  "(--retry-errors runs the errors again)")
        if summary.parity_failed:
            print(f"sweep {spec.name}: parity with the fp64 reference FAILED at {summary.parity_failed} points")
    return EXIT_FAILED if summary.parity_failed or summary.any_failed else EXIT_OK


def _dry_run(spec: SweepSpec, nproc: int | None) -> int:
    """List the points one at a time (a spec of any size), marking those that cannot run; ``ValueError``
    (exit 2) naming the first of them after the list."""
    total = widest = cannot = 0
    first: tuple | None = None  # the first point that cannot run: its id, label and why
    write = sys.stdout.write
    for point_id, label, problem, cp in iter_listing(spec):
        total += 1
        if cp > widest:
            widest = cp
        if problem is None:
            write(f"{point_id}  {label}\n")
            continue
        write(f"{point_id}  {label}  CANNOT RUN: {problem}\n")
        cannot += 1
        first = first or (point_id, label, problem)
    print(f"{total} points{f' ({cannot} cannot run)' if cannot else ''}, spawning {nproc or widest} ranks "
          "without torchrun")
    if first is not None:
        raise ValueError(cannot_run_message(*first, cannot, total))
    return EXIT_OK
