"""``dsv4cp compare`` on synthetic baseline/new pairs: exit 0 (pass), 1 (regression), 2 (unusable)."""

from __future__ import annotations

import json
from pathlib import Path

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


# ------------------------------------------------------------------ broken values, duplicates, identity
def _edit(run_dir, index: int, **changes) -> None:
    """Rewrite record ``index`` of a run with ``changes`` (its point_id kept: the same point, a broken value;
    a change of kernel options is another configuration: its id follows)."""
    path = run_dir / "records.jsonl"
    lines = path.read_text().splitlines()
    record = {**json.loads(lines[index]), **changes}
    if "kernel_options" in changes:
        record["point_id"] = point_id(record)
    lines[index] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def _median_of(run_dir, index: int) -> float:
    return json.loads((run_dir / "records.jsonl").read_text().splitlines()[index])["time_ms_median"]


@pytest.mark.parametrize(("side", "change", "reason"), [
    ("new", {"time_ms_median": float("nan")}, "time_ms_median: a measured time must be a finite number > 0, got NaN"),
    ("new", {"time_ms_median": float("inf")}, "got Infinity"),
    ("new", {"time_ms_median": -1.0}, "got -1.0"),
    ("new", {"time_ms_median": "fast"}, "time_ms_median: must be a number or null, got \"fast\""),
    ("new", {"status": None}, "status: must be 'ok'"),
    ("new", "100x", "time_ms_median: must lie in its band time_ms_p20..time_ms_p80"),
    ("new", {"time_ms_samples": [1.0, 1.1, 1.2]}, "lies outside its samples' range 1.0..1.2"),
    ("baseline", {"time_ms_p20": 1e9}, "time_ms_median: must lie in its band"),
])
def test_a_broken_value_is_an_error_never_noise(tmp_path, seed, capsys, side, change, reason):
    base, new = (Path(p) for p in _pair(tmp_path, seed))
    index = POINTS.index(SLOW)
    run = new if side == "new" else base
    _edit(run, index, **({"time_ms_median": 100 * _median_of(run, index)} if change == "100x" else change))
    for flags in ([], ["--fail-on-missing"], ["--max-regression", "900%"]):
        assert main(["compare", str(base), str(new), *flags]) == 1
        out = capsys.readouterr().out
        (line,) = [ln for ln in out.splitlines() if ln.startswith("INVALID:")]
        assert "cp=2" in line and "tokens=4096" in line and "overlap=async" in line
        assert f"invalid in {side.upper() if side == 'new' else 'BASELINE'}: " in line and reason in line
        assert "7 compared" not in out and "1 invalid" in out and "within noise" not in out


def test_a_broken_benchmark_value_is_an_error(tmp_path, seed, capsys):
    base = _bench_json(tmp_path / "base.json", {"a": 0.010, "b": 0.020}, seed=seed)
    new = _bench_json(tmp_path / "new.json", {"a": float("nan"), "b": 0.020}, seed=seed)
    assert main(["compare", str(base), str(new)]) == 1
    assert "INVALID: bench/test_x.py::a: invalid in NEW: band low: a measured time must be" in capsys.readouterr().out


def test_lines_that_are_no_record_are_named_counted_and_fail_only_with_strict(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed)
    path = Path(new) / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:3], "{not json", "[1, 2]", *lines[3:]]) + "\n")
    assert main(["compare", base, new]) == 0
    out = capsys.readouterr().out
    assert "skipped (not a record of any point) (2): NEW " in out and "records.jsonl:4: not a JSON record" in out
    assert "records.jsonl:5: not a JSON object record (a JSON list)" in out and "2 lines skipped" in out
    assert "8 compared, 0 regressed" in out
    assert main(["compare", base, new, "--strict"]) == 1
    assert "SKIPPED: 2 invalid line(s) (--strict)" in capsys.readouterr().out


def test_two_runs_in_one_directory_are_reported_not_deduplicated(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed)
    write_run(Path(new), POINTS, seed=seed + 1)  # a second sweep appended into the same directory
    assert main(["compare", base, new]) == 1
    out = capsys.readouterr().out
    assert "duplicate (8): NEW " in out and "2 records of one point in one run (statuses ok, ok)" in out
    assert out.count("INVALID:") == 8 and "2 ok records of this point in one run" in out


def test_a_retried_point_keeps_its_ok_record_and_is_reported(tmp_path, seed, capsys):
    base = write_run(tmp_path / "base", POINTS, seed=seed)
    new = write_run(tmp_path / "new", POINTS[5:6], seed=seed, statuses={0: "error: RuntimeError: flaky"})
    write_run(new, POINTS, seed=seed)  # --resume --retry-errors measured it again, then the rest
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    assert "duplicate (1): NEW " in out and "(statuses error: RuntimeError: flaky, ok)" in out
    assert "8 compared, 0 regressed, 0 invalid" in out


def _configure(run_dir, **columns) -> None:
    for index in range(len(POINTS)):
        _edit(run_dir, index, **columns)


def test_points_of_another_kernel_configuration_are_not_comparable(tmp_path, seed, capsys):
    base, new = (Path(p) for p in _pair(tmp_path, seed))
    _configure(base, kernel_options={"topk_impl": "radix", "dq_in_dkv": "0"}, backends=None)
    _configure(new, kernel_options={"topk_impl": "packed", "dq_in_dkv": "0"}, backends=None)
    assert main(["compare", str(base), str(new)]) == 2
    err = capsys.readouterr().err
    assert "none of the 8 matched points is comparable" in err
    assert "configuration differs: kernel_options.topk_impl radix -> packed" in err and "--ignore-option" in err
    for key in ("topk_impl", "kernel_options.topk_impl", "kernel_options"):
        assert main(["compare", str(base), str(new), "--ignore-option", key]) == 0
        out = capsys.readouterr().out
        assert "8 compared" in out and f"configuration differences ignored: {key}" in out
    _edit(new, 2, kernel_options={"topk_impl": "radix", "dq_in_dkv": "0"},
          backends={"sparse_attention.fwd": "triton"})  # one point: same options, a recorded backend
    assert main(["compare", str(base), str(new), "--ignore-option", "topk_impl"]) == 0
    out = capsys.readouterr().out
    assert "NOT COMPARABLE (1): " in out and 'backends unknown -> {"sparse_attention.fwd": "triton"}' in out
    assert "7 compared" in out and "1 not comparable" in out


def test_records_without_samples_are_judged_by_the_labelled_band_rule(tmp_path, seed, capsys):
    base, new = _pair(tmp_path, seed)
    assert main(["compare", base, new]) == 0
    out = capsys.readouterr().out
    assert "U test (0 points)" in out
    assert "FALLBACK bands for 8 points (without repetition times on a side: older records)" in out
    assert sum(" bands " in line and line.rstrip().endswith("same") for line in out.splitlines()) == 8


@pytest.mark.parametrize("metric", ["tflops_per_gpu", "tokens_per_s", "mfu"])
def test_a_nan_value_of_the_compared_metric_is_invalid_never_missing(tmp_path, seed, capsys, metric):
    base, new = (Path(p) for p in _pair(tmp_path, seed))
    _edit(new, POINTS.index(SLOW), **{metric: float("nan")})
    assert main(["compare", str(base), str(new), "--metric", metric]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("INVALID:")]
    assert f"invalid in NEW: {metric}: " in line and "cp=2" in line and "tokens=4096" in line
    assert "1 invalid" in out and "0 missing" in out and "not measured in NEW" not in out
