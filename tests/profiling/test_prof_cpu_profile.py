"""A real CPU profile: two gloo ranks, dsv4cp ranges, capture_trace, then the overlap table."""

from __future__ import annotations

import json

import pytest
from prof_helpers import cpu_profile_worker, spawn

from dsv4cp.profiling.nvtx import RANGE_NAMES
from dsv4cp.profiling.overlap import COLUMNS, TOTAL
from dsv4cp.profiling.trace import kineto_overlap_table, read_trace_json


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_profile")
    spawn(cpu_profile_worker, str(root / "store"), str(root / "traces"))
    return root / "traces"


def test_one_trace_per_rank(traces):
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.json", "rank1.json"]
    assert read_trace_json(traces / "rank1.json")["distributedInfo"]["rank"] == 1
    events = json.loads((traces / "rank0.json").read_text())["traceEvents"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == "dsv4cp.step"]
    assert len(steps) == 3  # steps=3 recorded; the warm-up step is discarded


def test_overlap_table_of_a_real_profile(traces):
    df = kineto_overlap_table(traces)
    print(df.to_string(index=False))
    assert list(df.columns) == list(COLUMNS)
    assert set(df["phase"]) <= set(RANGE_NAMES) | {TOTAL}
    for rank in (0, 1):
        phases = df[df["rank"] == rank].set_index("phase")
        assert {"dsv4cp.step", "dsv4cp.compress.fwd", "dsv4cp.allgather.kv.launch", TOTAL} <= set(phases.index)
        assert phases.loc["dsv4cp.allgather.kv.launch", "comm_ms"] > 0
        assert phases.loc["dsv4cp.compress.fwd", "compute_ms"] > 0
        assert phases.loc["dsv4cp.compress.fwd", "comm_ms"] == 0
        assert phases.loc[TOTAL, "comm_ms"] > 0 and phases.loc[TOTAL, "compute_ms"] > 0
