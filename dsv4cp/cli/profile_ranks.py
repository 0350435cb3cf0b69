"""``dsv4cp profile``'s flows over several ranks of one point: emulated ranks in turn on one device
(``--emulate-rank all`` or ``R,S,...``) and the measured split's rounds (``--partition measured``), with the
records they append to ``--out``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from dsv4cp.cp.partition import RowSplit
from dsv4cp.environment import git_sha, machine_label
from dsv4cp.harness.emulate import summary_metrics
from dsv4cp.harness.time import Measurement
from dsv4cp.records import RECORDS_FILE, append_record, make_record, write_meta
from dsv4cp.sweeps.emulation import measure_every_rank, rank_table_lines, summary_point
from dsv4cp.sweeps.measured_split import (
    MeasuredSplit,
    SplitRound,
    emulate_measured_split,
    measure_measured_point,
    save_split,
)
from dsv4cp.sweeps.meta import run_meta
from dsv4cp.sweeps.spec import ALL_RANKS, Point


def record_of(point: Point, measurement: Measurement, processes: int, device: torch.device,
              metrics: dict | None = None) -> dict:
    """The profile record of one measured point: ``measurement``'s metrics (or ``metrics``) and the identity of
    what ran (the kernel options in force, the backends that ran)."""
    return make_record(point.axes(), measurement.metrics if metrics is None else metrics, sweep="profile",
                       status="ok", machine=machine_label(device, processes), git_sha=git_sha(),
                       resolved_backends=measurement.resolved_backends, kernel_options=measurement.kernel_options,
                       backends=measurement.backends)


def append_to_run(args: argparse.Namespace, out: Path | None, record: dict, processes: int,
                  device: torch.device) -> None:
    """Append ``record`` to ``out`` (None: no run directory), writing its meta.json first when new."""
    if out is None:
        return
    if not (out / "meta.json").exists():
        options = {name: value for name, value in vars(args).items() if not name.startswith("_")}
        write_meta(out, run_meta(processes, device, {"command": "profile", **options}))
    append_record(out / RECORDS_FILE, record)


def emulate_in_turn(args, point: Point, device, run_options, machine, trace_dir, calibration, out, *,
                    split: RowSplit | None = None) -> None:
    """``--emulate-rank all`` or a list of ranks: those ranks measured in turn (each recorded as soon as it
    is measured); for ``all``, then the per-rank table and the summary record."""
    every = args.emulate_rank == ALL_RANKS
    measured = measure_every_rank(point, device, run_options, ranks=None if every else args.emulate_rank,
                                  machine=machine, calibration=calibration, trace_dir=trace_dir,
                                  memory_phases=args.memory_phases, split=split)
    record_ranks(args, point, measured, device, out, summary=every)


def record_ranks(args, point: Point, measured, device, out, *, summary: bool) -> None:
    """Print and append each ``(rank point, measurement)`` as it comes; with ``summary`` (every rank), then
    the per-rank table and the all-ranks summary record."""
    per_rank, last = [], None
    for rank_point, measurement in measured:
        record = record_of(rank_point, measurement, 1, device)
        print(f"rank {rank_point.emulated_rank} of cp {point.cp}: median {record['time_ms_median']:.3f} ms "
              f"(p20 {record['time_ms_p20']:.3f}, p80 {record['time_ms_p80']:.3f}), compute only")
        append_to_run(args, out, record, 1, device)
        per_rank.append(measurement.metrics)
        last = measurement
    if not summary:
        return
    whole = summary_point(point)
    record = record_of(whole, last, 1, device, metrics=summary_metrics(per_rank, point.tokens))
    print(f"profile {whole.label()} (point {record['point_id']}, {record['machine']}): EVERY rank emulated in "
          "turn on one device")
    print("\n".join(rank_table_lines(record)))
    append_to_run(args, out, record, 1, device)


def _show_round(index: int, measured: SplitRound) -> None:
    print(measured.line(index), flush=True)


def _save(args, point: Point, result: MeasuredSplit) -> None:
    """The rounds' outcome, and the split and calibration files asked for."""
    best = result.rounds[result.best]
    print(f"measured split: round {result.best} is the best (slowest rank {max(best.rank_ms):.2f} ms, max/mean "
          f"{best.imbalance:.3f}; round 0, the balanced split, {max(result.rounds[0].rank_ms):.2f} ms)")
    if result.calibration.rank_factors:
        factors = ", ".join(f"{f:.3f}" for f in result.calibration.rank_factors)
        print(f"per-rank factors of the refit (measured over class-calibrated time): [{factors}]")
    if args.save_split is not None:
        save_split(args.save_split, point, result)
        print(f"split written to {args.save_split} (--split-file)")
    if args.save_calibration is not None:
        result.calibration.save(args.save_calibration)
        print(f"refitted calibration written to {args.save_calibration} (--calibration)")


def emulate_measured(args, point: Point, device, run_options, machine, calibration, out, *, target: float,
                     max_rounds: int, max_rank_bytes: int | None) -> None:
    """``--partition measured --emulate-rank all``: the rounds with every rank emulated; the best round's
    ranks and summary are recorded (one record per point id)."""
    print(f"measured split of {point.label()}: every rank emulated in turn per round (compute only)")
    result, kept = emulate_measured_split(point, device, run_options, machine=machine, calibration=calibration,
                                          on_round=_show_round, target=target, max_rounds=max_rounds,
                                          max_rank_bytes=max_rank_bytes)
    _save(args, point, result)
    label = result.calibration.label
    best = [(rank_point, _labelled(measurement, label)) for rank_point, measurement in kept[result.best]]
    record_ranks(args, point, best, device, out, summary=True)


def measure_measured(args, point: Point, group, device, run_options, machine, calibration, out, *, target: float,
                     max_rounds: int, max_rank_bytes: int | None) -> None:
    """``--partition measured`` on the real ranks (torchrun): the rounds, then the best round's record."""
    rank = group.rank()
    measurement, result = measure_measured_point(
        point, group, device, run_options, machine=machine, calibration=calibration,
        on_round=_show_round if rank == 0 else None, target=target, max_rounds=max_rounds,
        max_rank_bytes=max_rank_bytes)
    if rank == 0:
        _save(args, point, result)
        record = record_of(point, measurement, point.cp, device)
        append_to_run(args, out, record, point.cp, device)


def _labelled(measurement: Measurement, calibration_label: str) -> Measurement:
    return dataclasses.replace(measurement, metrics={**measurement.metrics, "calibration": calibration_label})
