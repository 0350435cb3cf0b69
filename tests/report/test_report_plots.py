"""Report plots: drawn from the tables' numbers, captioned with the hardware, skipped with a note."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from report_helpers import grid, write_run

from dsv4cp.profiling.overlap import KernelRecord, RangeRecord, overlap_table
from dsv4cp.report import plots, tables
from dsv4cp.report.load import load_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _caption(plot: plots.Plot) -> str:
    return plot.figure._supxlabel.get_text()


def test_every_plot_of_a_strong_scaling_run_is_drawn_and_saved(scaling_run, tmp_path):
    drawn = plots.all_plots(load_runs(scaling_run))
    skipped = {name: p.note for name, p in drawn.items() if p.figure is None}
    assert list(skipped) == ["weak_scaling"] and "tokens per rank" in skipped["weak_scaling"]
    for name, plot in drawn.items():
        if plot.figure is not None:
            assert "2xNVIDIA H200" in _caption(plot), name
            path = plot.save(tmp_path / f"{name}.png")
            assert path.read_bytes()[:8] == PNG_MAGIC
    assert drawn["weak_scaling"].save(tmp_path / "weak.png") is None


def test_strong_scaling_lines_are_the_table_speedups_with_the_ideal(scaling_run):
    df = load_runs(scaling_run)
    table = tables.scaling(df, "strong")
    ax = plots.strong_scaling(df).figure.axes[0]
    *lines, ideal = ax.get_lines()
    assert ideal.get_label().startswith("ideal") and list(ideal.get_ydata()) == [1, 2]
    plotted = sorted(float(y) for line in lines for y in line.get_ydata())
    assert plotted == pytest.approx(sorted(table["speedup"]))


def test_weak_scaling_and_memory_from_a_weak_run(tmp_path, seed):
    points = [p for p in grid(cp=[1, 2], tokens=[4096, 8192, 16384]) if p["tokens_per_rank"] in (4096, 8192)]
    df = load_runs(write_run(tmp_path / "weak", points, seed=seed, machine="cpu-2core"))
    weak = plots.weak_scaling(df)
    assert weak.figure is not None and "cpu-2core" in _caption(weak)
    efficiencies = sorted(float(y) for line in weak.figure.axes[0].get_lines()[:-1] for y in line.get_ydata())
    assert efficiencies == pytest.approx(sorted(tables.scaling(df, "weak")["efficiency"]))
    memory_ax = plots.memory_vs_tokens(df).figure.axes[0]
    assert memory_ax.get_ylabel() == "peak RSS per rank (GiB)"  # a cpu-2core run measures the host RSS


def test_a_single_unprofiled_point_skips_with_notes(tmp_path, seed):
    df = load_runs(write_run(tmp_path / "one", grid(cp=[1], tokens=[512]), seed=seed, profiled=False))
    drawn = plots.all_plots(df)
    drawn_names = [name for name, p in drawn.items() if p.figure is not None]
    assert drawn_names == ["measured_vs_bound"]
    assert all(p.note for p in drawn.values() if p.figure is None)
    assert "--profile" in drawn["phase_times"].note


def _synthetic_trace(seed: int) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Two ranks: a step range holding a compute phase and a communication phase, with random lengths."""
    rng = np.random.default_rng(seed)
    kernels, ranges = [], []
    for rank in (0, 1):
        t = int(rng.integers(0, 1000))
        compute = int(rng.integers(5_000, 10_000))
        comm = int(rng.integers(2_000, 4_000))
        ranges += [RangeRecord(rank, "dsv4cp.step", t, t + compute + comm + 100),
                   RangeRecord(rank, "dsv4cp.q_proj.fwd", t, t + compute),
                   RangeRecord(rank, "dsv4cp.allgather.kv.launch", t + 10, t + 20)]
        kernels += [KernelRecord(rank, 7, t + 5, t + compute, "gemm", False, launch_ns=t + 1),
                    KernelRecord(rank, 9, t + 30, t + 30 + comm, "ncclAllGather", True, launch_ns=t + 15)]
    return kernels, ranges


def test_phase_timeline_and_trace_overlap(seed):
    kernels, ranges = _synthetic_trace(seed)
    timeline = plots.phase_timeline(kernels, ranges, title="t")
    ax = timeline.figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][:3] == ["rank 0 ranges", "rank 0 compute", "rank 0 comm"]
    assert len(ax.collections) == 2 * (3 + 2)  # per rank: 3 range bars, a compute lane, a comm lane
    table = overlap_table(kernels, ranges)
    bars = plots.trace_overlap(table).figure.axes[0].patches
    comm_rows = table[(table["comm_ms"] > 0) & (table["phase"] != "total")]
    widths = [p.get_width() for p in bars]
    assert widths == pytest.approx([*comm_rows["overlap_ms"], *comm_rows["exposed_comm_ms"]])
    assert plots.phase_timeline([], []).figure is None
    assert plots.trace_overlap(pd.DataFrame({"rank": [0], "phase": ["total"], "comm_ms": [0.0],
                                             "overlap_ms": [0.0], "exposed_comm_ms": [0.0]})).figure is None


def test_plots_display_in_notebooks(scaling_run):
    drawn = plots.strong_scaling(load_runs(scaling_run))
    assert drawn._repr_png_()[:8] == PNG_MAGIC and drawn._repr_markdown_() is None
    skipped = plots.weak_scaling(load_runs(scaling_run))
    assert skipped._repr_png_() is None and skipped.note in skipped._repr_markdown_()
