"""Emulated-rank records (``dsv4cp profile --emulate-rank``) beside real ones in one run: the report
keeps them apart (``emulated_rank`` is an axis) and never pairs an emulated point with a real one."""

from __future__ import annotations

import math

import numpy as np
from report_helpers import TIME_RATIO_TARGET, grid, point_metrics, write_run

from dsv4cp.records import append_record, make_record
from dsv4cp.report import summary as report_summary
from dsv4cp.report import tables
from dsv4cp.report import targets as report_targets
from dsv4cp.report.load import load_runs


def _emulated_records(run_dir, seed: int) -> None:
    """Both ranks of the target CP = 2 point, each measured alone: its own entry of the lists only."""
    (axes,) = grid(cp=[2], tokens=[65536], overlap=["async"], packing=["histogram"])
    rng = np.random.default_rng(seed)
    for rank in (0, 1):
        metrics = point_metrics(rng, axes, profiled=False)
        for name in ("rank_time_ms_median", "peak_allocated_bytes", "device_used_bytes"):
            metrics[name] = [value if r == rank else None for r, value in enumerate(metrics[name])]
        metrics.update({name: metrics[name] * 0.5 for name in ("time_ms_median", "time_ms_p20", "time_ms_p80")},
                       imbalance_max_over_mean=None)  # the band moves with the median it holds
        record = make_record({**axes, "emulated_rank": rank}, metrics, sweep="profile", status="ok",
                             machine="1xNVIDIA H200", git_sha="0" * 40)
        append_record(run_dir / "records.jsonl", record)


def test_emulated_points_stay_apart_from_real_ones(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[65536], overlap=["async"], packing=["histogram"])
    _emulated_records(tmp_path / "run", seed)  # first: a report that mixed them would pair these
    run = write_run(tmp_path / "run", points, seed=seed, targets=[TIME_RATIO_TARGET])
    df = load_runs(run)
    assert df["emulated_rank"].isna().tolist() == [False, False, True, True]
    assert df["emulated_rank"].tolist()[:2] == [0, 1]
    assert df["point_id"].nunique() == 4

    assert "emulated_rank" in tables.varying_axes(df)
    spread = tables.imbalance(df)
    emulated = spread[spread["emulated_rank"].notna()]
    assert len(emulated) == 2 and emulated["rank_spread_ms"].map(math.isnan).all()
    assert emulated["imbalance_max_over_mean"].map(math.isnan).all()
    real_cp2 = df[(df["cp"] == 2) & df["emulated_rank"].isna()].iloc[0]
    judged = report_targets.evaluate(df)
    paired = judged[judged["verdict"] != report_targets.NOT_APPLICABLE]
    assert paired["point_id"].tolist() == [real_cp2["point_id"]]  # never an emulated point
    alone = judged[judged["verdict"] == report_targets.NOT_APPLICABLE]  # the emulated ones: no emulated CP = 1
    assert len(alone) == 2 and (alone["reason"] == "no measured partner with cp = 1").all()
    target = paired.iloc[0]
    assert target["measured"] == real_cp2["time_ms_median"] / df[df["cp"] == 1].iloc[0]["time_ms_median"]
    tables_by_name = report_summary.all_tables(df)
    for name, table in tables_by_name.items():
        assert isinstance(table, type(df)), name
    text = report_summary.render_summary(df, tables_by_name, {})
    assert "2 point(s) with an `emulated_rank` are **compute only**" in text
