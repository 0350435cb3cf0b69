"""The ``kernel_options`` axis: old records keep their ids, spec values are checked and spelled one way,
command-line values merge under a point's own, records carry every option's value and what ran, and
a point's options hold while it is measured (and only then)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import kernel_options
from dsv4cp.records import make_record, point_id
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import RunOptions, expand, make_point, parse_spec, with_kernel_options

BASE = {"preset": "tiny", "tokens": 32}


def spec_with(axes=None, base=None):
    return parse_spec({"name": "k", "base": {**BASE, **(base or {})}, "axes": axes or {}})


def test_records_without_the_axis_keep_their_ids():
    axes = make_point(BASE).axes()
    assert axes["kernel_options"] is None
    old = {name: value for name, value in axes.items() if name != "kernel_options"}  # a record from before
    assert point_id(old) == point_id(axes)
    assert point_id({**axes, "kernel_options": {"topk_impl": "stream"}}) != point_id(axes)


def test_axis_of_mappings_gives_one_point_each_spelled_one_way():
    values = [{"topk_impl": "stream"}, {"triton_dq_in_dkv": 0, "topk_impl": "chunked"}]
    points = expand(spec_with({"kernel_options": values}))
    assert [p.kernel_options for p in points] == [{"topk_impl": "stream"},
                                                  {"topk_impl": "chunked", "triton_dq_in_dkv": "0"}]
    assert len({p.point_id for p in points}) == 2
    assert "topk_impl=stream" in points[0].label()
    same = [make_point({**BASE, "kernel_options": {"triton_dq_in_dkv": v}}).point_id for v in (0, "0", False)]
    assert len(set(same)) == 1
    assert make_point({**BASE, "kernel_options": {}}).point_id == make_point(BASE).point_id


@pytest.mark.parametrize("data,message", [
    ({"axes": {"kernel_options": [{"topk_impl": "stream"}, {"topk_impl": "fast"}]}},
     r"^axes\.kernel_options\[1\]: topk_impl: must be one of 'chunked', 'stream', got 'fast'"),
    ({"base": {"kernel_options": "topk_impl=stream"}}, r"^base\.kernel_options: must be a mapping"),
    ({"base": {"kernel_options": {"nope": 1}}}, r"^base\.kernel_options: kernel option: unknown name 'nope'"),
])
def test_bad_spec_values_name_where(data, message):
    with pytest.raises(ValueError, match=message):
        parse_spec({"name": "k", "base": {**BASE, **data.get("base", {})}, "axes": data.get("axes", {})})


def test_command_line_values_merge_under_the_points_own():
    cli = {"topk_impl": "stream", "topk_keys": "scores"}
    based = expand(with_kernel_options(spec_with(base={"kernel_options": {"topk_keys": "packed"}}), cli))
    assert [p.kernel_options for p in based] == [{"topk_impl": "stream", "topk_keys": "packed"}]
    axis = expand(with_kernel_options(spec_with({"kernel_options": [{"topk_impl": "chunked"}, None]}), cli))
    assert [p.kernel_options for p in axis] == [{"topk_impl": "chunked", "topk_keys": "scores"}, cli]
    plain = spec_with()
    assert with_kernel_options(plain, {}) is plain


def test_record_columns_hold_every_value_and_what_ran():
    point = make_point({**BASE, "kernel_options": {"topk_impl": "stream"}})
    with kernel_options.overrides(point.kernel_options):
        resolved = kernel_options.resolved()
    record = make_record(point.axes(), {}, sweep="s", status="ok", machine="cpu", git_sha=None,
                         kernel_options=resolved, backends={"indexer_topk": "torch"})
    assert record["point_id"] == point.point_id  # the id keeps what the point set
    assert record["kernel_options"] == resolved and record["kernel_options"]["topk_impl"] == "stream"
    assert record["backends"] == {"indexer_topk": "torch"}
    bare = make_record(make_point(BASE).axes(), {}, sweep="s", status="ok", machine="cpu", git_sha=None)
    assert bare["kernel_options"] is None and bare["backends"] is None


def test_a_points_options_hold_while_it_is_measured_only(monkeypatch):
    monkeypatch.delenv("DSV4CP_TOPK_IMPL", raising=False)
    point = make_point({**BASE, "pass": "fwd", "kernel_options": {"topk_impl": "stream"}})
    measurement = measure_point(point, None, torch.device("cpu"), RunOptions(warmup=0, reps=1))
    assert measurement.kernel_options["topk_impl"] == "stream" and kernel_options.get("topk_impl") == "chunked"
    assert measurement.backends["sparse_attention.fwd"] == "torch"
    assert "sparse_attention.bwd" not in measurement.backends  # a forward-only point
    assert measurement.backends["indexer_topk"] == "torch"  # CPU tensors stay on the torch references


def test_a_skipped_point_records_the_options_it_would_run(tmp_path, capsys):
    import json

    from dsv4cp.cli.main import main

    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\nbase: {preset: tiny, tokens: 64, cp: 2, kernel_options: {topk_keys: scores}}\n")
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1"]) == 0
    record = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert record["status"] == "skipped: needs cp=2" and record["backends"] is None
    assert record["kernel_options"] == {**kernel_options.resolved(), "topk_keys": "scores"}
