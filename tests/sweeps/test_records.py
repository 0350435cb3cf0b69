"""The record contract: every column, stable point ids, atomic appends, schema checks, meta.json."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4cp import kernel_options, records
from dsv4cp.records import (
    AXES,
    COLUMNS,
    METRICS,
    SCHEMA_VERSION,
    append_record,
    make_record,
    point_id,
    read_meta,
    read_records,
    write_meta,
    writing,
)
from dsv4cp.records.schema import _ADDED_AXES

AXES_OF_A_POINT = {"preset": "tiny", "ratio": 4, "cp": 2, "tokens": 256, "tokens_per_rank": 128, "pass": "fwd"}


def _record(**changes) -> dict:
    axes = {**AXES_OF_A_POINT, **changes}
    return make_record(axes, {"time_ms_median": 1.5, "rank_time_ms_median": [1.2, 1.5]}, sweep="t", status="ok",
                       machine="cpu-2core", git_sha="abc")


def test_make_record_fills_every_column_in_order():
    record = _record()
    assert tuple(record) == COLUMNS
    assert record["schema"] == SCHEMA_VERSION and record["point_id"] == point_id(AXES_OF_A_POINT)
    assert record["time_ms_median"] == 1.5 and record["rank_time_ms_median"] == [1.2, 1.5]
    assert record["bound_ms"] is None and record["loss"] is None
    assert record["time_utc"].endswith("Z")
    assert set(AXES) | set(METRICS) <= set(COLUMNS)


_ID_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.sampled_from(["fwd", "all", "é", ""]),
                       st.sampled_from([{}, {"topk_impl": "stream"}, {"topk_impl": "chunked"}, {"zz": "1"}]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*AXES, "not_an_axis"]), _ID_VALUES))
def test_point_id_is_the_sha1_of_the_sorted_json_it_documents(axes):
    # built from per-axis pieces (what a dry run caches), the id is still the documented hash
    values = {name: axes.get(name) for name in AXES}
    if isinstance(values["kernel_options"], dict):
        values["kernel_options"] = kernel_options.non_default(values["kernel_options"]) or None
    kept = {name: value for name, value in values.items()
            if name not in _ADDED_AXES or not (value is None or value is _ADDED_AXES[name])}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    assert point_id(axes) == hashlib.sha1(text.encode()).hexdigest()[:12]


def test_point_id_depends_on_axis_values_only():
    assert point_id(AXES_OF_A_POINT) == point_id(dict(reversed(AXES_OF_A_POINT.items())))
    assert point_id(AXES_OF_A_POINT) == point_id({**AXES_OF_A_POINT, "not_an_axis": 1})
    assert point_id(AXES_OF_A_POINT) != point_id({**AXES_OF_A_POINT, "cp": 4})
    assert len(point_id({})) == 12 and int(point_id({}), 16) >= 0


@pytest.mark.parametrize("kwargs,message", [
    ({"axes": {"cpu": 2}}, "axes: unknown axis 'cpu'"),
    ({"metrics": {"speed": 1.0}}, "metrics: unknown metric 'speed'"),
    ({"status": "failed"}, "status: must be 'ok', 'oom'"),
    ({"status": "error: two\nlines"}, "status: must be"),
])
def test_make_record_rejects_unknown_names_and_statuses(kwargs, message):
    args = {"axes": {}, "metrics": {}, "status": "ok", **kwargs}
    with pytest.raises(ValueError, match=message):
        make_record(args["axes"], args["metrics"], sweep="t", status=args["status"], machine="m", git_sha=None)


def test_statuses_accepted():
    for status in ("ok", "oom", "error: ValueError: tokens", "skipped: needs cp=8"):
        assert make_record({}, {}, sweep="t", status=status, machine="m", git_sha=None)["status"] == status


def test_append_then_read_round_trips(tmp_path):
    path = tmp_path / "run" / "records.jsonl"  # the folder is created
    first, second = _record(), _record(cp=1, tokens_per_rank=256)
    append_record(path, first)
    append_record(path, second)
    assert read_records(path) == [first, second]
    assert read_records(tmp_path / "run") == [first, second]  # a run directory reads its records.jsonl
    assert read_records(tmp_path / "empty") == []
    with pytest.raises(ValueError, match="missing columns"):
        append_record(path, {"schema": 1})


def test_a_killed_writers_partial_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "records.jsonl"
    append_record(path, _record())
    with open(path, "a") as handle:
        handle.write(json.dumps(_record(cp=1))[:40])  # no newline: the writer died mid-line
    with pytest.warns(UserWarning, match="partial last line"):
        assert len(read_records(path)) == 1


def test_read_skips_other_schemas_and_garbage_naming_the_line(tmp_path):
    path, good = tmp_path / "records.jsonl", _record()
    path.write_text(json.dumps({**good, "schema": 99}) + "\nnot json\n" + json.dumps(good) + "\n")
    problems = []
    assert read_records(path, problems) == [good]
    assert str(problems[0]).endswith("records.jsonl:1: schema: expected 1, got 99")
    assert "records.jsonl:2: not a JSON record" in str(problems[1]) and len(problems) == 2


def test_append_is_one_write_call(tmp_path, monkeypatch):
    calls = []
    real_write = writing.os.write
    monkeypatch.setattr(writing.os, "write", lambda fd, data: calls.append(data) or real_write(fd, data))
    append_record(tmp_path / "records.jsonl", _record())
    assert len(calls) == 1 and calls[0].endswith(b"\n") and calls[0].count(b"\n") == 1


def test_meta_round_trip_and_checks(tmp_path):
    write_meta(tmp_path, {"git_sha": "abc", "machine": "cpu-2core", "spec": {"name": "t"}})
    meta = read_meta(tmp_path)
    assert meta["schema"] == SCHEMA_VERSION and meta["git_sha"] == "abc" and meta["spec"] == {"name": "t"}
    assert set(meta) == set(records.META_FIELDS)
    with pytest.raises(ValueError, match="meta: unknown fields"):
        write_meta(tmp_path, {"colour": "red"})
    with pytest.raises(ValueError, match="has no meta.json"):
        read_meta(tmp_path / "nothing")


def test_drop_partial_line_lets_appends_continue_cleanly(tmp_path):
    path = tmp_path / "records.jsonl"
    append_record(path, _record())
    assert not records.drop_partial_line(path)
    with open(path, "a") as handle:
        handle.write('{"schema": 1, "point_')
    with pytest.warns(UserWarning, match="dropping a partial last line"):
        assert records.drop_partial_line(path)
    append_record(path, _record(cp=1))
    assert [r["cp"] for r in read_records(path)] == [2, 1]
