"""Per-rank factors of a refitted calibration: recovered from synthetic rank times with a planted per-rank
residual, damped as the geometric mean of the rounds, applied at the cp they were fitted at and ignored (with
a note) at any other, weighed by the balanced split, and carried in the calibration file, whose older form
(without them) still loads. Random factors from fixed seeds."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine, estimate
from dsv4cp.model.balanced_split import balanced_split
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.partition import policy_split
from dsv4cp.model.refit import RankTimes, refit

CFG = DSv4Config.preset("flash")
DOCS = [65536, 32768, 16384, 8192, 4096, 4096]
"""Several documents: the indexer scans (visible, prefix, all) differ, so the refit can tell them apart."""
TOTAL = sum(DOCS)
CP = 8
OLD_FILE = Path(__file__).parents[1] / "data" / "calibration-check" / "calibration-h200.json"


def _classes(rng: random.Random) -> Calibration:
    factors = {f"{c}.{d}": rng.uniform(1.1, 4.0) for c in ("indexer", "attention", "projections", "compressors",
                                                           "loss") for d in ("fwd", "bwd")}
    del factors["indexer.bwd"]  # the selection has no backward
    return Calibration(factors=factors, machine="h200x2", indexer_scan="prefix")


def _planted(rng: random.Random, cp: int = CP, spread: float = 0.15) -> tuple[float, ...]:
    """Per-rank factors in ``1 +- spread``, normalised to a geometric mean of 1 (as the refit returns them)."""
    factors = np.array([rng.uniform(1 - spread, 1 + spread) for _ in range(cp)])
    return tuple(float(f) for f in factors / np.exp(np.log(factors).mean()))


def _split(skew: float, cp: int = CP) -> RowSplit:
    weights = np.linspace(1 + skew, 1 - skew, cp)
    cuts = np.round(np.cumsum(weights) / weights.sum() * TOTAL / 128).astype(int) * 128
    return RowSplit((0, *map(int, cuts[:-1]), TOTAL))


def _sample(true: Calibration, split: RowSplit) -> RankTimes:
    est = estimate(CFG, 4, DOCS, split.cp, Machine(), split=split)
    return RankTimes(est, tuple(float(v) * 1e3 for v in true.rank_compute_s(est)))


def _worst_error(calibration: Calibration, sample: RankTimes) -> float:
    return float(np.abs(calibration.rank_compute_s(sample.est) * 1e3 / np.asarray(sample.rank_ms) - 1).max())


def test_refit_recovers_a_planted_residual_when_the_classes_are_known(seed):
    """Classes held at a correct prior (a ridge that fixes them): the rank factors are the planted ones."""
    rng = random.Random(seed)
    classes = _classes(rng)
    planted = _planted(rng)
    true = dataclasses.replace(classes, rank_factors=planted)
    samples = [_sample(true, _split(skew)) for skew in (0.0, 0.3)]
    fitted = refit(samples, prior=classes, ridge=1e6)
    assert np.allclose(fitted.rank_factors, planted, rtol=1e-3), (fitted.rank_factors, planted)
    assert fitted.fitted["relative_rms_residual"]["value"] < 1e-3
    assert fitted.fitted["relative_rms_residual_without_rank_factors"]["value"] > 0.02


def test_refit_with_rank_factors_predicts_an_unseen_split(seed):
    """Classes off by up to 25% and a planted +-15% per-rank residual: with the rank factors the refit
    predicts every rank of a split it was not fitted on within 4%; the classes alone miss some rank by 6%+."""
    rng = random.Random(seed)
    classes = _classes(rng)
    prior = dataclasses.replace(classes, factors={k: v * rng.uniform(0.8, 1.25) for k, v in classes.factors.items()})
    true = dataclasses.replace(classes, rank_factors=_planted(rng))
    samples = [_sample(true, _split(skew)) for skew in (0.0, 0.3, 0.5)]
    unseen = _sample(true, _split(0.15))
    with_ranks = refit(samples, prior=prior)
    classes_only = refit(samples, prior=prior, per_rank=False)
    assert classes_only.rank_factors == ()
    assert _worst_error(with_ranks, unseen) < 0.04
    assert _worst_error(classes_only, unseen) > 0.06
    for sample in samples:
        assert _worst_error(with_ranks, sample) < 0.07


def test_rank_factors_are_the_geometric_mean_of_the_rounds(seed):
    """Two rounds whose ranks differ by different factors (classes fixed by the ridge): the refit on both
    takes each rank's geometric mean, normalised, so a second round moves the factors half-way."""
    rng = random.Random(seed)
    classes = _classes(rng)
    first, second = _planted(rng), _planted(rng)
    samples = [_sample(dataclasses.replace(classes, rank_factors=first), _split(0.1)),
               _sample(dataclasses.replace(classes, rank_factors=second), _split(0.4))]
    fitted = refit(samples, prior=classes, ridge=1e6)
    expected = np.sqrt(np.asarray(first) * np.asarray(second))
    assert np.allclose(fitted.rank_factors, expected / np.exp(np.log(expected).mean()), rtol=1e-3)


def test_no_rank_factors_from_samples_of_several_cps(seed):
    rng = random.Random(seed)
    true = _classes(rng)
    fitted = refit([_sample(true, _split(0.2, 4)), _sample(true, _split(0.2, 8))])
    assert fitted.rank_factors == ()


def test_rank_factors_apply_at_their_cp_only(seed):
    rng = random.Random(seed)
    planted = _planted(rng)
    classes = _classes(rng)
    with_ranks = dataclasses.replace(classes, rank_factors=planted, source="the cp 8 refit")
    est8 = estimate(CFG, 4, DOCS, 8, Machine(), split=_split(0.2))
    assert np.allclose(with_ranks.rank_compute_s(est8), classes.rank_compute_s(est8) * np.asarray(planted))
    assert with_ranks.rank_factors_note(8) is None and classes.rank_factors_note(4) is None
    est4 = estimate(CFG, 4, DOCS, 4, Machine(), split=_split(0.2, 4))
    assert np.array_equal(with_ranks.rank_compute_s(est4), classes.rank_compute_s(est4))
    note = with_ranks.rank_factors_note(4)
    assert "the cp 8 refit" in note and "cp 8" in note and "ignored at cp 4" in note


def test_the_balanced_split_weighs_each_rank_by_its_factor(seed):
    """Per-row costs weighted per rank: the split minimises the largest weighted slice cost (checked by
    brute force on a small case), and a rank twice as slow gets fewer rows; the split under a calibration
    with rank factors gives a slow rank fewer rows than without."""
    rng = np.random.default_rng(seed)
    costs = rng.uniform(0.5, 2.0, 24)
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    weights = rng.uniform(0.5, 2.0, 3)
    split = balanced_split(prefix, 3, 1, 1, weights)

    def largest(bounds):
        return max(w * (prefix[e] - prefix[b]) for w, b, e in zip(weights, bounds[:-1], bounds[1:]))
    brute = min(largest((0, a, b, 24)) for a in range(1, 23) for b in range(a + 1, 24))
    assert largest(split.bounds) == pytest.approx(brute, rel=1e-9)
    even = balanced_split(prefix, 3)
    assert even == balanced_split(prefix, 3, 1, 1, np.ones(3))
    with pytest.raises(ValueError, match="rank_weights"):
        balanced_split(prefix, 3, 1, 1, [1.0, 0.0, 1.0])

    classes = _classes(random.Random(seed))
    slow_rank = dataclasses.replace(classes, rank_factors=(1.0, 1.3, 1.0, 1.0))
    plain = policy_split(CFG, 4, DOCS, 4, "balanced", Machine(), calibration=classes)
    weighed = policy_split(CFG, 4, DOCS, 4, "balanced", Machine(), calibration=slow_rank)
    assert np.diff(weighed.bounds)[1] < np.diff(plain.bounds)[1]
    est = estimate(CFG, 4, DOCS, 4, Machine(), split=weighed)
    times = slow_rank.rank_compute_s(est)
    assert times.max() / times.mean() < 1.03


def test_calibration_files_with_and_without_rank_factors(tmp_path, seed):
    rng = random.Random(seed)
    with_ranks = dataclasses.replace(_classes(rng), rank_factors=_planted(rng, 4), source="refit")
    path = tmp_path / "cal.json"
    with_ranks.save(path)
    assert Calibration.load(path) == with_ranks
    assert len(json.loads(path.read_text())["rank_factors"]) == 4
    without = dataclasses.replace(with_ranks, rank_factors=())
    without.save(path)
    assert "rank_factors" not in json.loads(path.read_text())  # files without them: as before
    old = tmp_path / "old.json"
    shutil.copy(OLD_FILE, old)  # a committed calibration written before rank factors existed
    loaded = Calibration.load(old)
    assert loaded.rank_factors == () and loaded.factors == json.loads(OLD_FILE.read_text())["factors"]
    for bad, match in (([1.0, -1.0], r"rank_factors\[1\]"), ([1.0, "x"], r"rank_factors\[1\]"), ([2.0], "single"),
                       ({"0": 1.0}, "must be a list"), ([1.0, float("inf")], r"rank_factors\[1\]")):
        values = {**without.to_dict(), "rank_factors": bad}
        path.write_text(json.dumps(values))
        with pytest.raises(ValueError, match=match):
            Calibration.load(path)


def test_model_cli_notes_rank_factors_ignored_at_another_cp(tmp_path, capsys, seed):
    rng = random.Random(seed)
    path = tmp_path / "cal.json"
    dataclasses.replace(_classes(rng), rank_factors=_planted(rng, 2), source="a cp 2 refit").save(path)
    point = ["model", "--preset", "tiny", "--ratio", "4", "--tokens", "1024", "--calibration", str(path)]
    assert main([*point, "--cp", "4"]) == 0
    note = "note: a cp 2 refit: its per-rank factors were fitted at cp 2 and are ignored at cp 4"
    assert note in capsys.readouterr().out
    assert main([*point, "--cp", "2"]) == 0
    assert "per-rank factors" not in capsys.readouterr().out
