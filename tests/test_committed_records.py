"""Every committed result still loads: a kernel option's default may change, and the records written
before keep their ids (:data:`dsv4cp.kernel_options.FORMER_DEFAULTS`); a real id mismatch is still caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4cp import kernel_options
from dsv4cp.records import before_the_physical_bound, check_record, read_records
from dsv4cp.report.load import load_runs

RESULTS = Path(__file__).resolve().parents[1] / "results"
BEFORE_THE_SCHEMA = {"2026-11-30-h200x2-norm-rope", "2026-11-30-h200x2-layer-64k",
                     "2026-11-30-h200x2-loss-target-kernels"}
"""Runs written before records carried a schema version: read by nothing, kept as they were measured."""


def test_every_committed_record_is_valid():
    files = sorted(RESULTS.rglob("records.jsonl"))
    assert len(files) > 20
    for path in files:
        problems = []
        records = read_records(path, problems)
        if path.parent.name in BEFORE_THE_SCHEMA:
            assert not records and all("schema" in p.reason for p in problems), path
            continue
        assert not problems, f"{path}: {problems[0]}"


def test_an_old_default_is_read_as_unset_and_a_wrong_id_is_still_caught():
    line = next(line for path in sorted(RESULTS.rglob("records.jsonl"))
                for line in path.read_text().splitlines()
                if '"triton_dkv_one_product": "0"' in line and '"status": "ok"' in line)
    record = json.loads(line)
    former = kernel_options.FORMER_DEFAULTS["triton_dkv_one_product"]
    assert record["kernel_options"]["triton_dkv_one_product"] in former
    assert check_record(record) is None
    assert "is not the id" in check_record({**record, "point_id": "0" * 12})
    assert "is not the id" in check_record({**record, "tokens": record["tokens"] * 2})


def test_configurations_drop_each_former_default_in_turn():
    option = kernel_options.OPTIONS["triton_dkv_one_product"]
    default = option.text(option.default)
    values = {**kernel_options.resolved(), "triton_dkv_one_product": "0", "triton_bwd_index_ahead": "0",
              "topk_impl": "stream"}
    assert default != "0"
    found = kernel_options.configurations(values)
    assert found[0] == {"topk_impl": "stream", "triton_bwd_index_ahead": "0", "triton_dkv_one_product": "0"}
    assert sorted(map(sorted, (c.items() for c in found))) == sorted(map(sorted, (c.items() for c in [
        {"topk_impl": "stream", "triton_bwd_index_ahead": "0", "triton_dkv_one_product": "0"},
        {"topk_impl": "stream", "triton_dkv_one_product": "0"},
        {"topk_impl": "stream", "triton_bwd_index_ahead": "0"},
        {"topk_impl": "stream"}])))
    assert kernel_options.configurations(kernel_options.resolved()) == [{}]


def test_a_record_from_before_the_physical_bound_keeps_its_bound_as_the_measured_ceilings_one():
    run = RESULTS / "2026-12-02-h200-layer-defaults" / "layer" / "sweep"
    stored = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    read = read_records(run)
    assert len(read) == len(stored) > 0
    for raw, record in zip(stored, read):
        assert before_the_physical_bound(raw) and raw["bound_ms"] > 0
        assert record["bound_measured_ms"] == raw["bound_ms"] and record["bound_ms"] is None
        assert record["measured_over_measured_bound"] == raw["measured_over_bound"]
        assert record["measured_over_bound"] is None
    with pytest.warns(UserWarning, match=f"{len(read)} record\\(s\\) written before the bound at the physical limits"):
        frame = load_runs(run)
    assert frame["bound_ms"].isna().all() and (frame["bound_measured_ms"] > 0).all()
