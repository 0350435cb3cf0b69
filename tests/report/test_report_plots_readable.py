"""Readable report plots: every series told apart by colour and marker, no legend over an axes area
or the title, integer cp ticks, device-neutral wording, every phase named."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer
from matplotlib.lines import Line2D
from report_helpers import grid, write_run

from dsv4cp.report import plots, styles
from dsv4cp.report.load import load_runs

MANY_POINTS = grid(cp=[1, 2], tokens=[4096, 8192], seed=list(range(5)), packing=["histogram", "one"],
                   overlap=["none", "async"])
"""Five seeds x two packings x two overlaps: 40 strong-scaling series (tokens x config) and 40
memory series (cp x config)."""


@pytest.fixture
def many_series(tmp_path, seed):
    return load_runs(write_run(tmp_path / "many", MANY_POINTS, seed=seed))


def _series_key(handle) -> tuple:
    """(colour, marker) of a legend handle: a line's marker name, a scatter's marker path."""
    if isinstance(handle, Line2D):
        return to_hex(handle.get_color()), handle.get_marker()
    if isinstance(handle, PathCollection):
        return to_hex(handle.get_facecolor()[0]), handle.get_paths()[0].vertices.round(3).tobytes()
    patch = handle.patches[0] if isinstance(handle, BarContainer) else handle
    return to_hex(patch.get_facecolor()), None  # a bar or patch: its colour alone


def _legends(fig):
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]


def test_forty_series_plots_keep_legends_off_the_axes_and_series_apart(many_series):
    drawn = plots.all_plots(many_series)
    assert plots.strong_scaling(many_series).figure is not None
    counted = {}
    for name, plot in drawn.items():
        if plot.figure is None:
            continue
        fig = plot.figure
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)  # the layout engine places the legend and axes during a draw
        areas = [ax.get_window_extent(renderer) for ax in fig.axes]
        title = fig._suptitle.get_window_extent(renderer)
        for legend in _legends(fig):
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(area) for area in areas), f"{name}: legend over an axes"
            assert not box.overlaps(title), f"{name}: legend over the title"
        for ax in fig.axes:
            handles, labels = ax.get_legend_handles_labels()
            keys = [_series_key(h) for h in handles]
            assert len(set(keys)) == len(keys), f"{name}: two series share colour and marker"
            colours = [h.get_color() for h in handles if hasattr(h, "get_color")]
            assert len(set(map(str, colours))) == len(colours), f"{name}: two series share a colour"
            counted[name] = len(handles)
    assert counted["strong_scaling"] == 40 + 1  # and the ideal line
    assert counted["memory_vs_tokens"] == 40


def test_cp_axes_are_integer_ranks(many_series):
    ax = plots.strong_scaling(many_series).figure.axes[0]
    assert ax.get_xlabel() == styles.CP_AXIS_LABEL == "CP degree (ranks)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
    bound_fig = plots.measured_vs_bound(many_series).figure
    assert [t.get_text() for t in bound_fig.legends[0].get_texts()][:2] == ["cp=1", "cp=2"]


def test_series_styles_give_forty_series_their_own_colour_and_no_pair_repeats_before_360():
    assert len({styles.series_style(i).color for i in range(40)}) == 40
    pairs = [(styles.series_style(i).color, styles.series_style(i).marker) for i in range(360)]
    assert len(set(pairs)) == 360
    first = [styles.series_style(i) for i in range(9)]
    assert len({s.color for s in first}) == 9 and len({s.marker for s in first}) == 9
    assert styles.series_style(360).linestyle != styles.series_style(0).linestyle
    with pytest.raises(ValueError, match="index"):
        styles.series_style(-1)
    assert styles.cp_label(2.0) == "cp=2" and styles.cp_label("x") == "cp=x"


@pytest.mark.parametrize(("range_name", "phase"), [
    ("dsv4cp.indexer.score.fwd", "indexer.loss"), ("dsv4cp.indexer.topk.fwd", "indexer.topk"),
    ("dsv4cp.indexer.loss.bwd", "indexer.loss"), ("dsv4cp.reducescatter.index_k.launch", "allgather.index_k"),
    ("dsv4cp.kv_rebuild.bwd", "kv_rebuild.bwd"), ("dsv4cp.step", plots.OUTSIDE_PHASES),
])
def test_phase_categories_follow_the_cost_model(range_name, phase):
    assert plots.phase_category(range_name) == phase


def test_phase_plot_names_every_indexer_phase(tmp_path, seed):
    df = load_runs(write_run(tmp_path / "c", grid(cp=[2], tokens=[4096]), seed=seed))
    rows = df.loc[0, "phases"]
    extra = ["dsv4cp.indexer.score.fwd", "dsv4cp.indexer.topk.fwd", "dsv4cp.indexer.loss.fwd",
             "dsv4cp.indexer.loss.bwd", "dsv4cp.indexer.compress.fwd", "dsv4cp.indexer.q_proj.fwd",
             "dsv4cp.q_proj.bwd", "dsv4cp.kv_proj.fwd", "dsv4cp.kv_proj.bwd", "dsv4cp.out_proj.fwd",
             "dsv4cp.out_proj.bwd", "dsv4cp.compress.fwd"]
    template = next(r for r in rows if r["phase"] == "dsv4cp.q_proj.fwd")
    df.at[0, "phases"] = [*rows, *({**template, "phase": name, "compute_ms": 0.5 + i} for i, name in enumerate(extra))]
    fig = plots.phase_times(df).figure
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    for phase in ("indexer.topk", "indexer.loss", "indexer.compress", "indexer.q_proj"):
        assert phase in labels
    # the model's indexer.score is the top-k's scoring, timed inside indexer.topk: no bar of its own
    assert "indexer.score" not in labels
    assert "other" not in labels and len(labels) == len(set(labels))
    bars = {patch.get_facecolor() for patch in fig.axes[0].patches}
    assert len(bars) == len(labels)  # one colour per phase
    loss_bar = [p for p in fig.axes[0].containers if p.get_label() == "indexer.loss"][0]
    assert loss_bar.patches[0].get_width() == pytest.approx(0.5 + 2 + 0.5 + 3 + 0.5)  # fwd + bwd + its scores
