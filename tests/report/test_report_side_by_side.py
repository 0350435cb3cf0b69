"""``report A B``: matched points in columns with compare's verdict, unmatched points with how they differ."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from report_helpers import grid, write_run

from dsv4cp.cli.main import main
from dsv4cp.records import point_id, read_records
from dsv4cp.report import compare, side_by_side
from dsv4cp.report.load import load_runs

SHARED = grid(cp=[1, 2], tokens=[4096, 8192], packing=["histogram"], overlap=["async"])
ONLY_IN_A = grid(cp=[2], tokens=[8192], packing=["histogram"], overlap=["none"])
ONLY_IN_B = grid(cp=[2], tokens=[16384], packing=["histogram"], overlap=["async"])


@pytest.fixture
def two_runs(tmp_path, seed):
    slow, fast = point_id(SHARED[1]), point_id(SHARED[2])
    a = write_run(tmp_path / "a", SHARED + ONLY_IN_A, seed=seed)
    b = write_run(tmp_path / "b", SHARED + ONLY_IN_B, seed=seed, slowdown={slow: 1.4, fast: 0.6})
    return a, b


def test_matched_points_carry_both_times_the_ratio_and_compares_verdict(two_runs):
    a, b = two_runs
    table = side_by_side.comparison(load_runs([a, b]))
    matched = table[table["match"] == side_by_side.MATCHED]
    assert len(matched) == len(SHARED)
    records = {run: {r["point_id"]: r for r in read_records(run)} for run in (a, b)}
    expected = compare.compare(compare.load_side(a, "time_ms_median"), compare.load_side(b, "time_ms_median"),
                               "time_ms_median", threshold=side_by_side.THRESHOLD)
    by_key = dict(zip(expected.table["key"], expected.table["verdict"]))
    for (_, row), point in zip(matched.iterrows(), SHARED):
        key = point_id(point)
        ta, tb = records[a][key]["time_ms_median"], records[b][key]["time_ms_median"]
        assert (row["cp"], row["tokens"]) == (point["cp"], point["tokens"])
        assert row["a_time_ms"] == pytest.approx(ta) and row["b_time_ms"] == pytest.approx(tb)
        assert row["b_over_a"] == pytest.approx(tb / ta)
        assert row["verdict"] == by_key[key]
    assert list(matched["verdict"])[1:3] == ["regression", "improvement"]


def test_unmatched_points_name_how_the_nearest_point_differs(two_runs):
    table = side_by_side.comparison(load_runs(list(two_runs)))
    only_a = table[table["match"] == side_by_side.ONLY_A]
    only_b = table[table["match"] == side_by_side.ONLY_B]
    assert len(only_a) == 1 and only_a["differences"].iloc[0] == "overlap none (A) vs async (B)"
    assert len(only_b) == 1 and "tokens 16384 (B) vs 8192 (A)" in only_b["differences"].iloc[0]
    assert only_a["b_time_ms"].isna().all() and only_b["a_time_ms"].notna().sum() == 0


def test_one_run_has_no_comparison_and_run_differences_are_named(two_runs, tmp_path, seed):
    a, b = two_runs
    assert side_by_side.comparison(load_runs(a)).empty
    other = write_run(tmp_path / "cpu", SHARED, seed=seed, machine="cpu-2core")
    differences = side_by_side.run_differences(load_runs([a, other]))
    assert ("machine", "2xNVIDIA H200", "cpu-2core") in differences
    assert side_by_side.run_differences(load_runs([a, b])) == []


def test_report_of_two_runs_writes_the_comparison_and_its_section(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "ab")]) == 0
    table = pd.read_csv(tmp_path / "ab" / "tables" / "comparison.csv")
    assert set(table["match"]) == {"matched", "only in A", "only in B"}
    summary = (tmp_path / "ab" / "summary.md").read_text()
    assert "## A vs B" in summary and "A = a, B = b" in summary
    assert f"{len(SHARED)} matched points" in summary and "1 regression" in summary


def test_one_point_id_measured_with_other_kernels_is_not_matched():
    # committed runs: the flash C 64K one-document point (id 8dd88e6e6397) before and after defaults changed
    results = Path(__file__).resolve().parents[2] / "results"
    a = results / "2026-12-02-h200-indexer-attention-variants" / "final" / "profile-auto-one"
    b = results / "2026-12-02-h200-layer-defaults" / "layer" / "sweep"
    table = side_by_side.comparison(load_runs([a, b]))
    assert table.loc[table["match"] == side_by_side.MATCHED, "b_over_a"].isna().all()  # nothing paired across kernels
    assert "8dd88e6e6397" in {r["point_id"] for r in read_records(a)} & {r["point_id"] for r in read_records(b)}
    only_a = table[table["match"] == side_by_side.ONLY_A]
    assert len(only_a) == 1 and (only_a["differences"].iloc[0]
                                 == "kernels differ: indexer_loss_kl unknown (A) vs triton (B), indexer_loss_scores "
                                    "recompute (A) vs selection (B), library_compact_slots unknown (A) vs 1 (B), "
                                    "triton_bwd_index_ahead 0 (A) vs 1 (B), triton_dkv_one_product 0 (A) vs 1 (B)")
