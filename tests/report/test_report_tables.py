"""Report tables, each checked against figures computed here directly from the records."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from report_helpers import GIB, SCALING_POINTS, grid, write_run

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine, estimate
from dsv4cp.model.partition import policy_split
from dsv4cp.records import read_records
from dsv4cp.report import tables
from dsv4cp.report.load import load_runs
from dsv4cp.workloads import packing_lengths


def _by_axes(records: list[dict], **axes) -> dict:
    (match,) = [r for r in records if all(r[k] == v for k, v in axes.items())]
    return match


def test_headline_has_the_point_axes_and_derived_columns(scaling_run):
    df = load_runs(scaling_run)
    table = tables.headline(df)
    assert list(table.columns[:5]) == ["cp", "tokens", "tokens_per_rank", "packing", "overlap"]
    assert len(table) == len(SCALING_POINTS) and table["status"].tolist()[-1] == "oom"
    records = read_records(scaling_run)
    for i in (0, 9, 14):
        r = records[i]
        assert table["peak_gib"][i] == pytest.approx(max(r["peak_allocated_bytes"]) / GIB)
        assert table["time_ms_p20"][i] == r["time_ms_p20"]
        expected_pct = 100 * r["exposed_comm_ms"] / r["comm_ms"] if r["comm_ms"] else math.nan
        assert table["exposed_comm_pct"][i] == pytest.approx(expected_pct, nan_ok=True)
    assert math.isnan(table["time_ms_median"].iloc[-1])  # the OOM point has no time


def test_strong_scaling_efficiency_against_the_cp1_point(scaling_run):
    records = read_records(scaling_run)
    table = tables.scaling(load_runs(scaling_run), "strong")
    # 8 configurations measured at cp 1; the OOM one lacks cp 2 -> 7 pairs
    assert len(table) == 14 and sorted(set(table["cp"])) == [1, 2]
    for row in table[table["cp"] == 2].itertuples():
        one = _by_axes(records, cp=1, tokens=row.tokens, packing=row.packing, overlap=row.overlap)
        two = _by_axes(records, cp=2, tokens=row.tokens, packing=row.packing, overlap=row.overlap)
        assert row.speedup == pytest.approx(one["time_ms_median"] / two["time_ms_median"])
        assert row.efficiency == pytest.approx(one["time_ms_median"] / (2 * two["time_ms_median"]))
    assert tables.scaling(load_runs(scaling_run), "weak").empty  # tokens per rank never repeats across cp


def test_weak_scaling_groups_by_tokens_per_rank(tmp_path, seed):
    points = [p for p in grid(cp=[1, 2], tokens=[4096, 8192]) if p["tokens_per_rank"] == 4096]
    run = write_run(tmp_path / "weak", points, seed=seed)
    records = read_records(run)
    table = tables.scaling(load_runs(run), "weak")
    assert table["cp"].tolist() == [1, 2] and "speedup" not in table
    assert table["efficiency"].iloc[1] == pytest.approx(records[0]["time_ms_median"] / records[1]["time_ms_median"])
    with pytest.raises(ValueError, match="kind"):
        tables.scaling(load_runs(run), "diagonal")


def test_overlap_comparison_pairs_modes(scaling_run):
    records = read_records(scaling_run)
    table = tables.overlap_comparison(load_runs(scaling_run))
    assert len(table) == 7  # 8 configurations, the OOM one measured in one mode only
    row = table[(table["cp"] == 2) & (table["tokens"] == 16384) & (table["packing"] == "one")].iloc[0]
    none = _by_axes(records, cp=2, tokens=16384, packing="one", overlap="none")
    sync = _by_axes(records, cp=2, tokens=16384, packing="one", overlap="async")
    assert row["async_speedup"] == pytest.approx(none["time_ms_median"] / sync["time_ms_median"])
    assert row["exposed_comm_ms[none]"] == pytest.approx(none["exposed_comm_ms"])


def test_phase_breakdown_memory_imbalance_and_bound(scaling_run):
    df = load_runs(scaling_run)
    records = read_records(scaling_run)
    phases = tables.phase_breakdown(df)
    assert len(phases) == sum(len(r["phases"]) for r in records if r["status"] == "ok")
    first = records[0]["phases"][0]
    assert phases["busy_ms"].iloc[0] == pytest.approx(first["compute_ms"] + first["exposed_comm_ms"])

    memory = tables.memory(df)
    assert memory["peak_allocated_gib"].iloc[0] == pytest.approx(max(records[0]["peak_allocated_bytes"]) / GIB)
    imbalance = tables.imbalance(df)
    row = imbalance[(imbalance["cp"] == 2)].iloc[0]
    assert row["imbalance_max_over_mean"] > 1.0 and row["rank_spread_ms"] > 0
    bound = tables.measured_vs_bound(df)
    ratio = bound["time_ms_median"] / bound["bound_ms"]
    assert ratio.tolist() == pytest.approx(bound["measured_over_bound"].tolist())
    assert tables.failures(df)["status"].tolist() == ["oom"]


def test_failures_list_only_a_points_latest_record(tmp_path, seed):
    # a sweep resumed with --retry-errors appends the point again: its first error is superseded
    points = grid(cp=[1, 2], tokens=[4096])
    run = write_run(tmp_path / "run", points, seed=seed, statuses={0: "error: RuntimeError: flaky", 1: "oom"})
    write_run(run, points[:1], seed=seed)  # point 0 measured again, ok; point 1 left as it was
    failed = tables.failures(load_runs(run))
    assert failed["status"].tolist() == ["oom"]


def test_two_runs_are_told_apart_and_tables_are_written(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[1024])
    base = write_run(tmp_path / "base", points, seed=seed)
    df = load_runs([base, write_run(tmp_path / "new", points, seed=seed + 1)])
    assert tables.varying_axes(df)[0] == "run"
    assert tables.point_labels(df, ["run", "cp", "tokens", "tokens_per_rank"]).iloc[0] == "base cp=1 tokens=1024"
    headline = tables.headline(df)
    csv, md = tables.write_table(headline, tmp_path / "out", "headline")
    back = pd.read_csv(csv)
    assert list(back.columns) == list(headline.columns)
    assert back["time_ms_median"].tolist() == pytest.approx(headline["time_ms_median"].tolist())
    text = md.read_text()
    assert text.startswith("| run ") and f"{headline['time_ms_median'].iloc[0]:.4g}" in text
    assert tables.to_markdown(pd.DataFrame()) == "_(empty)_\n"


def test_model_imbalance_is_the_cost_model_on_the_points_packing(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[4096], packing=["histogram", "one"], seed=[seed % 1000])
    table = tables.model_imbalance(load_runs(write_run(tmp_path / "p", points, seed=seed)))
    assert len(table) == 4 and (table[table["cp"] == 1]["model_flops_imbalance"] == 1.0).all()
    row = table[(table["cp"] == 2) & (table["packing"] == "histogram")].iloc[0]
    lengths = packing_lengths("histogram", 4096, cp=2, ratio=4, seed=seed % 1000)
    # the records hold no kernel options: written as before the option, their loss scored its entries again
    expected = estimate(DSv4Config.preset("flash"), 4, lengths, 2, total=4096,
                        selection_scores=False).summary("fwd+bwd")
    assert row["model_flops_imbalance"] == pytest.approx(expected.flops_imbalance)
    assert row["model_flops_imbalance"] > 1.0  # a sampled histogram never splits FLOPs exactly evenly


def test_model_imbalance_of_a_balanced_point_uses_its_balanced_split(tmp_path, seed):
    points = grid(cp=[2], tokens=[16384], packing=["histogram"], partition=["equal", "balanced"],
                  seed=[seed % 1000])
    table = tables.model_imbalance(load_runs(write_run(tmp_path / "p", points, seed=seed)))
    equal, balanced = (table[table["partition"] == p].iloc[0] for p in ("equal", "balanced"))
    cfg = DSv4Config.preset("flash")
    lengths = packing_lengths("histogram", 16384, cp=2, ratio=4, seed=seed % 1000)
    h200 = Machine.preset("h200x2")  # the bound of records that name no bound_machine
    split = policy_split(cfg, 4, lengths, 2, "balanced", h200, total=16384)
    expected = estimate(cfg, 4, lengths, 2, h200, total=16384, split=split, selection_scores=False).summary("fwd+bwd")
    assert balanced["model_time_imbalance"] == pytest.approx(expected.time_imbalance)
    assert balanced["model_time_imbalance"] < equal["model_time_imbalance"]  # what balancing is for


def test_model_imbalance_uses_the_split_a_record_carries(tmp_path, seed):
    """Records carry the split each rank measured; the model is evaluated on it (not on a split recomputed
    from the policy, which a later partitioner may choose differently)."""
    points = grid(cp=[2], tokens=[16384], packing=["histogram"], partition=["balanced"], seed=[seed % 1000])
    df = load_runs(write_run(tmp_path / "p", points, seed=seed))
    recorded = [0, 9000, 16384]
    df["split"] = [recorded]
    row = tables.model_imbalance(df).iloc[0]
    lengths = packing_lengths("histogram", 16384, cp=2, ratio=4, seed=seed % 1000)
    expected = estimate(DSv4Config.preset("flash"), 4, lengths, 2, Machine.preset("h200x2"), total=16384,
                        split=RowSplit(tuple(recorded)), selection_scores=False).summary("fwd+bwd")
    assert row["model_time_imbalance"] == pytest.approx(expected.time_imbalance)
    df["split"] = [[0, 8192, 16384]]  # equal slices recorded: equal slices evaluated
    equal = estimate(DSv4Config.preset("flash"), 4, lengths, 2, Machine.preset("h200x2"),
                     total=16384, selection_scores=False).summary("fwd+bwd")
    assert tables.model_imbalance(df).iloc[0]["model_time_imbalance"] == pytest.approx(equal.time_imbalance)
    assert expected.time_imbalance != pytest.approx(equal.time_imbalance)
