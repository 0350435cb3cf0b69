"""The calibration refitted from measured per-rank times: on synthetic timings made by a known calibration,
the refit reproduces every measured rank within a small relative error, finds the indexer scan they were made
on, and predicts the ranks of a split it was not fitted on. Random true factors from fixed seeds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.refit import RankTimes, refit

CFG = DSv4Config.preset("flash")
DOCS = [131072]


def _true_calibration(rng: random.Random, scan: str) -> Calibration:
    factors = {f"{c}.{d}": rng.uniform(1.1, 4.0) for c in ("indexer", "attention", "projections", "compressors",
                                                           "loss") for d in ("fwd", "bwd")}
    del factors["indexer.bwd"]  # the selection has no backward
    return Calibration(factors=factors, machine="h200x2", indexer_scan=scan)


def _split(cp: int, skew: float) -> RowSplit:
    """``cp`` slices of the 128K rows, the first ones larger by ``skew`` (aligned to 128 rows)."""
    weights = np.linspace(1 + skew, 1 - skew, cp)
    cuts = np.round(np.cumsum(weights) / weights.sum() * DOCS[0] / 128).astype(int) * 128
    return RowSplit((0, *map(int, cuts[:-1]), DOCS[0]))


def _sample(true: Calibration, split: RowSplit) -> RankTimes:
    est = estimate(CFG, 4, DOCS, split.cp, Machine(), split=split)
    return RankTimes(est, tuple(float(v) * 1e3 for v in true.rank_compute_s(est)))


@pytest.mark.parametrize("scan", ["visible", "prefix"])
def test_refit_reproduces_the_measured_ranks(scan, seed):
    print(f"seed {seed}")
    rng = random.Random(seed * 13 + len(scan))
    true = _true_calibration(rng, scan)
    samples = [_sample(true, _split(8, skew)) for skew in (0.0, 0.3, 0.5)]
    fitted = refit(samples)
    for sample in samples:
        predicted = fitted.rank_compute_s(sample.est) * 1e3
        assert np.allclose(predicted, sample.rank_ms, rtol=0.03), (predicted, sample.rank_ms)
    unseen = _sample(true, _split(8, 0.15))
    assert np.allclose(fitted.rank_compute_s(unseen.est) * 1e3, unseen.rank_ms, rtol=0.05)
    assert fitted.fitted["relative_rms_residual"]["value"] < 0.02


def test_refit_stays_at_the_prior_when_the_prior_is_right(seed):
    rng = random.Random(seed)
    true = _true_calibration(rng, "visible")
    samples = [_sample(true, _split(4, 0.2))]
    fitted = refit(samples, prior=true)
    for key, value in true.factors.items():
        assert fitted.factors[key] == pytest.approx(value, rel=1e-6)
    assert fitted.fitted["relative_rms_residual"]["value"] < 1e-6


def test_refit_refuses_bad_samples():
    est = estimate(CFG, 4, DOCS, 2, Machine())
    with pytest.raises(ValueError, match="rank_ms"):
        RankTimes(est, (1.0,))
    with pytest.raises(ValueError, match=r"rank_ms\[1\]"):
        RankTimes(est, (1.0, float("inf")))
    with pytest.raises(ValueError, match="samples"):
        refit([])
