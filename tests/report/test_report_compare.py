"""``dsv4cp compare`` on synthetic baseline/new pairs: exit 0 (pass), 1 (regression), 2 (unusable)."""

from __future__ import annotations

import json

import pytest
from report_helpers import grid, write_run

from dsv4cp.cli.main import main
from dsv4cp.records import append_record, make_record, point_id
from dsv4cp.report.compare import parse_threshold

POINTS = grid(cp=[1, 2], tokens=[4096, 16384], overlap=["none", "async"])
SLOW = POINTS[5]  # cp=2, tokens=4096, overlap=async


def _pair(tmp_path, seed, *, new_seed=None, new_noise=0.01, **new_kwargs):
    base = write_run(tmp_path / "base", POINTS, seed=seed)
    new = write_run(tmp_path / "new", POINTS, seed=seed if new_seed is None else new_seed, noise=new_noise,
                    **new_kwargs)
    return str(base), str(new)


def test_no_change_passes(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, new_seed=seed + 1)  # other noise draws, same 1% spread
    assert main(["compare", base, new]) == 0
    out = capsys.readouterr().out
    assert "8 compared, 0 regressed, 0 invalid, 0 improved" in out and "REGRESSION" not in out


def test_a_10pct_slowdown_beyond_noise_fails_and_names_the_point(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, slowdown={point_id(SLOW): 1.10})
    assert main(["compare", base, new, "--max-regression", "5%"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("REGRESSION")]
    assert "cp=2" in line and "tokens=4096" in line and "overlap=async" in line and "1.100x" in line
    assert "8 compared, 1 regressed" in out
    # the same slowdown passes under a looser threshold
    assert main(["compare", base, new, "--max-regression", "0.15"]) == 0


def test_a_slowdown_inside_the_noise_band_passes(tmp_path, seed, capsys):
    base = write_run(tmp_path / "base", POINTS, seed=seed, noise=0.2)
    new = write_run(tmp_path / "new", POINTS, seed=seed, noise=0.2, slowdown={point_id(SLOW): 1.10})
    assert main(["compare", str(base), str(new)]) == 0
    assert "within noise" in capsys.readouterr().out


def test_an_improvement_is_reported_not_failed(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, slowdown={point_id(SLOW): 0.8})
    assert main(["compare", base, new]) == 0
    out = capsys.readouterr().out
    assert "IMPROVEMENT:" in out and "0.800x" in out and "1 improved" in out


def test_higher_is_better_metric_regresses_when_it_drops(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, slowdown={point_id(SLOW): 1.10})
    assert main(["compare", base, new, "--metric", "tokens_per_s"]) == 1
    assert "higher is better" in capsys.readouterr().out


def test_a_point_failing_in_the_new_run_fails(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, statuses={5: "error: RuntimeError: boom"})
    assert main(["compare", base, new]) == 1
    assert "failed: error: RuntimeError: boom" in capsys.readouterr().out


def test_json_output_is_github_action_benchmark_custom_format(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed, slowdown={point_id(SLOW): 1.10})
    out = tmp_path / "bench.json"
    main(["compare", base, new, "--json", str(out)])
    entries = json.loads(out.read_text())
    assert len(entries) == len(POINTS)
    assert all(set(e) == {"name", "unit", "value", "range", "extra"} for e in entries)
    assert all(e["unit"] == "ms" and isinstance(e["value"], float) for e in entries)
    assert sum("regression" in e["extra"] for e in entries) == 1


@pytest.mark.parametrize("case", ["axes", "hardware", "metric_unmeasured", "metric_unknown", "kinds", "missing"])
def test_unusable_input_exits_2_with_a_clear_message(tmp_path, seed, capsys, case):
    base = str(write_run(tmp_path / "base", POINTS, seed=seed, profiled=False))
    args = []
    if case == "axes":
        new, message = str(write_run(tmp_path / "new", grid(cp=[1, 2], tokens=[2048]), seed=seed)), "no point"
    elif case == "hardware":
        new, message = str(write_run(tmp_path / "new", POINTS, seed=seed, machine="cpu-2core")), "hardware"
    elif case == "metric_unmeasured":
        new, message = str(write_run(tmp_path / "new", POINTS, seed=seed, profiled=False)), "not measured"
        args = ["--metric", "exposed_comm_ms"]
    elif case == "metric_unknown":
        new, message = base, "--metric"
        args = ["--metric", "speed"]
    elif case == "kinds":
        new, message = str(_bench_json(tmp_path / "b.json", {"t": 1.0}, seed=seed)), "like with like"
    else:
        new, message = str(tmp_path / "nope"), "does not exist"
    assert main(["compare", base, new, *args]) == 2
    assert message in capsys.readouterr().err
    if case == "hardware":
        assert main(["compare", base, new, "--allow-different-hardware"]) == 0


def _bench_json(path, medians_s: dict[str, float], *, seed: int, extra: bool = False, device: str | None = None):
    """A pytest-benchmark JSON file with one benchmark per name (median given, quartiles +-1%)."""
    benchmarks = []
    for name, median in medians_s.items():
        info = {"device": device} if device else {}
        if extra:
            info.update(median_ms=median * 1e3, p20_ms=median * 1e3 * 0.995, p80_ms=median * 1e3 * 1.005)
        benchmarks.append({
            "name": name, "fullname": f"bench/test_x.py::{name}", "extra_info": info,
            "stats": {"median": median, "q1": median * 0.99, "q3": median * 1.01, "mean": median * 1.001,
                      "min": median * 0.98},
        })
    path.write_text(json.dumps({"machine_info": {"cpu": {"brand_raw": "Test CPU"}}, "benchmarks": benchmarks,
                                "seed": seed}))
    return path


@pytest.mark.parametrize("extra", [False, True])
def test_pytest_benchmark_json(tmp_path, seed, capsys, extra):
    base = _bench_json(tmp_path / "base.json", {"a": 0.010, "b": 0.020, "c": 0.030}, seed=seed, extra=extra)
    same = _bench_json(tmp_path / "same.json", {"a": 0.0101, "b": 0.020, "c": 0.0299}, seed=seed, extra=extra)
    slow = _bench_json(tmp_path / "slow.json", {"a": 0.010, "b": 0.023, "c": 0.030}, seed=seed, extra=extra)
    assert main(["compare", str(base), str(same)]) == 0
    out = capsys.readouterr().out
    assert ("extra_info" if extra else "q1..q3") in out
    assert main(["compare", str(base), str(slow)]) == 1
    assert "REGRESSION: bench/test_x.py::b: 1.150x" in capsys.readouterr().out
    other = _bench_json(tmp_path / "gpu.json", {"a": 0.010}, seed=seed, extra=extra, device="NVIDIA H200")
    assert main(["compare", str(base), str(other)]) == 2
    assert main(["compare", str(base), str(slow), "--metric", "tokens_per_s"]) == 2


def test_a_record_file_without_machine_compares_with_itself(tmp_path, seed, capsys):
    path = tmp_path / "profile.jsonl"
    append_record(path, make_record(POINTS[0], {"time_ms_median": 2.0, "time_ms_p20": 1.9, "time_ms_p80": 2.1},
                                    sweep="profile", status="ok", machine=None, git_sha=None))
    assert main(["compare", str(path), str(path)]) == 0


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.05", 0.05), ("12.5 %", 0.125), ("0", 0.0)])
def test_parse_threshold(text, value):
    assert parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["5", "-5%", "five", "5%%"])
def test_parse_threshold_rejects_ambiguous_or_bad_values(text):
    with pytest.raises(ValueError, match="--max-regression"):
        parse_threshold(text)


def test_a_malformed_benchmark_json_exits_2(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"benchmarks": [{"fullname": "x", "extra_info": {}}]}))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 2
    assert "not a pytest-benchmark JSON file (KeyError: 'stats')" in capsys.readouterr().err


def test_points_missing_from_new_fail_only_with_fail_on_missing(tmp_path, seed, capsys):
    base = write_run(tmp_path / "base", POINTS, seed=seed)
    new = write_run(tmp_path / "new", POINTS[:-2], seed=seed)
    assert main(["compare", str(base), str(new)]) == 0
    assert "only in BASELINE (2)" in capsys.readouterr().out
    assert main(["compare", str(base), str(new), "--fail-on-missing"]) == 1
    assert "MISSING: 2 point(s)" in capsys.readouterr().out
