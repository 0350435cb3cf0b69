"""A calibration refitted from measured per-rank step times (the ``measured`` split's model).

A :class:`~dsv4cp.model.calibration.Calibration` fitted on a CP = 1 trace scales each phase class by one
factor, but a rank's time at large cp is not the CP = 1 mix: the indexer's work per entry, the gathered
buffers' padding and the fixed costs weigh differently on the first and the last rank. Here the factors
are refitted on what the ranks themselves took: each measured split ``k`` gives, for every rank ``r``, a
measured step time ``m[k, r]`` and the model's per-class bounds ``b[k, r, c]`` (class and direction), and
the factors ``f`` minimise

    sum over (k, r) of ((m[k, r] - sum_c f_c b[k, r, c]) / m[k, r])^2 + ridge * sum_c (f_c / p_c - 1)^2

with ``p`` the prior factors (the calibration the split started from; 1 without one). The relative
residual weighs every rank alike; the ridge keeps classes the samples cannot tell apart (there are ten
class factors and often fewer ranks) at their prior. The fit is tried for every indexer scan
(:data:`~dsv4cp.model.phase_classes.INDEXER_SCANS`: which gathered entries the top-k is charged for) and the
best-fitting one is kept. Per class, so the result transfers to other packings and token counts, and it
is an ordinary calibration file (``--calibration``).
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
          ridge: float = 1e-2, source: str = "measured split") -> Calibration:
    """The calibration whose per-rank times best match ``samples`` (see the module docstring)."""
    if not samples:
        raise ValueError("samples: at least one measured split is needed")
    if not ridge > 0:
        raise ValueError(f"ridge: must be > 0, got {ridge!r}")
    machine = samples[0].est.machine.name
    prior = prior or Calibration(factors={}, machine=machine)
    best = None
    for scan in INDEXER_SCANS:
        fitted = _fit_scan(samples, prior, direction, ridge, scan)
        if fitted is not None and (best is None or fitted[0] < best[0]):
            best = (*fitted, scan)
    if best is None:
        raise ValueError("samples: no phase class has a bound to fit (is the layout empty?)")
    residual, factors, scale, scan = best
    fitted_info = {key: {"over_prior": round(scale[key], 4)} for key in factors}
    fitted_info["relative_rms_residual"] = {"value": round(residual, 6)}
    return Calibration(factors=factors, machine=machine, source=source, indexer_scan=scan, fitted=fitted_info)


def _fit_scan(samples, prior: Calibration, direction: str, ridge: float, scan: str):
    """``(relative RMS residual, factors, factor / prior)`` on indexer scan ``scan``; None without bounds."""
    rows, measured, keys = [], [], None
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
    keys = [key for key in keys if any(key in t.columns and t[key].sum() > 0 for t in rows)]
    if not keys:
        return None
    priors = np.array([prior.factor(*key.split(".")) for key in keys])
    bounds = np.vstack([t.reindex(columns=keys, fill_value=0.0).to_numpy() for t in rows])
    m = np.asarray(measured, dtype=float)
    design = bounds * priors / m[:, None]  # relative residuals: unknowns are factor / prior
    lhs = np.vstack([design, np.sqrt(ridge) * np.eye(len(keys))])
    rhs = np.concatenate([np.ones(len(m)), np.sqrt(ridge) * np.ones(len(keys))])
    scale, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
    scale = np.clip(scale, *FACTOR_RANGE)
    residual = float(np.sqrt(np.mean((design @ scale - 1.0) ** 2)))
    factors = {key: float(p * s) for key, p, s in zip(keys, priors, scale)}
    return residual, factors, dict(zip(keys, map(float, scale)))
