"""Every rank of a CP run measured in turn on one device (:mod:`dsv4cp.cp.emulate`): each rank's compute
time and peak memory, and one summary of them all (imbalance, the slowest rank).

An emulated rank's collectives are no-ops, so nothing here measures communication: the summary is the
compute-only view of the step, a lower bound of the real one. Ranks run one after the other in this
process, each with a fake process group of its own (created and destroyed around its measurement), so
the same weights, inputs and split are built for every rank exactly as a real run builds them.

The summary record marks ``emulated_rank`` with :data:`ALL_RANKS`: its point id differs from both the
real run's and every single emulated rank's, so ``compare`` and the report never mix them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from dsv4cp.cp.emulate import destroy_emulated_group, init_emulated_group
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.time import Measurement
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import Machine
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import ALL_RANKS, Point, RunOptions

_SHARED_METRICS = ("split", "calibration", "model_flops", "bound_ms", "bound_measured_ms", "bound_machine")
"""Metrics every emulated rank computes identically (the whole CP step's model and split)."""


def measure_every_rank(
    point: Point, device: torch.device, run: RunOptions, *, ranks: Sequence[int] | None = None,
    machine: Machine | None = None, calibration: Calibration | None = None, trace_dir: str | Path | None = None,
    memory_phases: bool = False, on_step: Callable[[str], object] | None = None, split: RowSplit | None = None,
) -> Iterator[tuple[Point, Measurement]]:
    """Measure ``ranks`` (default: 0, 1, ..., ``point.cp - 1``) of ``point`` one after the other in this
    process; yield each rank's point (``emulated_rank`` set) and measurement as soon as it is taken, so a
    caller can record it before the next rank starts. ``trace_dir``: rank R's trace goes to
    ``trace_dir/rankR/`` (each rank's overlap table reads only its own directory). ``split``: the row split
    to measure instead of the point's policy's."""
    if point.cp < 2:
        raise ValueError(f"cp: emulating every rank needs cp >= 2, got {point.cp}")
    ranks = list(range(point.cp)) if ranks is None else list(ranks)
    bad = [rank for rank in ranks if not 0 <= rank < point.cp]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"ranks: must be distinct ranks in [0, {point.cp}), got {ranks}")
    for rank in ranks:
        rank_point = dataclasses.replace(point, emulated_rank=rank)
        group = init_emulated_group(point.cp, rank, seed=point.seed)
        try:
            rank_trace = None if trace_dir is None else Path(trace_dir) / f"rank{rank}"
            measurement = measure_point(rank_point, group, device, run, machine=machine, trace_dir=rank_trace,
                                        memory_phases=memory_phases, calibration=calibration, on_step=on_step,
                                        split=split)
        finally:  # also on an error: the next rank (or the caller) creates its own group
            destroy_emulated_group(group)
        yield rank_point, measurement


def summary_metrics(per_rank: list[dict], tokens: int) -> dict:
    """The all-ranks summary of every rank's own metrics (``per_rank[r]``: rank r's record metrics, as
    :func:`measure_point` gives them for an emulated rank: its lists hold None at the other ranks).

    ``rank_time_ms_median`` and the memory lists take each rank's own entry; the time statistics,
    throughput and measured/bound are the slowest rank's (the step cannot end before it);
    ``imbalance_max_over_mean`` is max/mean of the per-rank medians; ``slowest_rank`` and
    ``slowest_rank_ms`` name it. Raises ``ValueError`` when a rank's own entries are missing."""
    if not per_rank:
        raise ValueError("per_rank: no rank was measured")
    medians = []
    for rank, metrics in enumerate(per_rank):
        own = metrics["rank_time_ms_median"][rank]
        if own is None:
            raise ValueError(f"per_rank[{rank}]: rank_time_ms_median holds no time for rank {rank}")
        medians.append(own)
    slowest = max(range(len(medians)), key=medians.__getitem__)
    worst = per_rank[slowest]
    mean = sum(medians) / len(medians)
    summary = {name: worst[name] for name in _SHARED_METRICS}
    summary.update({
        "time_ms_median": worst["time_ms_median"], "time_ms_p20": worst["time_ms_p20"],
        "time_ms_p80": worst["time_ms_p80"], "rank_time_ms_median": medians,
        "imbalance_max_over_mean": max(medians) / mean, "slowest_rank": slowest, "slowest_rank_ms": medians[slowest],
        "tokens_per_s": tokens / (worst["time_ms_median"] / 1e3), "tflops_per_gpu": worst["tflops_per_gpu"],
        "mfu": worst["mfu"], "measured_over_bound": worst["measured_over_bound"],
        "measured_over_measured_bound": worst["measured_over_measured_bound"],
        "peak_allocated_bytes": [m["peak_allocated_bytes"][r] for r, m in enumerate(per_rank)],
        "device_used_bytes": [m["device_used_bytes"][r] for r, m in enumerate(per_rank)],
    })
    return summary


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
