"""The ``measured`` partition of a sweep point: the harness's rounds (:mod:`dsv4cp.harness.measured_split`)
over the point's Case, measured on the real ranks of a CP run or with every rank emulated in turn on one
device (:mod:`dsv4cp.sweeps.emulation`); the split files ``--split-file`` takes; and the measurement of a
point under any partition (:func:`measure_under_partition`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.case import Case
from dsv4cp.harness.measured_split import (
    MAX_ROUNDS,
    TARGET_IMBALANCE,
    MeasuredSplit,
    MeasureRanks,
    SplitRound,
)
from dsv4cp.harness.measured_split import model_split as model_case_split
from dsv4cp.harness.measured_split import refine_by_measurement as refine_case
from dsv4cp.harness.time import Measurement
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.model import Machine
from dsv4cp.model.calibration import Calibration
from dsv4cp.sweeps.emulation import measure_every_rank
from dsv4cp.sweeps.measure import measure_point, point_case
from dsv4cp.sweeps.spec import MEASURED, Point, RunOptions

SPLIT_FILE_SCHEMA = 1


def measured_case(point: Point, device: torch.device | str = "cpu") -> Case:
    """The Case whose split the rounds of ``point`` replace (:func:`~dsv4cp.sweeps.measure.point_case`
    under equal slices, which no round reads)."""
    return point_case(point, split=RowSplit.equal(point.tokens, point.cp, field="tokens"), device=device)


def refine_by_measurement(point: Point, measure_ranks: MeasureRanks, *, device: torch.device | str = "cpu",
                          **rounds) -> tuple[MeasuredSplit, list]:
    """The rounds of :func:`dsv4cp.harness.measured_split.refine_by_measurement` over ``point``'s Case on
    ``device`` (``rounds``: its keywords, the point's label given, the model priced under the kernel options
    in force: the point's own are in force only while it is measured)."""
    if point.cp < 2:
        raise ValueError(f"cp: a measured split needs cp >= 2, got {point.cp}")
    return refine_case(measured_case(point, device), point.cp, measure_ranks, label=point.label(),
                       kernel_options=KernelOptions.resolve(), **rounds)


def model_split(point: Point, calibration: Calibration | None, machine: Machine,
                max_rank_bytes: int | None = None) -> RowSplit:
    """The split a round of ``point`` measures (:func:`dsv4cp.harness.measured_split.model_split`, under the
    kernel options in force)."""
    return model_case_split(measured_case(point), point.cp, calibration, machine, max_rank_bytes,
                            KernelOptions.resolve())


def measure_measured_point(
    point: Point, group: dist.ProcessGroup | None, device: torch.device, run: RunOptions, *,
    machine: Machine | None = None, calibration: Calibration | None = None,
    on_round: Callable[[int, SplitRound], object] | None = None, target: float = TARGET_IMBALANCE,
    max_rounds: int = MAX_ROUNDS, max_rank_bytes: int | None = None,
) -> tuple[Measurement, MeasuredSplit]:
    """A ``measured`` point on the real ranks of ``group``: the rounds, then the best round's measurement."""
    if point.partition != MEASURED:
        raise ValueError(f"partition: expected {MEASURED!r}, got {point.partition!r}")

    def measure_ranks(split: RowSplit):
        measurement = measure_point(point, group, device, run, machine=machine, calibration=calibration,
                                    split=split)
        return tuple(measurement.metrics["rank_time_ms_median"]), measurement

    result, kept = refine_by_measurement(point, measure_ranks, machine=machine, calibration=calibration,
                                         on_round=on_round, target=target, max_rounds=max_rounds,
                                         max_rank_bytes=max_rank_bytes, device=device)
    measurement = kept[result.best]
    labelled = {**measurement.metrics, "calibration": result.calibration.label}
    return dataclasses.replace(measurement, metrics=labelled), result


def emulate_measured_split(
    point: Point, device: torch.device, run: RunOptions, *, machine: Machine | None = None,
    calibration: Calibration | None = None, on_round: Callable[[int, SplitRound], object] | None = None,
    target: float = TARGET_IMBALANCE, max_rounds: int = MAX_ROUNDS, max_rank_bytes: int | None = None,
) -> tuple[MeasuredSplit, list]:
    """The rounds with every rank emulated in turn on ``device`` (compute only); per round, the list of
    ``(rank point, measurement)`` of its ranks."""

    def measure_ranks(split: RowSplit):
        ranks = list(measure_every_rank(point, device, run, machine=machine, calibration=calibration, split=split))
        return tuple(m.metrics["rank_time_ms_median"][r] for r, (_, m) in enumerate(ranks)), ranks

    return refine_by_measurement(point, measure_ranks, machine=machine, calibration=calibration, on_round=on_round,
                                 target=target, max_rounds=max_rounds, max_rank_bytes=max_rank_bytes, device=device)


# ------------------------------------------------------------------------------------------ files
def save_split(path: str | Path, point: Point, result: MeasuredSplit) -> None:
    """Write the best split with the point it was measured for and every round (JSON)."""
    Path(path).write_text(json.dumps({
        "schema": SPLIT_FILE_SCHEMA, "point": point.label(), "cp": point.cp, "tokens": point.tokens,
        "split": list(result.split.bounds),
        "rounds": [{"split": list(r.split), "rank_ms": list(r.rank_ms), "max_over_mean": r.imbalance,
                    **({} if r.predicted_ms is None else {"predicted_ms": list(r.predicted_ms)})}
                   for r in result.rounds],
    }, indent=2) + "\n")


def load_split(path: str | Path, cp: int, tokens: int) -> RowSplit:
    """The split of a file :func:`save_split` wrote; ``ValueError`` naming the file when it is unreadable or
    was made for another cp or token count."""
    where = f"--split-file {path}"
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: cannot read it: {err}") from None
    if not isinstance(values, dict) or values.get("schema") != SPLIT_FILE_SCHEMA or "split" not in values:
        raise ValueError(f"{where}: not a split file (a JSON object with schema {SPLIT_FILE_SCHEMA} and 'split')")
    bounds = values["split"]
    if not isinstance(bounds, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise ValueError(f"{where}: split must be a list of ints, got {bounds!r}")
    if values.get("cp") != cp or values.get("tokens") != tokens:
        raise ValueError(f"{where}: made for cp {values.get('cp')} and {values.get('tokens')} tokens, not cp {cp} "
                         f"and {tokens} tokens")
    return RowSplit(tuple(bounds))


def load_rounds(path: str | Path, cp: int, tokens: int) -> tuple[SplitRound, ...]:
    """Every round of a file :func:`save_split` wrote (checked as :func:`load_split` checks its split)."""
    load_split(path, cp, tokens)
    rounds = json.loads(Path(path).read_text()).get("rounds")
    where = f"--split-file {path}"
    if not isinstance(rounds, list) or not rounds:
        raise ValueError(f"{where}: 'rounds' must be a non-empty list, got {rounds!r}")
    out = []
    for index, item in enumerate(rounds):
        split, times = (item.get("split"), item.get("rank_ms")) if isinstance(item, dict) else (None, None)
        if not isinstance(split, list) or not isinstance(times, list) or len(times) != cp:
            raise ValueError(f"{where}: rounds[{index}] needs a 'split' and {cp} 'rank_ms', got {item!r}")
        predicted = item.get("predicted_ms")  # absent in files written before it was recorded
        if predicted is not None and (not isinstance(predicted, list) or len(predicted) != cp):
            raise ValueError(f"{where}: rounds[{index}].predicted_ms needs {cp} times, got {predicted!r}")
        out.append(SplitRound(tuple(split), tuple(float(t) for t in times),
                              None if predicted is None else tuple(float(t) for t in predicted)))
    return tuple(out)


def measure_under_partition(point: Point, group: dist.ProcessGroup | None, device: torch.device, run: RunOptions,
                            **measure_kwargs) -> Measurement:
    """:func:`measure_point` for every partition: a ``measured`` point first runs its rounds on the real ranks
    (no traces, checks or nsys: those belong to the measurement of the split chosen), then measures the best
    split with ``measure_kwargs`` (a sweep's trace directory, parity check, ...)."""
    if point.partition != MEASURED:
        return measure_point(point, group, device, run, **measure_kwargs)
    _, result = measure_measured_point(point, group, device, run, machine=measure_kwargs.get("machine"),
                                       calibration=measure_kwargs.get("calibration"))
    kwargs = {**measure_kwargs, "calibration": result.calibration, "split": result.split}
    return measure_point(point, group, device, run, **kwargs)
