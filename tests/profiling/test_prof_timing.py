"""The timing protocol on CPU: plausible statistics, argument checks, and the max over gloo ranks."""

from __future__ import annotations

import json
import time

import pytest
import torch
from prof_helpers import spawn, timing_worker

from dsv4cp.profiling.timing import TimingResult, benchmark


def test_sleep_statistics_are_plausible():
    result = benchmark(lambda: time.sleep(0.005), warmup=1, reps=7, device="cpu")
    assert isinstance(result, TimingResult)
    assert result.reps == len(result.times_ms) == 7
    assert 5.0 <= result.median_ms < 50.0
    assert result.min_ms <= result.p20_ms <= result.median_ms <= result.p80_ms <= result.max_ms
    assert result.to_dict()["median_ms"] == result.median_ms


def test_warmup_calls_are_not_timed():
    calls = []
    result = benchmark(lambda: calls.append(1), warmup=3, reps=4, device="cpu")
    assert len(calls) == 7 and result.reps == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [({"reps": 0}, "reps"), ({"warmup": -1}, "warmup"), ({"cuda_graph": True, "device": "cpu"}, "cuda_graph")],
)
def test_bad_arguments_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        benchmark(lambda: None, **kwargs)


def test_refuses_to_time_under_a_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="profiler"):
            benchmark(lambda: None, reps=1, device="cpu")


def test_per_rep_time_is_the_max_over_ranks(tmp_path):
    spawn(timing_worker, str(tmp_path / "store"), str(tmp_path))
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert fast["times_ms"] == slow["times_ms"]  # both ranks report the same max vector
    assert fast["median_ms"] >= 22.0  # rank 1 sleeps 22 ms, rank 0 only 2 ms
    assert min(fast["times_ms"]) >= 22.0
