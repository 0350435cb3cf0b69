"""The measured split of a Case: start from ``balanced``, measure every rank, refit the cost model on those times,
re-split, and repeat until the ranks are balanced (max/mean <= ``target``) or ``max_rounds`` splits were
measured; the best measured split wins.

Every round measures one split: the real ranks of a CP run (each rank's own median, gathered), or every
rank emulated in turn on one device (:mod:`dsv4cp.harness.emulate`: compute only); the caller says how
(:data:`MeasureRanks`). The refit (:func:`dsv4cp.model.refit.refit`) uses every round so far, per phase
class, so the calibration it ends with transfers to other packings and token counts, plus one factor per
rank for what no class expresses (damped: the geometric mean of every round's estimate); the split is then
the model's balanced split under it (:func:`model_split`: :func:`dsv4cp.model.partition.policy_split`,
refined on the model's per-rank evaluation, where the per-rank factors apply). At another cp the per-rank
factors are ignored. Both are written to files (:func:`dsv4cp.sweeps.measured_split.save_split`,
``Calibration.save``) that ``--split-file`` and ``--calibration`` take, so a layout is tuned once and reused.

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

from collections.abc import Callable
from dataclasses import dataclass

from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.case import Case
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.memory_split import memory_capped_split
from dsv4cp.model.partition import policy_split
from dsv4cp.model.refit import RankTimes, refit

TARGET_IMBALANCE = 1.02
MAX_ROUNDS = 4


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
    case: Case, cp: int, measure_ranks: MeasureRanks, *, label: str, machine: Machine | None = None,
    calibration: Calibration | None = None, target: float = TARGET_IMBALANCE, max_rounds: int = MAX_ROUNDS,
    on_round: Callable[[int, SplitRound], object] | None = None, max_rank_bytes: int | None = None,
    per_rank: bool = True, kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[MeasuredSplit, list]:
    """Run the rounds over ``case``'s layer and batch split over ``cp`` ranks (see the module docstring; the
    Case's own ``split`` is not read: every round measures its own); also returns what ``measure_ranks``
    kept per round. ``label``: what was measured, in the refitted calibration's source.
    ``max_rank_bytes``: every split measured keeps each rank's estimated peak memory at most this
    (:func:`dsv4cp.model.memory_split.memory_capped_split`). ``per_rank=False``: the refit without per-rank
    factors (phase classes only). ``kernel_options``: the options the cost model prices the step under."""
    if cp < 2:
        raise ValueError(f"cp: a measured split needs cp >= 2, got {cp}")
    if not target >= 1.0:
        raise ValueError(f"target: max/mean can only be >= 1, got {target!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds: must be an int >= 1, got {max_rounds!r}")
    machine = machine or Machine()
    lengths = list(case.lengths)

    def balanced(under: Calibration | None) -> RowSplit:
        return model_split(case, cp, under, machine, max_rank_bytes, kernel_options)

    split = balanced(calibration)
    rounds, kept, samples, fitted = [], [], [], calibration
    for index in range(max_rounds):
        rank_ms, measurement = measure_ranks(split)
        est = estimate(case.cfg, case.ratio, lengths, cp, machine, case.total, split=split,
                       kernel_options=kernel_options)
        predicted = None if fitted is None else tuple(map(float, fitted.rank_compute_s(est, case.direction) * 1e3))
        rounds.append(SplitRound(split.bounds, tuple(rank_ms), predicted))
        kept.append(measurement)
        if on_round is not None:
            on_round(index, rounds[-1])
        samples.append(RankTimes(est, tuple(rank_ms)))
        fitted = refit(samples, prior=calibration, direction=case.direction,
                       source=f"measured split of {label} ({len(samples)} rounds)", per_rank=per_rank)
        if rounds[-1].imbalance <= target or index == max_rounds - 1:
            break
        following = balanced(fitted)
        if following.bounds in {r.split for r in rounds}:
            break  # the model returns a split already measured: more rounds would repeat it
        split = following
    best = min(range(len(rounds)), key=lambda i: (max(rounds[i].rank_ms), rounds[i].imbalance))
    return MeasuredSplit(tuple(rounds), best, fitted), kept


def model_split(case: Case, cp: int, calibration: Calibration | None, machine: Machine,
                max_rank_bytes: int | None = None, kernel_options: KernelOptions = DEFAULT_OPTIONS) -> RowSplit:
    """The split a round measures: the model's balanced split of ``case``'s batch over ``cp`` ranks under
    ``calibration`` (its per-rank factors included at their cp), within ``max_rank_bytes`` of estimated peak
    memory per rank, the step priced under ``kernel_options``."""
    lengths = list(case.lengths)
    split = policy_split(case.cfg, case.ratio, lengths, cp, "balanced", machine, total=case.total,
                         direction=case.direction, calibration=calibration, kernel_options=kernel_options)
    if max_rank_bytes is None:
        return split
    return memory_capped_split(case.cfg, case.ratio, lengths, split, max_rank_bytes, dtype=case.torch_dtype,
                               direction=case.direction, recompute=case.recompute, machine=machine,
                               calibration=calibration, kernel_options=kernel_options)
