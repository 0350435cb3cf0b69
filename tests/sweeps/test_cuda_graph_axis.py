"""The ``cuda_graph`` axis: spec -> points -> records -> loader, old point ids unchanged, and a point
that cannot be replayed (no CUDA device, an emulated rank, CP > 1) refused before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from dsv4cp.cli.main import main
from dsv4cp.records import COLUMNS, append_record, make_record, point_id, read_records
from dsv4cp.report.load import load_runs
from dsv4cp.report.tables import varying_axes
from dsv4cp.sweeps import measure
from dsv4cp.sweeps.spec import RunOptions, expand, make_point, parse_spec

OLD_ID = "1882ba87eca3"
"""The id of ``make_point({"preset": "tiny", "cp": 2, "tokens": 256})`` under the records.py of
commit 3a2923b, before ``emulated_rank`` and ``cuda_graph`` existed."""


def _spec(**parts) -> dict:
    return {"name": "graphs", "base": {"preset": "tiny", "tokens": 256, **parts.pop("base", {})}, **parts}


def test_the_axis_round_trips_from_spec_to_loader(tmp_path, seed):
    spec = parse_spec(_spec(axes={"cuda_graph": [False, True], "cp": [1, 2]},
                            exclude=[{"cp": 2, "cuda_graph": True}]))
    points = expand(spec)
    assert [(p.cuda_graph, p.cp) for p in points] == [(False, 1), (False, 2), (True, 1)]
    assert points[2].label().endswith(" cuda-graph") and "cuda-graph" not in points[0].label()
    generator = torch.Generator().manual_seed(seed)
    times = (torch.rand(len(points), generator=generator) + 0.5).tolist()
    for point, time_ms in zip(points, times):
        record = make_record(point.axes(), {"time_ms_median": time_ms}, sweep=spec.name, status="ok",
                             machine="cpu", git_sha=None)
        append_record(tmp_path / "run" / "records.jsonl", record)
    records = read_records(tmp_path / "run")
    assert [r["cuda_graph"] for r in records] == [False, False, True]
    assert [r["point_id"] for r in records] == [p.point_id for p in points]
    assert [r["time_ms_median"] for r in records] == times
    df = load_runs(tmp_path / "run")
    assert df["cuda_graph"].tolist() == [False, False, True]
    assert "cuda_graph" in varying_axes(df)


def test_eager_points_keep_the_ids_of_records_written_before_the_axis(tmp_path):
    point = make_point({"preset": "tiny", "cp": 2, "tokens": 256})
    axes = point.axes()
    assert axes["cuda_graph"] is False
    older = {name: value for name, value in axes.items() if name not in ("emulated_rank", "cuda_graph")}
    assert point.point_id == point_id(older) == point_id({**older, "cuda_graph": None}) == OLD_ID
    assert make_point({"preset": "tiny", "cp": 2, "tokens": 256, "cuda_graph": True}).point_id != OLD_ID
    assert point_id({**older, "emulated_rank": 0}) != OLD_ID  # an emulated rank 0 is a value, not "left off"

    # an old line on disk (no cuda_graph column) reads as an eager point with its stored id
    old_line = make_record(older, {"time_ms_median": 2.5}, sweep="old", status="ok", machine="cpu", git_sha=None)
    del old_line["cuda_graph"]
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(old_line) + "\n")
    (record,) = read_records(path)
    assert record["cuda_graph"] is False and record["point_id"] == OLD_ID
    append_record(tmp_path / "again.jsonl", record)  # complete again: every column present
    new = make_record(axes, {}, sweep="new", status="ok", machine="cpu", git_sha=None)
    assert tuple(new) == COLUMNS and new["point_id"] == OLD_ID
    df = load_runs([path, tmp_path / "again.jsonl"])
    assert "cuda_graph" not in varying_axes(df)  # an old run and a new eager one agree on the axis


@pytest.mark.parametrize(("data", "message"), [
    (_spec(axes={"cuda_graph": ["yes"]}), r"axes.cuda_graph\[0\]: must be true or false, got 'yes'"),
    (_spec(base={"cuda_graph": 1}), "base.cuda_graph: must be true or false, got 1"),
    (_spec(axes={"cp": [1]}, exclude=[{"cuda_graph": "no"}]), r"exclude\[0\].cuda_graph: must be true or false"),
])
def test_bad_values_are_refused_when_the_spec_loads(data, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(data)


def test_yaml_spec_lists_the_axis(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("name: g\nbase: {preset: tiny, tokens: 256}\naxes:\n  cuda_graph: [false, true]\n")
    spec = parse_spec(yaml.safe_load(path.read_text()))
    assert [p.cuda_graph for p in expand(spec)] == [False, True]


def test_a_graph_point_on_cpu_is_refused_before_any_work(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the point's inputs were built before the cuda_graph check")

    monkeypatch.setattr(measure, "point_inputs", no_work)
    point = make_point({"preset": "tiny", "tokens": 256, "cuda_graph": True})
    with pytest.raises(ValueError, match="cuda_graph: CUDA-graph replays need a CUDA device, got cpu"):
        measure.measure_point(point, None, torch.device("cpu"), RunOptions())


def test_cp_above_one_and_emulated_ranks_are_not_captured():
    point = make_point({"preset": "tiny", "cp": 2, "tokens": 256, "cuda_graph": True})
    cuda = torch.device("cuda")  # a device name only: the check needs no CUDA runtime
    with pytest.raises(ValueError, match="cuda_graph: only CP = 1 steps are captured, got cp 2"):
        measure.check_cuda_graph(point, cuda)
    emulated = dataclasses.replace(point, emulated_rank=1)  # as profile --emulate-rank builds it
    with pytest.raises(ValueError, match=r"cuda_graph: an emulated rank \(emulated_rank 1\) cannot be captured"):
        measure.check_cuda_graph(emulated, cuda)
    measure.check_cuda_graph(dataclasses.replace(point, cp=1, tokens_per_rank=256), cuda)  # CP = 1 on CUDA: fine
    measure.check_cuda_graph(make_point({"preset": "tiny", "tokens": 256}), torch.device("cpu"))  # eager: no check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_sweep_records_the_graph_point_as_an_error_and_goes_on(tmp_path, capsys):
    spec = tmp_path / "graphs.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "graphs", "run": {"warmup": 0, "reps": 1},
        "base": {"preset": "tiny", "tokens": 64, "dtype": "fp32", "kernel_backend": "torch", "pass": "fwd"},
        "axes": {"cuda_graph": [True, False]},
    }))
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1", "--progress", "off"]) == 1  # a point failed
    graph, eager = read_records(out)
    assert graph["cuda_graph"] is True and graph["status"].startswith("error: ValueError: cuda_graph: ")
    assert "need a CUDA device" in graph["status"] and graph["time_ms_median"] is None
    assert eager["cuda_graph"] is False and eager["status"] == "ok" and eager["time_ms_median"] > 0
    assert "1 ok, 1 failed" in capsys.readouterr().out
