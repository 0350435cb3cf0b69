"""The suite's one timer (dsv4cp.profiling.timing.time_call) and its summary, which the benchmarks use."""

from __future__ import annotations

import time

import pytest

from dsv4cp.profiling.timing import summarise, time_call


def test_time_call_returns_the_result_and_the_time_of_one_call():
    result, ms = time_call(lambda: (time.sleep(0.02), "done")[1], "cpu")
    assert result == "done"
    assert 20.0 <= ms < 2000.0


def test_summarise_interpolates_the_quantiles_linearly():
    summary = summarise([4.0, 1.0, 3.0, 2.0, 10.0])
    # sorted 1, 2, 3, 4, 10: p20 at position 0.8 -> 1.8, median 3, p80 at position 3.2 -> 4 + 0.2 * 6
    assert (summary.p20_ms, summary.median_ms, summary.p80_ms) == pytest.approx((1.8, 3.0, 5.2))
    assert (summary.min_ms, summary.max_ms, summary.reps) == (1.0, 10.0, 5)
    assert summary.times_ms == [4.0, 1.0, 3.0, 2.0, 10.0]  # in the order they ran
    with pytest.raises(ValueError, match="times"):
        summarise([])
