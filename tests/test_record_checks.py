"""Records and meta.json are checked on every read: a bad line is named ``file:line: reason`` and skipped
(``report``, ``compare``, ``sweep --resume``), never a traceback, whatever the file holds (property-based
tests write random JSON values into every field, and random lines and bytes)."""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dsv4cp.cli.main import main
from dsv4cp.records import (
    COLUMN_TYPES,
    COLUMNS,
    META_FIELDS,
    META_TYPES,
    RECORDS_FILE,
    append_record,
    check_record,
    make_record,
    point_id,
    read_meta,
    read_records,
    write_meta,
)
from dsv4cp.report import load_runs
from dsv4cp.report.tables import all_tables
from dsv4cp.sweeps.runner import recorded_statuses

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "report"))
from report_helpers import SCALING_POINTS, write_run  # noqa: E402


def _record(seed: int, index: int = 0, **metrics) -> dict:
    """A valid ok record of ``SCALING_POINTS[index]`` with random times and their samples."""
    rng = np.random.default_rng(seed + index)
    samples = list(2.0 + rng.random(7))
    p20, median, p80 = np.percentile(samples, [20, 50, 80])
    values = {"time_ms_median": float(median), "time_ms_p20": float(p20), "time_ms_p80": float(p80),
              "time_ms_samples": samples, "tokens_per_s": 1e3 / median, "rank_time_ms_median": [float(median)],
              **metrics}
    return make_record(SCALING_POINTS[index], values, sweep="t", status="ok", machine="cpu-test", git_sha="abc")


def _write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(("changes", "reason"), [
    ({"status": None}, "status: must be 'ok', 'oom'"),
    ({"time_ms_median": "fast"}, 'time_ms_median: must be a number or null, got "fast"'),
    ({"time_ms_median": float("nan")}, "time_ms_median: a measured time must be a finite number > 0, got NaN"),
    ({"time_ms_p80": float("inf")}, "time_ms_p80: a measured time must be a finite number > 0, got Infinity"),
    ({"time_ms_p20": -1.0}, "time_ms_p20: a measured time must be a finite number > 0, got -1.0"),
    ({"time_ms_p20": 1e3}, "time_ms_median: must lie in its band time_ms_p20..time_ms_p80"),
    ({"time_ms_samples": [1.0, 1.5]}, "lies outside its samples' range 1.0..1.5"),
    ({"time_ms_samples": []}, "time_ms_samples: a measured time's samples must not be empty"),
    ({"time_ms_samples": [2.0, None]}, "time_ms_samples: must be a list of numbers or null"),
    ({"cp": 0}, "cp: must be an integer >= 1 or null, got 0"),
    ({"cp": 4}, "point_id: "),
    ({"recompute": "yes"}, "recompute: must be true or false or null"),
    ({"schema": 2}, "schema: expected 1, got 2"),
    ({"kernel_options": ["topk_impl"]}, "kernel_options: must be a JSON object of strings, numbers or flags"),
    ({"tokens": [1, 2]}, "tokens: must be an integer >= 1 or null, got [1, 2]"),
])
def test_a_bad_record_is_skipped_naming_its_file_line_and_field(tmp_path, seed, changes, reason):
    good, bad = _record(seed, 0), {**_record(seed, 1), **changes}
    path = _write_lines(tmp_path / RECORDS_FILE, [json.dumps(good), json.dumps(bad), json.dumps(good)])
    problems = []
    assert read_records(path, problems) == [good, good]
    (problem,) = problems
    assert str(problem).startswith(f"{path}:2: ") and reason in problem.reason
    assert problem.point_id == bad["point_id"]  # compare can tell which point holds the broken value
    with pytest.warns(UserWarning, match=f"skipping {path}:2: "):  # a reader that keeps no list is told too
        read_records(path)
    assert main(["compare", str(path), str(path)]) == 1  # the point holding it is an error, on both sides


def test_every_column_and_meta_field_has_a_type():
    """A column added without a type would hold anything unchecked: add it to COLUMN_TYPES / META_TYPES."""
    assert set(COLUMNS) <= set(COLUMN_TYPES) and set(META_FIELDS) <= set(META_TYPES)


def test_an_ok_record_without_axes_columns_is_skipped(tmp_path, seed):
    record = _record(seed)
    del record["packing"]
    assert check_record(record).startswith("packing: an ok record needs every axis as a column")
    older = {name: value for name, value in _record(seed).items() if name not in ("emulated_rank", "cuda_graph")}
    assert check_record(older) is None  # axes added later are filled in, as before


def test_report_skips_a_bad_line_names_it_and_fails_only_with_strict(tmp_path, seed, capsys):
    run = write_run(tmp_path / "run", SCALING_POINTS, seed=seed)
    lines = (run / RECORDS_FILE).read_text().splitlines()
    broken = {**json.loads(lines[3]), "time_ms_median": float("inf"), "time_ms_p80": float("inf")}
    (run / RECORDS_FILE).write_text("\n".join([*lines[:3], json.dumps(broken), "garbage", *lines[4:]]) + "\n")
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"skipped: {run / RECORDS_FILE}:4: time_ms_median: a measured time must be a finite" in err
    assert f"skipped: {run / RECORDS_FILE}:5: not a JSON record" in err and "2 invalid record line(s) skipped" in err
    summary = (run / "report" / "summary.md").read_text()
    assert "inf" not in summary.replace("info", "")  # the infinite time left no infinite speedup
    assert main(["report", str(run), "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert "--strict: exit 1" in capsys.readouterr().err


def test_resume_measures_a_bad_lines_point_again_and_says_so(tmp_path, seed, capsys):
    good, bad = _record(seed, 0), {**_record(seed, 1), "time_ms_median": -2.0}
    _write_lines(tmp_path / RECORDS_FILE, [json.dumps(good), json.dumps(bad), b"\xff\xfe not utf-8"])
    assert set(recorded_statuses(tmp_path, retry_errors=False)) == {good["point_id"]}
    err = capsys.readouterr().err
    assert f"--resume: skipped {tmp_path / RECORDS_FILE}:2: time_ms_median:" in err
    assert f"{tmp_path / RECORDS_FILE}:3: not UTF-8 text" in err and "2 invalid record line(s) skipped" in err


# ------------------------------------------------------------------------- any content, no traceback
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**20) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
QUICK = settings(max_examples=30, deadline=timedelta(seconds=10), database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _outcome_is_clean(run: Path, capsys) -> None:
    """Every reader either reads the run or refuses it with a clean message: no traceback."""
    problems = []
    try:
        frame = load_runs(run, problems)
    except ValueError as err:
        assert str(err)
    else:
        all_tables(frame)
    for problem in problems:
        assert str(problem).startswith(f"{run / RECORDS_FILE}:")
    assert main(["compare", str(run), str(run)]) in (0, 1, 2)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


@QUICK
@given(field=st.sampled_from(COLUMNS), value=JSON_VALUES, same_point=st.booleans(), data=st.data())
def test_any_json_value_in_any_record_field_gives_a_clean_outcome(tmp_path_factory, capsys, field, value,
                                                                  same_point, data):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    run = tmp_path_factory.mktemp("run")
    write_meta(run, {"machine": "cpu-test"})
    mutated = {**_record(seed, 1), field: value}
    if same_point and isinstance(mutated.get("point_id"), str):  # the axes changed but the id follows them
        mutated["point_id"] = point_id(mutated)
    _write_lines(run / RECORDS_FILE, [json.dumps(_record(seed, 0)), json.dumps(mutated, allow_nan=True)])
    problems = []
    records = read_records(run, problems)
    assert len(records) + len(problems) == 2 and all(check_record(r) is None for r in records)
    _outcome_is_clean(run, capsys)


@QUICK
@given(lines=st.lists(st.binary(max_size=40) | JSON_VALUES.map(lambda v: json.dumps(v).encode()), max_size=4),
       tail=st.binary(max_size=10), data=st.data())
def test_any_lines_or_bytes_give_a_clean_outcome(tmp_path_factory, capsys, lines, tail, data):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    run = tmp_path_factory.mktemp("run")
    write_meta(run, {"machine": "cpu-test"})
    append_record(run / RECORDS_FILE, _record(seed, 0))
    with open(run / RECORDS_FILE, "ab") as handle:
        handle.write(b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines) + tail.replace(b"\n", b" "))
    problems = []
    records = read_records(run, problems)
    assert records[0] == _record(seed, 0) | {"time_utc": records[0]["time_utc"]}
    assert all(problem.line >= 2 for problem in problems)
    _outcome_is_clean(run, capsys)


@QUICK
@given(field=st.sampled_from(META_FIELDS), value=JSON_VALUES, raw=st.none() | st.binary(max_size=30))
def test_any_meta_json_gives_a_clean_outcome(tmp_path_factory, capsys, field, value, raw):
    run = tmp_path_factory.mktemp("run")
    append_record(run / RECORDS_FILE, _record(0))
    if raw is None:
        (run / "meta.json").write_text(json.dumps({"schema": 1, "machine": "cpu-test", field: value}))
    else:
        (run / "meta.json").write_bytes(raw)
    try:
        meta = read_meta(run)
    except ValueError as err:
        assert "meta.json" in str(err)
    else:
        assert isinstance(meta, dict)
    _outcome_is_clean(run, capsys)


def test_finite_checks_are_exact_at_the_edges(seed):
    record = _record(seed)
    samples = record["time_ms_samples"]
    edge = {**record, "time_ms_p20": min(samples), "time_ms_p80": max(samples)}
    assert check_record(edge) is None  # the band may reach the samples' extremes
    assert check_record({**edge, "time_ms_p80": math.nextafter(max(samples), math.inf) * (1 + 1e-6)})
