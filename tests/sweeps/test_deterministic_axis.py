"""The ``deterministic`` and ``compile`` axes: old point ids do not change, values are checked, a
deterministic point runs in the mode with deterministic backends, and the report prices determinism."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from dsv4cp.ops.determinism import deterministic_backend
from dsv4cp.records import make_record, point_id
from dsv4cp.report import tables
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import RunOptions, make_point
from report.report_helpers import BASE_AXES, point_metrics


def test_default_values_keep_earlier_point_ids():
    axes = {**BASE_AXES, "cp": 1, "tokens": 256, "tokens_per_rank": 256}
    plain = point_id(axes)
    assert point_id({**axes, "deterministic": False, "compile": None}) == plain
    assert point_id({**axes, "deterministic": True}) != plain
    assert point_id({**axes, "compile": "inductor"}) != plain


def test_axis_values_are_checked():
    with pytest.raises(ValueError, match="^deterministic"):
        make_point({"tokens": 64, "deterministic": "yes"})
    with pytest.raises(ValueError, match="^compile: must be null"):
        make_point({"tokens": 64, "compile": "tvm"})
    point = make_point({"tokens": 64, "deterministic": True, "compile": "aot_eager"})
    assert "deterministic" in point.label() and "compile aot_eager" in point.label()


def test_deterministic_backend_choice_on_cpu():
    assert deterministic_backend("auto", torch.device("cpu")) == "torch"
    assert deterministic_backend("torch", torch.device("cpu")) == "torch"


def test_deterministic_point_runs_in_the_mode(monkeypatch):
    seen = []
    from dsv4cp.harness import time

    original = time.build_step

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(time, "build_step", spy)
    point = make_point({"tokens": 64, "ratio": 0, "deterministic": True})
    result = measure_point(point, None, torch.device("cpu"), RunOptions(warmup=0, reps=1))
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()
    assert result.resolved_backends == {"sparse_attention": "torch"}
    assert result.metrics["compile_s"] is None and result.metrics["graph_breaks"] is None


def test_compiled_point_times_the_compiling_step_apart():
    point = make_point({"tokens": 64, "ratio": 0, "compile": "eager"})
    result = measure_point(point, None, torch.device("cpu"), RunOptions(warmup=0, reps=1))
    assert result.metrics["compile_s"] > 0 and result.metrics["graph_breaks"] >= 0


def test_determinism_cost_table_pairs_the_modes():
    rng = np.random.default_rng(3)
    records = []
    for deterministic, slowdown in ((False, 1.0), (True, 1.5)):
        axes = {**BASE_AXES, "cp": 2, "tokens": 65536, "tokens_per_rank": 32768, "packing": "one",
                "overlap": "async", "deterministic": deterministic}
        metrics = point_metrics(rng, axes, slowdown=slowdown, noise=0.0, profiled=False)
        records.append(make_record(axes, metrics, sweep="s", status="ok", machine="m", git_sha="0" * 40,
                                   resolved_backends={"sparse_attention": "triton-deterministic" if deterministic
                                                      else "flashmla+cudnn"}))
    df = pd.DataFrame(records).assign(run="r")
    cost = tables.determinism_cost(df)
    assert len(cost) == 1
    row = cost.iloc[0]
    assert row["time_ratio"] == pytest.approx(1.5)
    assert row["backend[deterministic]"] == "triton-deterministic" and row["backend[default]"] == "flashmla+cudnn"
    assert tables.determinism_lines(cost)[2].startswith("Deterministic / default over 1 configuration(s): time x1.50")
    assert tables.determinism_lines(tables.determinism_cost(df.iloc[:1])) == []


def test_compile_cost_table_pairs_each_compiled_point_with_eager():
    rng = np.random.default_rng(5)
    print("seed 5")
    records = []
    for compile_backend, slowdown, compile_s, breaks in ((None, 1.0, None, None), ("inductor", 1.25, 80.5, 5),
                                                         ("aot_eager", 0.8, 12.0, 0)):
        axes = {**BASE_AXES, "cp": 1, "tokens": 65536, "tokens_per_rank": 65536, "packing": "one",
                "overlap": "async", "compile": compile_backend}
        metrics = point_metrics(rng, axes, slowdown=slowdown, noise=0.0, profiled=False)
        metrics.update(compile_s=compile_s, graph_breaks=breaks)
        records.append(make_record(axes, metrics, sweep="s", status="ok", machine="m", git_sha="0" * 40))
    lone = {**BASE_AXES, "cp": 1, "tokens": 16384, "tokens_per_rank": 16384, "packing": "one", "overlap": "async",
            "compile": "inductor"}  # compiled with no eager point of its configuration: not in the table
    records.append(make_record(lone, point_metrics(rng, lone, noise=0.0, profiled=False) | {"compile_s": 1.0,
                               "graph_breaks": 0}, sweep="s", status="ok", machine="m", git_sha="0" * 40))
    df = pd.DataFrame(records).assign(run="r")
    cost = tables.compile_cost(df)
    assert list(cost["compile"]) == ["inductor", "aot_eager"]
    assert cost["time_ratio"].tolist() == pytest.approx([1.25, 0.8])
    assert cost["compile_s"].tolist() == [80.5, 12.0] and cost["graph_breaks"].tolist() == [5, 0]
    lines = tables.compile_lines(cost)
    assert lines[2].startswith("- `inductor`: step x1.25 of eager") and "80.5 s, 5 graph break(s)" in lines[2]
    assert tables.compile_lines(tables.compile_cost(df.iloc[:1])) == []
