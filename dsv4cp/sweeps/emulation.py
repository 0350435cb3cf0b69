"""Every rank of a sweep point's CP run measured in turn on one device: the point's Case through the
harness's emulation pass (:mod:`dsv4cp.harness.emulate`: each rank's compute time and peak memory, and
one summary of them all, compute only), with the point of each rank's record.

The summary record marks ``emulated_rank`` with :data:`ALL_RANKS`: its point id differs from both the
real run's and every single emulated rank's, so ``compare`` and the report never mix them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.emulate import emulate_each_rank, emulated_ranks
from dsv4cp.harness.time import Measurement, time_case
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import Machine
from dsv4cp.sweeps.measure import checked_case
from dsv4cp.sweeps.spec import ALL_RANKS, Point, RunOptions


def measure_every_rank(
    point: Point, device: torch.device, run: RunOptions, *, ranks: Sequence[int] | None = None,
    machine: Machine | None = None, calibration: Calibration | None = None, trace_dir: str | Path | None = None,
    memory_phases: bool = False, on_step: Callable[[str], object] | None = None, split: RowSplit | None = None,
) -> Iterator[tuple[Point, Measurement]]:
    """Measure ``ranks`` (default: 0, 1, ..., ``point.cp - 1``) of ``point`` one after the other in this
    process: its one Case (:func:`~dsv4cp.sweeps.measure.checked_case`) timed on each rank
    (:func:`dsv4cp.harness.emulate.emulate_each_rank`); yield each rank's point (``emulated_rank`` set) and
    measurement as soon as it is taken, so a caller can record it before the next rank starts. ``trace_dir``:
    rank R's trace goes to ``trace_dir/rankR/`` (each rank's overlap table reads only its own directory).
    ``split``: the row split to measure instead of the point's policy's."""
    ranks = emulated_ranks(point.cp, ranks)
    case, machine, label = checked_case(dataclasses.replace(point, emulated_rank=ranks[0]), device,
                                        machine=machine, calibration=calibration, split=split)

    def measure(rank: int, group) -> tuple[Point, Measurement]:
        rank_point = dataclasses.replace(point, emulated_rank=rank)
        rank_trace = None if trace_dir is None else Path(trace_dir) / f"rank{rank}"
        return rank_point, time_case(case, group, device, run, machine=machine, calibration_label=label,
                                     trace_dir=rank_trace, on_step=on_step, memory_phases=memory_phases,
                                     trace_point=rank_point.axes())

    for _, measured in emulate_each_rank(case, point.cp, measure, ranks=ranks):
        yield measured


def summary_point(point: Point) -> Point:
    """The point of the all-ranks summary record."""
    return dataclasses.replace(point, emulated_rank=ALL_RANKS)


def rank_table_lines(summary: dict) -> list[str]:
    """The per-rank table printed after an all-ranks emulation: each rank's compute median and peak
    memory, then max/mean and the slowest rank."""
    lines = ["rank  compute ms  peak GiB"]
    for rank, (ms, peak) in enumerate(zip(summary["rank_time_ms_median"], summary["peak_allocated_bytes"])):
        lines.append(f"{rank:>4}  {ms:10.3f}  {(peak or 0) / 2**30:8.2f}")
    lines.append(f"max/mean {summary['imbalance_max_over_mean']:.3f}; slowest rank {summary['slowest_rank']} "
                 f"({summary['slowest_rank_ms']:.3f} ms); compute only, communication NOT measured")
    return lines
