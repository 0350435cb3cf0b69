"""The offline replay of a measured split's rounds: on rounds run against synthetic ranks, the replay
reproduces every split the rounds measured (it refits as the rounds did), predicts the next split, and its
hindcast of each round from the rounds before it is exact when the ranks follow the model exactly."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine
from dsv4cp.model.calibration import Calibration
from dsv4cp.sweeps.measured_split import SplitRound, refine_by_measurement
from dsv4cp.sweeps.spec import make_point
from dsv4cp.sweeps.split_replay import hindcast, next_round, predicted_rank_ms

POINT = make_point({"preset": "flash", "ratio": 4, "cp": 4, "tokens": 131072, "packing": "histogram",
                    "partition": "measured", "dtype": "bf16"})


def _hardware(rng: random.Random) -> Calibration:
    factors = {f"{c}.{d}": rng.uniform(1.2, 5.0) for c in ("indexer", "attention", "projections", "compressors",
                                                           "loss") for d in ("fwd", "bwd")}
    del factors["indexer.bwd"]
    return Calibration(factors=factors, machine="h200x2", indexer_scan="prefix",
                       rank_factors=(0.9, 1.05, 1.0, 1.0 / (0.9 * 1.05)))


def _measure(hardware: Calibration, rng: random.Random):
    def measure(split):
        times = predicted_rank_ms(POINT, split, hardware, Machine())
        return tuple(float(t) * (1 + rng.uniform(-0.01, 0.01)) for t in times), None
    return measure


def test_replay_reproduces_the_rounds_and_predicts_the_next(seed):
    rng = random.Random(seed)
    hardware = _hardware(rng)
    result, _ = refine_by_measurement(POINT, _measure(hardware, rng), target=1.0, max_rounds=3)
    rounds = result.rounds
    assert len(rounds) >= 2
    for index in range(1, len(rounds)):
        assert next_round(POINT, rounds[:index], Machine()).split.bounds == rounds[index].split
    following = next_round(POINT, rounds, Machine())
    assert following.calibration.rank_factors == result.calibration.rank_factors
    times = predicted_rank_ms(POINT, following.split, following.calibration, Machine())
    assert following.predicted_ms == pytest.approx(tuple(times))
    assert following.predicted_imbalance == pytest.approx(times.max() / times.mean())


def test_hindcast_is_exact_on_ranks_the_model_describes(seed):
    """Ranks exactly as a calibration with per-rank factors says, and that calibration as the prior (a
    ridge holding its classes): each round is predicted from the rounds before it to 1e-3."""
    rng = random.Random(seed)
    hardware = _hardware(rng)
    classes = dataclasses.replace(hardware, rank_factors=())
    splits = [(0, 40960, 73728, 102400, 131072), (0, 36864, 69632, 100352, 131072), (0, 32768, 65536, 98304, 131072)]
    rounds = [SplitRound(bounds, tuple(map(float, predicted_rank_ms(POINT, RowSplit(bounds), hardware, Machine()))))
              for bounds in splits]
    exact = hindcast(POINT, rounds, Machine(), calibration=classes, ridge=1e6)
    assert [h.index for h in exact] == [1, 2] and max(h.worst for h in exact) < 1e-3
    classes_only = hindcast(POINT, rounds, Machine(), calibration=classes, ridge=1e6, per_rank=False)
    assert min(h.worst for h in classes_only) > 0.03


def test_replay_refuses_no_rounds():
    with pytest.raises(ValueError, match="rounds"):
        next_round(POINT, [], Machine())

