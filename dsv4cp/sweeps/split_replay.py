"""Replay a ``measured`` split's rounds offline: refit the model on rounds already measured and say which split
the next round would measure and what the model predicts for it (a prediction, not a measurement).

Two uses: the split to measure next from a split file of an earlier run (``save_split``), without a device;
and a check of the refit itself, :func:`hindcast`: fit on the rounds before ``k``, predict round ``k``'s
measured rank times (its split is known), so a refit that carries more (per-rank factors) can be judged on
rounds it did not see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.refit import RankTimes, refit
from dsv4cp.sweeps.measured_split import SplitRound, model_split
from dsv4cp.sweeps.spec import Point, point_inputs


@dataclass(frozen=True)
class NextRound:
    """The split the rounds would measure next and the model's per-rank times for it (ms)."""

    calibration: Calibration
    split: RowSplit
    predicted_ms: tuple[float, ...]
    measured_before: bool
    """The split is one of the rounds': the rounds would stop (it would repeat a measurement)."""

    @property
    def predicted_imbalance(self) -> float:
        return max(self.predicted_ms) * len(self.predicted_ms) / sum(self.predicted_ms)


def _samples(point: Point, rounds: Sequence[SplitRound], machine: Machine) -> list[RankTimes]:
    cfg, lengths = point_inputs(point)
    for index, measured in enumerate(rounds):
        RowSplit(measured.split).validate(point.tokens, point.cp, 1, field=f"rounds[{index}].split")
    options = KernelOptions.resolve()  # as the rounds' model priced the step (measured_split.refine_by_measurement)
    return [RankTimes(estimate(cfg, point.ratio, lengths, point.cp, machine, point.tokens,
                               split=RowSplit(r.split), kernel_options=options), r.rank_ms) for r in rounds]


def predicted_rank_ms(point: Point, split: RowSplit, calibration: Calibration, machine: Machine) -> np.ndarray:
    """``[cp]`` the model's compute ms per rank of ``point`` on ``split`` under ``calibration``."""
    cfg, lengths = point_inputs(point)
    est = estimate(cfg, point.ratio, lengths, point.cp, machine, point.tokens, split=split,
                   kernel_options=KernelOptions.resolve())
    return calibration.rank_compute_s(est, point.direction) * 1e3


def next_round(point: Point, rounds: Sequence[SplitRound], machine: Machine, *,
               calibration: Calibration | None = None, per_rank: bool = True) -> NextRound:
    """The refit on ``rounds`` (from prior ``calibration``, as the rounds ran), the split it gives and the
    model's rank times on that split; ``per_rank=False``: the refit without per-rank factors."""
    if not rounds:
        raise ValueError("rounds: at least one measured round is needed")
    fitted = refit(_samples(point, rounds, machine), prior=calibration, direction=point.direction,
                   source=f"replay of {len(rounds)} rounds of {point.label()}", per_rank=per_rank)
    split = model_split(point, fitted, machine)
    predicted = predicted_rank_ms(point, split, fitted, machine)
    return NextRound(fitted, split, tuple(float(t) for t in predicted), split.bounds in {r.split for r in rounds})


@dataclass(frozen=True)
class Hindcast:
    """Round ``index`` predicted from the rounds before it: relative errors of the model's rank times."""

    index: int
    errors: tuple[float, ...]
    """Per rank, predicted / measured - 1."""

    @property
    def rms(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.errors))))

    @property
    def worst(self) -> float:
        return float(np.max(np.abs(self.errors)))


def hindcast(point: Point, rounds: Sequence[SplitRound], machine: Machine, *, calibration: Calibration | None = None,
             per_rank: bool = True, ridge: float = 1e-2) -> list[Hindcast]:
    """For every round ``k >= 1``: fit on rounds ``0 .. k-1`` (``ridge``: the refit's, towards ``calibration``),
    predict round ``k``'s rank times on its split."""
    samples = _samples(point, rounds, machine)
    out = []
    for index in range(1, len(rounds)):
        fitted = refit(samples[:index], prior=calibration, direction=point.direction, per_rank=per_rank, ridge=ridge)
        predicted = fitted.rank_compute_s(samples[index].est, point.direction) * 1e3
        out.append(Hindcast(index, tuple(float(e) for e in predicted / np.asarray(rounds[index].rank_ms) - 1.0)))
    return out
