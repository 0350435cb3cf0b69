"""The report on inputs a user really hands it: runs where no point measured, the same run given twice,
duplicated record lines and values no measurement can hold."""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from report_helpers import GIB, SCALING_POINTS, grid, write_run

from dsv4cp.cli.main import main
from dsv4cp.report import load_runs
from dsv4cp.report.tables import headline, imbalance
from dsv4cp.report.targets import INVALID, evaluate


def test_a_run_where_no_point_measured_still_gets_a_report_that_says_what_failed(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[1024, 4096])
    statuses = {0: "oom", 1: "error: RuntimeError: the kernel failed", 2: "oom", 3: "skipped: needs a GPU"}
    run = write_run(tmp_path / "failed", points, seed=seed, statuses=statuses)
    assert main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert "**No point measured**: all 4 points did not measure (2 oom, 1 error, 1 skipped)" in summary
    failures = pd.read_csv(run / "report" / "tables" / "failures.csv")
    assert sorted(failures["status"]) == sorted(statuses.values())
    for name in ("strong_scaling", "memory_vs_tokens", "imbalance_per_packing", "roofline"):
        assert f"- {name}: skipped" in summary, name


def test_a_partly_failed_run_counts_its_failed_points_in_the_headline(tmp_path, seed):
    run = write_run(tmp_path / "scaling", SCALING_POINTS, seed=seed, statuses={0: "oom"})
    assert main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert f"1 of {len(SCALING_POINTS)} points did not measure (1 oom)" in summary


def test_the_same_run_given_twice_is_refused_naming_both(tmp_path, seed, capsys, monkeypatch):
    run = write_run(tmp_path / "runs" / "x", grid(cp=[1, 2], tokens=[1024]), seed=seed)
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for pair in (["runs/x", "runs/x"], ["runs/x", "./runs/x/"], ["runs/x", "runs/x/records.jsonl"],
                 ["runs/x", str(copy)]):
        assert main(["report", *pair, "--out", str(tmp_path / "out")]) == 2, pair
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "give each run once" in err and "runs/x" in err, err
    assert not (tmp_path / "out").exists()


def test_a_duplicated_record_line_counts_once_and_is_named(tmp_path, seed, capsys):
    run = write_run(tmp_path / "run", grid(cp=[1, 2], tokens=[1024, 4096]), seed=seed)
    lines = (run / "records.jsonl").read_text().splitlines()
    (run / "records.jsonl").write_text("\n".join([*lines, lines[1], lines[1]]) + "\n")
    problems: list = []
    frame = load_runs([run], problems)
    assert len(frame) == len(lines) and frame["point_id"].is_unique
    assert [str(p) for p in problems] == [
        f"{run / 'records.jsonl'}:{n}: a duplicate of line 2 (the same record twice): counted once"
        for n in (len(lines) + 1, len(lines) + 2)]
    assert main(["report", str(run), "--strict"]) == 1
    assert "2 invalid record line(s) skipped" in capsys.readouterr().err
    headline = pd.read_csv(run / "report" / "tables" / "headline.csv")
    assert len(headline) == len(lines)


IMPOSSIBLE = {
    "imbalance_max_over_mean": st.one_of(st.floats(max_value=0.999), st.just(math.nan), st.just(math.inf)),
    "mfu": st.one_of(st.floats(min_value=1.001, allow_infinity=False), st.floats(max_value=-1e-6),
                     st.just(math.nan)),
    "tflops_per_gpu": st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(-math.inf)),
    "peak_allocated_bytes": st.integers(max_value=-1).map(lambda v: [v, 5 * GIB]),
    "measured_over_bound": st.one_of(st.floats(max_value=0.0), st.just(math.nan)),
}
TARGET_OF = {"imbalance_max_over_mean": "imbalance", "mfu": "mfu", "tflops_per_gpu": "tflops_per_gpu",
             "peak_allocated_bytes": "peak_gib", "measured_over_bound": "measured_over_bound"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_impossible_value_is_never_shown_or_met(tmp_path_factory, seed, data):
    """Any metric holding a value no measurement can (drawn at random) is blanked, named with its
    reason, and judged ``invalid`` by a target that any value would meet, never ``met``."""
    metric = data.draw(st.sampled_from(sorted(IMPOSSIBLE)))
    value = data.draw(IMPOSSIBLE[metric])
    comparison = data.draw(st.sampled_from(["<=", ">=", "<", ">", "=="]))
    target = {"name": "any", "metric": TARGET_OF[metric], "comparison": comparison, "value": 1.0}
    run = write_run(tmp_path_factory.mktemp("run"), grid(cp=[2], tokens=[1024]), seed=seed, targets=[target])
    record = json.loads((run / "records.jsonl").read_text())
    record[metric] = value
    (run / "records.jsonl").write_text(json.dumps(record) + "\n")
    frame = load_runs([run])
    assert frame.loc[0, metric] is None and metric in frame.loc[0, "invalid"]
    judged = evaluate(frame)
    assert judged["verdict"].tolist() == [INVALID] and metric in judged.loc[0, "reason"]
    shown = headline(frame)
    assert metric in shown.loc[0, "invalid"]
    column = {"peak_allocated_bytes": "peak_gib"}.get(metric, metric)
    assert (shown if column in shown else imbalance(frame))[column].isna().all()


def test_records_are_strict_json_and_old_files_with_nan_still_load(tmp_path, seed):
    run = write_run(tmp_path / "run", grid(cp=[2], tokens=[1024]), seed=seed)  # its phases hold a NaN overlap ratio
    text = (run / "records.jsonl").read_text()
    record = json.loads(text, parse_constant=lambda name: pytest.fail(f"a bare {name} in records.jsonl"))
    assert any(row["overlap_ratio"] is None for row in record["phases"])
    old = json.loads(text)
    old["phases"][0]["overlap_ratio"] = math.nan
    (run / "records.jsonl").write_text(json.dumps(old) + "\n")
    assert "NaN" in (run / "records.jsonl").read_text()
    frame = load_runs([run], problems := [])
    assert not problems and len(frame) == 1 and math.isnan(frame.loc[0, "phases"][0]["overlap_ratio"])


def test_a_cpu_run_says_cp_above_one_is_expected_to_be_slower(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[1024])
    cpu = write_run(tmp_path / "cpu", points, seed=seed, machine="cpu-2core")
    gpu = write_run(tmp_path / "gpu", points, seed=seed)
    for run in (cpu, gpu):
        assert main(["report", str(run)]) == 0
    note = "**On a CPU machine (cpu-2core), CP > 1 is expected to be slower than CP = 1**"
    assert note in (cpu / "report" / "summary.md").read_text()
    assert "On a CPU machine" not in (gpu / "report" / "summary.md").read_text()
