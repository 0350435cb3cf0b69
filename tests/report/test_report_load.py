"""``load_runs``: the one reader of run directories and record files."""

from __future__ import annotations

import json

import pytest
from report_helpers import SCALING_POINTS, grid, write_run

from dsv4cp.records import COLUMNS, append_record, make_record, read_records
from dsv4cp.report.load import RUN_COLUMNS, load_runs


def test_one_run_dir_gives_one_row_per_record_with_every_column(scaling_run):
    df = load_runs(scaling_run)
    records = read_records(scaling_run)
    assert list(df.columns) == [*COLUMNS, *RUN_COLUMNS]
    assert len(df) == len(records) == len(SCALING_POINTS)
    assert df["point_id"].tolist() == [r["point_id"] for r in records]
    assert df["time_ms_median"].tolist()[:3] == [r["time_ms_median"] for r in records[:3]]
    assert set(df["run"]) == {"scaling"}
    assert set(df["gpu_name"]) == {"NVIDIA H200"}
    assert isinstance(df["phases"].iloc[0], list) and isinstance(df["peak_allocated_bytes"].iloc[0], list)


def test_runs_with_the_same_directory_name_get_distinct_run_names(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[1024])
    a = write_run(tmp_path / "commit_a" / "smoke", points, seed=seed)
    b = write_run(tmp_path / "commit_b" / "smoke", points, seed=seed + 1)
    df = load_runs([a, b])
    assert df["run"].tolist() == ["commit_a/smoke"] * 2 + ["commit_b/smoke"] * 2


def test_bare_jsonl_is_a_run_named_by_its_stem_and_meta_fills_a_missing_machine(tmp_path):
    axes = grid(cp=[1], tokens=[512])[0]
    path = tmp_path / "profile.jsonl"
    append_record(path, make_record(axes, {"time_ms_median": 3.0}, sweep="profile", status="ok",
                                    machine="cpu-2core", git_sha=None))
    df = load_runs([path])
    assert df["run"].tolist() == ["profile"] and df["machine"].tolist() == ["cpu-2core"]

    run_dir = tmp_path / "run"
    append_record(run_dir / "records.jsonl", make_record(axes, {}, sweep="s", status="ok", machine=None,
                                                          git_sha=None))
    (run_dir / "meta.json").write_text(json.dumps({"schema": 1, "machine": "2xNVIDIA H200", "git_sha": "abc"}))
    row = load_runs(run_dir).iloc[0]
    assert (row["machine"], row["git_sha"]) == ("2xNVIDIA H200", "abc")


@pytest.mark.parametrize("case", ["missing", "not_a_run", "wrong_schema", "empty", "other_file", "no_paths"])
def test_unusable_input_raises_a_value_error_naming_it(tmp_path, case):
    if case == "missing":
        paths, match = [tmp_path / "nope"], "does not exist"
    elif case == "not_a_run":
        (tmp_path / "d").mkdir()
        paths, match = [tmp_path / "d"], "without records.jsonl"
    elif case == "wrong_schema":
        (tmp_path / "old.jsonl").write_text(json.dumps({"command": "profile", "timing": {}}) + "\n")
        paths, match = [tmp_path / "old.jsonl"], "schema"
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        paths, match = [tmp_path / "empty.jsonl"], "holds no record"
    elif case == "other_file":
        (tmp_path / "x.csv").write_text("a,b\n")
        paths, match = [tmp_path / "x.csv"], "neither a run directory"
    else:
        paths, match = [], "at least one"
    with pytest.raises(ValueError, match=match):
        load_runs(paths)


def test_load_trace_reads_a_trace_file_or_a_directory_of_ranks(tmp_path):
    from pathlib import Path

    from dsv4cp.report.load import load_trace

    directory = Path(__file__).resolve().parents[1] / "data" / "cpu-smoke-trace"  # 2 gloo ranks' Kineto traces
    kernels, ranges = load_trace(directory)
    assert {k.rank for k in kernels} == {0, 1} and any(k.is_comm for k in kernels)
    assert all(r.name.startswith("dsv4cp.") for r in ranges)
    single_kernels, single_ranges = load_trace(directory / "rank1.json.gz")
    assert {k.rank for k in single_kernels} == {1}  # from the trace's distributedInfo
    assert len(single_kernels) == sum(k.rank == 1 for k in kernels)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "none.json")
