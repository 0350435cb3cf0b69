"""How ``dsv4cp compare`` decides, on synthetic repetition times with realistic CPU noise drawn from
fixed seeds: honest reruns raise (almost) no alarm over many runs, a 1.3x slowdown of one point is
caught, and the rule, its thresholds and each point's statistic are printed.

The noise model of one repetition on a loaded CPU: the point's time x a 5% log-normal jitter, and in
5% of the repetitions a stall of 1.2x to 2.5x (another process took the core). Each run has
:data:`POINTS` points (the smoke sweep's 30) of :data:`REPS` repetitions.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_helpers import grid

from dsv4cp.cli.main import main
from dsv4cp.records import append_record, make_record, write_meta
from dsv4cp.report.compare import compare, decision_lines
from dsv4cp.report.compare_sides import POINT_COLUMNS, Side, load_side
from dsv4cp.report.compare_stats import Measured, Rule, decide, smallest_p

ROOT = Path(__file__).resolve().parents[2]
POINTS = 30
RUNS = 40
THRESHOLD = 0.05  # compare's default --max-regression


REPS = 20
"""Repetitions of a run here: enough for the U test to reach alpha / points = 0.01 / 30."""


def cpu_times(rng: np.random.Generator, base_ms: float, n: int = REPS) -> np.ndarray:
    """``n`` repetition times (ms) of a point taking ``base_ms``, under the noise model above."""
    times = base_ms * np.exp(0.05 * rng.standard_normal(n))
    stalls = rng.random(n) < 0.05
    times[stalls] *= rng.uniform(1.2, 2.5, stalls.sum())
    return times


def _side(times: dict[str, np.ndarray], *, with_samples: bool = True) -> Side:
    """An in-memory run side: one ok point per key, its median and p20..p80 from its times."""
    rows = []
    for key, samples in times.items():
        p20, median, p80 = np.percentile(samples, [20, 50, 80])
        rows.append({"name": f"point={key}", "status": "ok", "value": median, "low": p20, "high": p80,
                     "samples": tuple(samples) if with_samples else None, "config": {}, "problem": None})
    points = pd.DataFrame(rows, columns=list(POINT_COLUMNS), index=pd.Index(list(times), name="key"))
    return Side("synthetic", "run", "cpu-test", points, "p20..p80")


def _pair_of_runs(rng: np.random.Generator, slowdown: dict[str, float] | None = None):
    bases = rng.uniform(2.0, 50.0, POINTS)  # the smoke points' range of ms
    keys = [f"p{i}" for i in range(POINTS)]
    base = {k: cpu_times(rng, b) for k, b in zip(keys, bases)}
    new = {k: cpu_times(rng, b * (slowdown or {}).get(k, 1.0)) for k, b in zip(keys, bases)}
    return base, new


def test_honest_reruns_raise_no_alarm_beyond_the_false_alarm_level(seed):
    rng = np.random.default_rng(seed)
    alarmed = []
    for _ in range(RUNS):
        base, new = _pair_of_runs(rng)
        comparison = compare(_side(base), _side(new), "time_ms_median", threshold=THRESHOLD)
        assert (comparison.table["method"] == "U test").all()
        alarmed.append(len(comparison.regressions) + len(comparison.improvements))
    # Bonferroni keeps a run's false-alarm chance <= alpha = 1% (0.8% with this noise, both directions):
    # more than 2 alarmed runs of 40 has a chance below 1%
    assert sum(count > 0 for count in alarmed) <= 2, alarmed


def test_a_30pct_slowdown_of_one_point_is_caught(seed):
    rng = np.random.default_rng(seed)
    caught = falsely = 0
    for run in range(RUNS):
        slow = f"p{run % POINTS}"
        base, new = _pair_of_runs(rng, {slow: 1.3})
        comparison = compare(_side(base), _side(new), "time_ms_median", threshold=THRESHOLD)
        regressed = comparison.regressions["key"].tolist()
        caught += slow in regressed
        falsely += any(key != slow for key in regressed)
    # about 99% of the runs catch it with this noise: fewer than 36 of 40 has a chance near 1e-5; the
    # other points alarm in under 1% of the runs, as in the honest reruns
    assert caught >= 36 and falsely <= 2, (caught, falsely)


@pytest.mark.parametrize(("new_count", "base_count", "usable"), [(3, 3, False), (6, 6, True), (20, 20, True)])
def test_too_few_samples_are_undecided_never_a_regression_and_say_why(seed, new_count, base_count, usable):
    rng = np.random.default_rng(seed)
    base = {"a": cpu_times(rng, 10.0, base_count), "b": cpu_times(rng, 20.0, base_count)}
    new = {"a": cpu_times(rng, 10.0, new_count) * 3, "b": cpu_times(rng, 20.0, new_count)}
    comparison = compare(_side(base), _side(new), "time_ms_median", threshold=THRESHOLD)
    assert (comparison.table["method"] == ("U test" if usable else "too few")).all()
    assert smallest_p(new_count, base_count) < 0.01 / 2 if usable else smallest_p(new_count, base_count) >= 0.05
    verdict_a = comparison.table.set_index("key").loc["a", "verdict"]
    assert verdict_a == ("regression" if usable else "undecided")
    text = "\n".join(decision_lines(comparison))
    assert ("too few (2 points): 3 and 3 repetition times cannot reach it (p >= 0.05)" in text) != usable


def test_honest_reruns_of_three_repetitions_raise_no_alarm(seed):
    """The smoke sweep's own 3 repetitions: no test can tell its noise, so nothing is a regression."""
    rng = np.random.default_rng(seed)
    for _ in range(RUNS):
        bases = rng.uniform(2.0, 50.0, POINTS)
        base = {f"p{i}": cpu_times(rng, b, 3) for i, b in enumerate(bases)}
        new = {f"p{i}": cpu_times(rng, b, 3) for i, b in enumerate(bases)}
        comparison = compare(_side(base), _side(new), "time_ms_median", threshold=THRESHOLD)
        assert len(comparison.regressions) == 0 and len(comparison.improvements) == 0


def _records_side(times: dict[str, np.ndarray], imbalance: dict[str, float], path: Path) -> Side:
    """A run on disk whose records carry every time metric and an imbalance (loaded as compare loads)."""
    for key, samples in times.items():
        p20, median, p80 = np.percentile(samples, [20, 50, 80])
        metrics = {"time_ms_median": float(median), "time_ms_p20": float(p20), "time_ms_p80": float(p80),
                   "time_ms_samples": [float(t) for t in samples], "imbalance_max_over_mean": imbalance[key]}
        axes = {"preset": "tiny", "ratio": 4, "cp": 2, "tokens": 256 * (1 + int(key[1:])), "packing": "one",
                "pass": "fwd"}
        append_record(path / "records.jsonl", make_record(axes, metrics, sweep="synthetic", status="ok",
                                                          machine="cpu-test", git_sha="0" * 40))
    write_meta(path, {"machine": "cpu-test"})
    return path


@pytest.mark.parametrize("metric", ["time_ms_p20", "time_ms_p80", "imbalance_max_over_mean"])
@pytest.mark.parametrize("reps", [3, REPS])
def test_honest_reruns_raise_no_alarm_on_quantiles_and_imbalance(tmp_path, seed, metric, reps):
    """Quantiles and the imbalance have no band of their own: judged on the repetition times where there
    are enough, else undecided; an honest rerun is never a regression or an improvement."""
    rng = np.random.default_rng(seed)
    bases = rng.uniform(2.0, 50.0, POINTS)
    sides = []
    for name in ("base", "new"):
        times = {f"p{i}": cpu_times(rng, b, reps) for i, b in enumerate(bases)}
        imbalance = {key: float(1 + abs(rng.normal(0, 0.1))) for key in times}  # ranks' medians drift apart
        sides.append(load_side(_records_side(times, imbalance, tmp_path / name), metric))
    comparison = compare(*sides, metric, threshold=THRESHOLD)
    assert len(comparison.table) == POINTS
    assert len(comparison.regressions) == 0 and len(comparison.improvements) == 0, comparison.table
    expected = "U test" if metric != "imbalance_max_over_mean" and reps == REPS else None
    if expected:
        assert (comparison.table["method"] == expected).all()
    else:
        assert comparison.table["method"].isin(["too few", "no spread"]).all()


def test_an_exact_metric_changes_without_noise(tmp_path, seed):
    """The cost model's FLOPs are computed: a change beyond the threshold is one, whatever the times."""
    rng = np.random.default_rng(seed)
    base = {"a": cpu_times(rng, 10.0, 3)}
    flops = {"a": 1e9}
    side = _side(base)
    new_points = side.points.copy()
    side.points["value"], new_points["value"] = flops["a"], flops["a"] * 1.5
    new_side = Side("synthetic", "run", "cpu-test", new_points, "none")
    comparison = compare(side, new_side, "model_flops", threshold=THRESHOLD)
    assert comparison.table["verdict"].tolist() == ["regression"] and comparison.table["method"].tolist() == ["exact"]


def test_decide_scales_the_baseline_by_the_machine_factor_and_applies_the_floor(seed):
    rng = np.random.default_rng(seed)
    base_times, new_times = cpu_times(rng, 100.0), cpu_times(rng, 100.0) * 2.0

    def measured(times):
        p20, median, p80 = np.percentile(times, [20, 50, 80])
        return Measured(median, p20, p80, tuple(times))

    base, new = measured(base_times), measured(new_times)
    plain = decide(base, new, Rule(0.05, 0.01, 1), higher_is_better=False)
    assert plain.verdict == "regression" and plain.cost == pytest.approx(new.value / base.value)
    loaded = decide(base, new, Rule(0.05, 0.01, 1, scale=2.0), higher_is_better=False)  # the machine runs 2x slower
    assert loaded.verdict in ("same", "within noise") and loaded.cost == pytest.approx(new.value / (2 * base.value))
    floored = decide(base, new, Rule(0.05, 0.01, 1, min_difference=new.value), higher_is_better=False)
    assert floored.verdict == "within noise"  # significant and large, but not slower by the floor
    rate = decide(Measured(1 / base.value, 1 / base.high, 1 / base.low, base.samples),
                  Measured(1 / new.value, 1 / new.high, 1 / new.low, new.samples), Rule(0.05, 0.01, 1),
                  higher_is_better=True)
    assert rate.verdict == "regression" and rate.cost == pytest.approx(plain.cost)


def _write_run(run_dir: Path, times: dict[str, np.ndarray], points: list[dict]) -> Path:
    for axes, samples in zip(points, times.values()):
        p20, median, p80 = np.percentile(samples, [20, 50, 80])
        metrics = {"time_ms_median": float(median), "time_ms_p20": float(p20), "time_ms_p80": float(p80),
                   "time_ms_samples": [float(t) for t in samples]}
        append_record(run_dir / "records.jsonl", make_record(axes, metrics, sweep="synthetic", status="ok",
                                                             machine="cpu-test", git_sha="0" * 40))
    write_meta(run_dir, {"machine": "cpu-test"})
    return run_dir


def test_the_cli_prints_the_method_thresholds_and_each_points_statistic(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[4096, 16384], overlap=["none", "async"])
    rng = np.random.default_rng(seed)
    keys = [f"p{i}" for i in range(len(points))]
    bases = dict(zip(keys, rng.uniform(2.0, 50.0, len(points))))
    base = _write_run(tmp_path / "base", {k: cpu_times(rng, b) for k, b in bases.items()}, points)
    same = _write_run(tmp_path / "same", {k: cpu_times(rng, b) for k, b in bases.items()}, points)
    slow = _write_run(tmp_path / "slow", {k: cpu_times(rng, b * (1.3 if k == "p5" else 1.0))
                                          for k, b in bases.items()}, points)
    assert main(["compare", str(base), str(same)]) == 0
    out = capsys.readouterr().out
    assert "U test (8 points): one-sided Mann-Whitney U" in out and "p < alpha/points = 0.01/8" in out
    assert "new/baseline > 1 + 5% (--max-regression)" in out and "FALLBACK" not in out
    assert sum("U test p=" in line for line in out.splitlines()) == 8  # every point's statistic
    assert main(["compare", str(base), str(slow)]) == 1
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("REGRESSION")]
    assert "cp=2" in line and "tokens=4096" in line and "overlap=async" in line and "U test p=" in line
    p = float(line.split("U test p=")[1].split(";")[0])
    assert p < 0.01 / 8 and math.isfinite(p)
