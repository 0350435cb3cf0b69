"""Cost growth with context and the per-phase roofline, against numbers worked from the records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from report_helpers import grid, write_run

from dsv4cp.model import Machine
from dsv4cp.records import read_records
from dsv4cp.report import growth, plots, roofline, tables
from dsv4cp.report.load import load_runs

GROWTH_POINTS = grid(cp=[1, 2], tokens=[4096, 8192, 32768])


def test_per_doubling_is_the_growth_rate_per_size_doubling():
    assert growth.per_doubling(4.0, 2.0) == pytest.approx(4.0)
    assert growth.per_doubling(8.0, 4.0) == pytest.approx(math.sqrt(8.0))  # two doublings
    assert growth.per_doubling(2.0 ** 1.5, 2.0 ** 0.5) == pytest.approx(8.0)
    for cost, size in ((0.0, 2.0), (2.0, 1.0), (math.inf, 2.0), (-1.0, 2.0)):
        assert math.isnan(growth.per_doubling(cost, size))


def test_cost_growth_rows_follow_the_records(tmp_path, seed):
    run = write_run(tmp_path / "growth", GROWTH_POINTS, seed=seed, noise=0.05)
    table = growth.cost_growth(load_runs(run))
    records = {(r["cp"], r["tokens"]): r for r in read_records(run)}
    assert len(table) == len(GROWTH_POINTS)
    for cp in (1, 2):
        series = table[table["cp"] == cp].sort_values("tokens")
        tokens = series["tokens"].to_numpy()
        times = np.array([records[(cp, int(n))]["time_ms_median"] for n in tokens])
        bounds = np.array([records[(cp, int(n))]["bound_ms"] for n in tokens])
        expected = np.exp2(np.log2(times[1:] / times[:-1]) / np.log2(tokens[1:] / tokens[:-1]))
        assert series["time_growth_per_doubling"].iloc[1:].to_numpy() == pytest.approx(expected, rel=1e-12)
        expected_bound = np.exp2(np.log2(bounds[1:] / bounds[:-1]) / np.log2(tokens[1:] / tokens[:-1]))
        assert series["bound_growth_per_doubling"].iloc[1:].to_numpy() == pytest.approx(expected_bound, rel=1e-12)
        assert math.isnan(series["time_growth_per_doubling"].iloc[0])
        assert series["measured_over_bound"].to_numpy() == pytest.approx(times / bounds)
        t1 = np.array([records[(1, int(n))]["time_ms_median"] for n in tokens])
        assert series["parallel_efficiency"].to_numpy() == pytest.approx(t1 / (cp * times))
    strong = tables.scaling(load_runs(run), "strong")
    two = table[table["cp"] == 2].sort_values("tokens")["parallel_efficiency"].to_numpy()
    assert two == pytest.approx(strong[strong["cp"] == 2].sort_values("tokens")["efficiency"].to_numpy())


def test_cost_growth_needs_two_sizes_and_prints_the_growth_on_the_plot(tmp_path, seed):
    single = load_runs(write_run(tmp_path / "one", grid(cp=[1, 2], tokens=[4096]), seed=seed))
    assert growth.cost_growth(single).empty and plots.cost_growth(single).figure is None
    assert "two or more token counts" in plots.cost_growth(single).note
    assert growth.summary_lines(growth.cost_growth(single)) == []
    df = load_runs(write_run(tmp_path / "growth", GROWTH_POINTS, seed=seed, noise=0.05))
    table = growth.cost_growth(df)
    left = plots.cost_growth(df).figure.axes[0]
    printed = sorted(t.get_text() for t in left.texts)
    assert printed == sorted(f"x{g:.2f}" for g in table["time_growth_per_doubling"].dropna())
    lines = growth.summary_lines(table)
    assert lines[0] == "## Cost growth with context" and sum(line.startswith("- ") for line in lines) == 2


def _profiled_point(tmp_path, seed, machine="2xNVIDIA H200"):
    points = grid(cp=[2], tokens=[8192], packing=["histogram"])
    return load_runs(write_run(tmp_path / machine.replace(" ", "_"), points, seed=seed, machine=machine))


def test_roofline_rows_are_model_work_over_measured_time(tmp_path, seed):
    df = _profiled_point(tmp_path, seed)
    table = roofline.roofline(df)
    point = tables.ok_points(df).iloc[0]
    model = tables.point_estimate(point, roofline.GPU_MACHINE).table()
    measured = {r["phase"]: r["compute_ms"] for r in point["phases"]}
    # the synthetic profile times q_proj.fwd, sparse_attn.fwd and .bwd on rank 0 (and an all-gather: no FLOPs)
    assert sorted(zip(table["phase"], table["direction"])) == [("q_proj", "fwd"), ("sparse_attn", "bwd"),
                                                                ("sparse_attn", "fwd")]
    for row in table.itertuples(index=False):
        mine = model[(model["rank"] == 0) & (model["phase"] == row.phase) & (model["direction"] == row.direction)]
        flops, hbm = float(mine["flops"].iloc[0]), float(mine["hbm_bytes"].iloc[0])
        ms = measured[f"dsv4cp.{row.phase}.{row.direction}"]
        assert row.achieved_tflops == pytest.approx(flops / (ms / 1e3) / 1e12)
        assert row.intensity_flop_per_byte == pytest.approx(flops / hbm)
        machine = Machine.preset("h200x2")
        roof = min(machine.peak_flops, flops / hbm * machine.hbm_bandwidth)
        assert row.roof_tflops == pytest.approx(roof / 1e12)
        assert row.fraction_of_roof == pytest.approx(flops / (ms / 1e3) / roof)
    fig = plots.roofline(df).figure
    assert fig is not None
    drawn = sorted(float(y) for c in fig.axes[0].collections for y in c.get_offsets()[:, 1])
    assert drawn == pytest.approx(sorted(table["achieved_tflops"]))


def test_the_roofline_pairs_the_indexer_ranges_with_the_work_they_time(tmp_path, seed):
    """Each range timed at a random 1-3x the bound of the work it runs (the top-k: the model's scoring +
    selection; the loss's share split between its scores' range, most of it, and its own): the top-k row
    carries the scoring's FLOPs, the loss rows their scores' time, and no row beats its roof."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    df = _profiled_point(tmp_path, seed)
    point = tables.ok_points(df).iloc[0]
    model = tables.point_estimate(point, roofline.GPU_MACHINE).table()
    model = model.set_index(["rank", "phase", "direction"]).sort_index()
    rows, template = [], {"comm_ms": 0.0, "overlap_ms": 0.0, "exposed_comm_ms": 0.0, "idle_ms": 0.0}
    measured: dict[tuple[int, str], float] = {}
    for rank in (0, 1):
        bound_ms = model.loc[rank, "time_lower_bound_s"] * 1e3
        selection_ms = bound_ms[("indexer.score", "fwd")] + bound_ms[("indexer.topk", "fwd")]
        measured[(rank, "indexer.topk.fwd")] = rng.uniform(1, 3) * selection_ms
        for direction in ("fwd", "bwd"):
            loss_ms = rng.uniform(1, 3) * bound_ms[("indexer.loss", direction)]
            scores = rng.uniform(0.9, 0.99)
            measured[(rank, f"indexer.score.{direction}")] = scores * loss_ms
            measured[(rank, f"indexer.loss.{direction}")] = (1 - scores) * loss_ms
        rows += [{**template, "rank": r, "phase": f"dsv4cp.{name}", "compute_ms": ms}
                 for (r, name), ms in measured.items() if r == rank]
    df.at[df.index[0], "phases"] = rows
    table = roofline.roofline(df).set_index(["rank", "phase", "direction"])
    assert sorted({p for _, p, _ in table.index}) == ["indexer.loss", "indexer.topk"]
    for rank in (0, 1):
        topk = table.loc[(rank, "indexer.topk", "fwd")]
        selection = [(rank, "indexer.score", "fwd"), (rank, "indexer.topk", "fwd")]
        assert topk["flops"] == pytest.approx(sum(model.loc[k, "flops"] for k in selection), rel=1e-12)
        assert topk["hbm_bytes"] == pytest.approx(sum(model.loc[k, "hbm_bytes"] for k in selection), rel=1e-12)
        assert topk["flops"] > 0 and topk["measured_ms"] == pytest.approx(measured[(rank, "indexer.topk.fwd")])
        for direction in ("fwd", "bwd"):
            loss = table.loc[(rank, "indexer.loss", direction)]
            assert loss["flops"] == pytest.approx(model.loc[(rank, "indexer.loss", direction), "flops"], rel=1e-12)
            assert loss["measured_ms"] == pytest.approx(
                measured[(rank, f"indexer.score.{direction}")] + measured[(rank, f"indexer.loss.{direction}")])
    assert (table["fraction_of_roof"] <= 1 + 1e-9).all(), table["fraction_of_roof"]


def test_roofline_of_a_cpu_run_has_no_roof_and_no_plot(tmp_path, seed):
    df = _profiled_point(tmp_path, seed, machine="cpu-2core")
    table = roofline.roofline(df)
    assert len(table) == 3 and table["roof_tflops"].isna().all() and table["achieved_tflops"].gt(0).all()
    skipped = plots.roofline(df)
    assert skipped.figure is None and "CPU" in skipped.note


def test_roof_is_the_lower_of_compute_and_bandwidth():
    machine = Machine(peak_flops=100.0, hbm_bandwidth=10.0)
    assert roofline.roof_flops(machine, np.array([1.0, 10.0, 20.0])).tolist() == [10.0, 100.0, 100.0]
