"""A calibration refitted from measured per-rank step times (the ``measured`` split's model).

A :class:`~dsv4cp.model.calibration.Calibration` fitted on a CP = 1 trace scales each phase class by one
factor, but a rank's time at large cp is not the CP = 1 mix: the indexer's work per entry, the gathered
buffers' padding and the fixed costs weigh differently on the first and the last rank. Here the factors
are refitted on what the ranks themselves took: each measured split ``k`` gives, for every rank ``r``, a
measured step time ``m[k, r]`` and the model's per-class bounds ``b[k, r, c]`` (class and direction), and
the factors ``f`` minimise

    sum over (k, r) of ((m[k, r] - sum_c f_c b[k, r, c]) / m[k, r])^2 + ridge * sum_c (f_c / p_c - s)^2

with ``p`` the prior factors (the calibration the split started from) and ``s = 1``; without a prior,
``p = 1`` and ``s`` the one common factor that fits the samples best (:func:`_common_level`). The relative
residual weighs every rank alike; the ridge keeps classes the samples cannot tell apart (there are ten
class factors and often fewer ranks) at their prior, or without one at the level the samples show. The fit
is tried for every indexer scan
(:data:`~dsv4cp.model.phase_classes.INDEXER_SCANS`: which gathered entries the top-k is charged for) and the
best-fitting one is kept (on the classes alone, before the per-rank factors below), unless it fits only
marginally better than the prior's scan (:data:`SCAN_MARGIN`). Per class, so the result transfers to other
packings and token counts, and it is an ordinary calibration file (``--calibration``).

Then, when every sample has the same cp, a per-rank residual: the part of each rank's time no class
factor expresses, as one multiplicative factor per rank (``Calibration.rank_factors``), fitted on the
class fit's residual: ``m[k, r] = g_r sum_c f_c b[k, r, c]`` with ``f`` the class-only fit. Not jointly:
rank factors and classes trade along directions a few rounds of nearby splits barely constrain (a factor
rising with the rank mimics the indexer's and attention's share, which rises with the rank); fitted after
the classes, the rank factors take only what no class factor can, and the class factors, the part that
transfers, stay those of the class-only fit. The indexer scan is chosen on the classes alone too: with rank
factors every scan fits a round of ``cp`` ranks almost exactly (after one round of the 2026-12-02 H200 run
the relative RMS is 0.0009 on ``visible`` against 0.0011 on ``prefix``, overfitted: nine class and eight rank
factors on eight times), while the classes alone tell the scans apart (0.0181 against 0.0109; on the
committed 2026-12-01 rounds ``visible`` with rank factors would have given rank 0 13% more rows next). A
per-rank residual far larger than the H200's (+-15% in the tests) can make another scan's classes fit
marginally better; :data:`SCAN_MARGIN` keeps the prior's scan then.

Multiplicative, not an additive fixed cost plus a factor: on the committed H200 rounds (one 256K document,
cp 8, ``results/2026-12-01-h200-emulate-all``) the splits of rounds 1-3 differ by under 1% of any rank's
rows, so a rank's fixed and proportional parts cannot be told apart from them (two unknowns per rank, one
value per rank that barely moves); one factor is identifiable from a single round, keeps its meaning when
the split moves rows, and the residuals it must carry there are small: the fitted factors are 0.991-1.014
(one document) and 0.982-1.026 (histogram packing), not a fixed offset of several milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsv4cp.model.calibration import Calibration, model_class_times
from dsv4cp.model.costs import BOTH, LayerEstimate
from dsv4cp.model.phase_classes import INDEXER_SCANS

FACTOR_RANGE = (0.05, 50.0)
"""Refitted factors are clipped to this range of their prior (a fit outside it is a bad sample)."""

SCAN_MARGIN = 0.9
"""Another indexer scan than the prior's is chosen only when its classes' relative RMS residual is below this
fraction of the prior scan's: on one document the scans differ only by the padding term, which a per-rank
residual or noise can stand in for, so near ties keep the scan the prior was fitted on."""

RANK_FACTOR_RANGE = (0.5, 2.0)
"""Per-rank factors are clipped to this range: a rank twice as slow as its modelled work is a bad sample or
a device fault, not a residual of the model."""


@dataclass(frozen=True)
class RankTimes:
    """One measured split: the model of its layout and every rank's measured step time (ms)."""

    est: LayerEstimate
    rank_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rank_ms) != self.est.cp:
            raise ValueError(f"rank_ms: needs one time per rank of cp {self.est.cp}, got {len(self.rank_ms)}")
        for rank, value in enumerate(self.rank_ms):
            if value is None or not np.isfinite(value) or value <= 0:
                raise ValueError(f"rank_ms[{rank}]: must be a finite time > 0 ms, got {value!r}")


def refit(samples: Sequence[RankTimes], prior: Calibration | None = None, *, direction: str = BOTH,
          ridge: float = 1e-2, source: str = "measured split", per_rank: bool = True) -> Calibration:
    """The calibration whose per-rank times best match ``samples`` (see the module docstring); with
    ``per_rank`` (default) and samples of one cp, it carries per-rank factors (:func:`_fit_scan`)."""
    if not samples:
        raise ValueError("samples: at least one measured split is needed")
    if not ridge > 0:
        raise ValueError(f"ridge: must be > 0, got {ridge!r}")
    machine = samples[0].est.machine.name
    prior = prior or Calibration(factors={}, machine=machine)
    with_ranks = per_rank and len({sample.est.cp for sample in samples}) == 1
    fits = {scan: fitted for scan in INDEXER_SCANS
            if (fitted := _fit_scan(samples, prior, direction, ridge, scan, with_ranks)) is not None}
    if not fits:
        raise ValueError("samples: no phase class has a bound to fit (is the layout empty?)")
    scan = min(fits, key=lambda name: fits[name][-1])  # on the classes alone (see the module docstring)
    if prior.indexer_scan in fits and fits[scan][-1] >= SCAN_MARGIN * fits[prior.indexer_scan][-1]:
        scan = prior.indexer_scan  # a near tie: the scan the prior was fitted on
    residual, factors, scale, rank_factors, classes_only = fits[scan]
    fitted_info = {key: {"over_prior": round(scale[key], 4)} for key in factors}
    fitted_info["relative_rms_residual"] = {"value": round(residual, 6)}
    if rank_factors:
        fitted_info["relative_rms_residual_without_rank_factors"] = {"value": round(classes_only, 6)}
    return Calibration(factors=factors, machine=machine, source=source, indexer_scan=scan, fitted=fitted_info,
                       rank_factors=rank_factors)


def _fit_scan(samples, prior: Calibration, direction: str, ridge: float, scan: str, with_ranks: bool):
    """``(relative RMS residual, factors, factor / prior, rank factors, residual of the classes alone)`` on
    indexer scan ``scan``; None without bounds. With ``with_ranks`` the rank factors come from the class
    fit's residual (:func:`_rank_factors`) and the first residual is that of both together."""
    rows, measured, ranks, keys = [], [], [], None
    for sample in samples:
        times = model_class_times(sample.est, scan)
        if direction != BOTH:
            times = times[times["direction"] == direction]
        times = times.assign(key=times["phase_class"] + "." + times["direction"])
        table = times.pivot_table(index="rank", columns="key", values="bound_ms", aggfunc="sum", fill_value=0.0)
        table = table.reindex(range(sample.est.cp), fill_value=0.0)
        keys = sorted(set(keys or []) | set(table.columns))
        rows.append(table)
        measured.extend(sample.rank_ms)
        ranks.extend(range(sample.est.cp))
    keys = [key for key in keys if any(key in t.columns and t[key].sum() > 0 for t in rows)]
    if not keys:
        return None
    priors = np.array([prior.factor(*key.split(".")) for key in keys])
    bounds = np.vstack([t.reindex(columns=keys, fill_value=0.0).to_numpy() for t in rows]) * priors
    m, rank = np.asarray(measured, dtype=float), np.asarray(ranks)
    scale = _class_scale(bounds / m[:, None], ridge, towards_common_level=not prior.factors)
    per_rank = _rank_factors(m, bounds @ scale, rank) if with_ranks else np.ones(1)
    modelled = bounds @ scale * (per_rank[rank] if with_ranks else 1.0)
    residual = float(np.sqrt(np.mean((modelled / m - 1.0) ** 2)))
    classes_only = float(np.sqrt(np.mean((bounds @ scale / m - 1.0) ** 2)))
    factors = {key: float(p * s) for key, p, s in zip(keys, priors, scale)}
    rank_factors = tuple(float(f) for f in per_rank) if with_ranks else ()
    return residual, factors, dict(zip(keys, map(float, scale))), rank_factors, classes_only


def _class_scale(design: np.ndarray, ridge: float, towards_common_level: bool) -> np.ndarray:
    """Factor / prior per class minimising the relative residuals (``design``: bound x prior / measured per
    row) plus the ridge towards the prior, or, with ``towards_common_level`` (no prior: its factors of 1 say
    nothing), towards the common level of the samples; clipped to :data:`FACTOR_RANGE`."""
    count = design.shape[1]
    level = _common_level(design) if towards_common_level else 1.0
    lhs = np.vstack([design, np.sqrt(ridge) * np.eye(count)])
    rhs = np.concatenate([np.ones(design.shape[0]), np.sqrt(ridge) * level * np.ones(count)])
    scale, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
    return np.clip(scale, *FACTOR_RANGE)


def _common_level(design: np.ndarray) -> float:
    """The one factor / prior shared by every class that best fits the rows (least squares on the relative
    residuals): where the ridge pulls the classes the samples cannot tell apart when there is no prior.
    Towards 1 instead (the bound itself), a device 2-5x slower than its bounds would have those classes
    pulled off the level that every sample shows, which no per-rank factor can take back (they keep a
    geometric mean of 1): one round of 4 ranks then left relative residuals of up to 0.1."""
    summed = design.sum(axis=1)
    norm = float(summed @ summed)
    return float(np.clip(summed.sum() / norm, *FACTOR_RANGE)) if norm > 0 else 1.0


def _rank_factors(measured: np.ndarray, modelled: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per rank, the geometric mean over the samples of measured / modelled time, normalised to a
    geometric mean of 1 over the ranks (the class factors carry the level), clipped to
    :data:`RANK_FACTOR_RANGE`. The mean over every round so far is the damping: round ``k``'s own estimate
    weighs ``1 / k``, so one noisy round moves the factors by a fraction of its noise while a residual
    every round shows stays."""
    logs = np.log(measured / np.maximum(modelled, np.finfo(float).tiny))
    per_rank = np.bincount(rank, weights=logs) / np.bincount(rank)
    return np.clip(np.exp(per_rank - per_rank.mean()), *RANK_FACTOR_RANGE)
