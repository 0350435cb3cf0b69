"""The ``measured`` split: start from ``balanced``, measure every rank, refit the cost model on those times,
re-split, and repeat until the ranks are balanced (max/mean <= ``target``) or ``max_rounds`` splits were
measured; the best measured split wins.

Every round measures one split: the real ranks of a CP run (each rank's own median, gathered), or every
rank emulated in turn on one device (:mod:`dsv4cp.sweeps.emulation`: compute only). The refit
(:func:`dsv4cp.model.refit.refit`) uses every round so far, per phase class, so the calibration it ends
with transfers to other packings and token counts, plus one factor per rank for what no class expresses
(damped: the geometric mean of every round's estimate); the split is then the model's balanced split under
it (:func:`model_split`: :func:`dsv4cp.model.partition.policy_split`, refined on the model's per-rank
evaluation, where the per-rank factors apply). At another cp the per-rank factors are ignored. Both are
written to files (:func:`save_split`, ``Calibration.save``) that ``--split-file`` and ``--calibration``
take, so a layout is tuned once and reused.

Every rank runs the same rounds on the same gathered times, so all derive the same splits.

Why the first rank of one long document stays lighter than the rest (on an H200 at 256K, cp 8: ~125 ms
against ~146 ms in every round): by the model's own choice, not a residual it misses. The first two ranks hold
the most rows, and the largest slice sets the capacity every rank's gathered compressed buffers are padded to;
under the ``prefix`` scan rank ``rho``'s queries scan ``rho x capacity`` earlier slots. Rank 0 scans none
(its indexer share is 10 ms against 30-82 ms on ranks 1-7), so to be as slow as the others it would need
more rows than rank 1, and each row it takes raises the capacity for all: moving 1024 rows from rank 1 to
rank 0 of the 2026-12-02 H200 split lifts the capacity from 10653 to 10909 slots, rank 0 by 3.3 ms and ranks
2-7 by 0.9-1.9 ms each, so the slowest rank gets slower (146.1 -> 147.5 ms, refitted model). The split that
minimises the slowest rank therefore leaves max/mean at ~1.018 in the model; the measured max/mean adds the
ranks' noise (~1%) on top. The rounds minimise the slowest rank (what the step waits for), not max/mean.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4cp.config import DTYPES
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.time import Measurement
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.memory_split import memory_capped_split
from dsv4cp.model.partition import policy_split
from dsv4cp.model.refit import RankTimes, refit
from dsv4cp.sweeps.emulation import measure_every_rank
from dsv4cp.sweeps.measure import measure_point, point_inputs
from dsv4cp.sweeps.spec import MEASURED, Point, RunOptions

TARGET_IMBALANCE = 1.02
MAX_ROUNDS = 4
SPLIT_FILE_SCHEMA = 1


@dataclass(frozen=True)
class SplitRound:
    """One measured split: its points, each rank's measured median (ms) and their max/mean."""

    split: tuple[int, ...]
    rank_ms: tuple[float, ...]
    predicted_ms: tuple[float, ...] | None = None
    """The model's rank times for the split under the calibration that chose it (None without one)."""

    @property
    def imbalance(self) -> float:
        return max(self.rank_ms) * len(self.rank_ms) / sum(self.rank_ms)

    def line(self, index: int) -> str:
        times = ", ".join(f"{t:.2f}" for t in self.rank_ms)
        text = (f"round {index}: split {list(self.split)}; rank ms [{times}]; max/mean {self.imbalance:.3f}; "
                f"slowest {max(self.rank_ms):.2f} ms")
        if self.predicted_ms is None:
            return text
        predicted = max(self.predicted_ms) * len(self.predicted_ms) / sum(self.predicted_ms)
        return f"{text} (model predicted max/mean {predicted:.3f}, slowest {max(self.predicted_ms):.2f} ms)"


@dataclass(frozen=True)
class MeasuredSplit:
    """The rounds, the best measured split and the calibration refitted on every round."""

    rounds: tuple[SplitRound, ...]
    best: int
    """Index of the round with the smallest slowest-rank time (the step waits for it), ties to the smaller
    max/mean."""
    calibration: Calibration

    @property
    def split(self) -> RowSplit:
        return RowSplit(self.rounds[self.best].split)


MeasureRanks = Callable[[RowSplit], tuple[tuple[float, ...], object]]
"""Measures one split: each rank's median ms and whatever the caller keeps of the measurement."""


def refine_by_measurement(
    point: Point, measure_ranks: MeasureRanks, *, machine: Machine | None = None,
    calibration: Calibration | None = None, target: float = TARGET_IMBALANCE, max_rounds: int = MAX_ROUNDS,
    on_round: Callable[[int, SplitRound], object] | None = None, max_rank_bytes: int | None = None,
    per_rank: bool = True,
) -> tuple[MeasuredSplit, list]:
    """Run the rounds (see the module docstring); also returns what ``measure_ranks`` kept per round.
    ``max_rank_bytes``: every split measured keeps each rank's estimated peak memory at most this
    (:func:`dsv4cp.model.memory_split.memory_capped_split`). ``per_rank=False``: the refit without per-rank
    factors (phase classes only)."""
    if point.cp < 2:
        raise ValueError(f"cp: a measured split needs cp >= 2, got {point.cp}")
    if not target >= 1.0:
        raise ValueError(f"target: max/mean can only be >= 1, got {target!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds: must be an int >= 1, got {max_rounds!r}")
    machine = machine or Machine()
    cfg, lengths = point_inputs(point)

    def balanced(under: Calibration | None) -> RowSplit:
        return model_split(point, under, machine, max_rank_bytes)

    split = balanced(calibration)
    rounds, kept, samples, fitted = [], [], [], calibration
    for index in range(max_rounds):
        rank_ms, measurement = measure_ranks(split)
        est = estimate(cfg, point.ratio, lengths, point.cp, machine, point.tokens, split=split)
        predicted = None if fitted is None else tuple(map(float, fitted.rank_compute_s(est, point.direction) * 1e3))
        rounds.append(SplitRound(split.bounds, tuple(rank_ms), predicted))
        kept.append(measurement)
        if on_round is not None:
            on_round(index, rounds[-1])
        samples.append(RankTimes(est, tuple(rank_ms)))
        fitted = refit(samples, prior=calibration, direction=point.direction,
                       source=f"measured split of {point.label()} ({len(samples)} rounds)", per_rank=per_rank)
        if rounds[-1].imbalance <= target or index == max_rounds - 1:
            break
        following = balanced(fitted)
        if following.bounds in {r.split for r in rounds}:
            break  # the model returns a split already measured: more rounds would repeat it
        split = following
    best = min(range(len(rounds)), key=lambda i: (max(rounds[i].rank_ms), rounds[i].imbalance))
    return MeasuredSplit(tuple(rounds), best, fitted), kept


def model_split(point: Point, calibration: Calibration | None, machine: Machine,
                max_rank_bytes: int | None = None) -> RowSplit:
    """The split a round measures: the model's balanced split of ``point`` under ``calibration`` (its
    per-rank factors included at their cp), within ``max_rank_bytes`` of estimated peak memory per rank."""
    cfg, lengths = point_inputs(point)
    split = policy_split(cfg, point.ratio, lengths, point.cp, "balanced", machine, total=point.tokens,
                         direction=point.direction, calibration=calibration)
    if max_rank_bytes is None:
        return split
    return memory_capped_split(cfg, point.ratio, lengths, split, max_rank_bytes, dtype=DTYPES[point.dtype],
                               direction=point.direction, recompute=point.recompute, machine=machine,
                               calibration=calibration)


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
                                         max_rank_bytes=max_rank_bytes)
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
                                 target=target, max_rounds=max_rounds, max_rank_bytes=max_rank_bytes)


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
