"""Report plots: pure functions from the records DataFrame (or a trace's records) to matplotlib Figures.

Every function returns a :class:`Plot`: the figure, or ``None`` with a note saying what the runs lack
(a run without a CP = 1 point has no scaling plot; an unprofiled run no phase plots). Figures are built
with the object-oriented API (no pyplot state), so they render headless; each names its units and the
runs' hardware (``machine``, GPU) in a caption.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dsv4cp.model import PHASES, measured_phase
from dsv4cp.profiling.overlap import TOTAL, KernelRecord, RangeRecord
from dsv4cp.report import growth, tables
from dsv4cp.report import roofline as roofline_module
from dsv4cp.report.styles import CP_AXIS_LABEL, area_color, cp_label, outside_legend, series_style

OUTSIDE_PHASES = "outside phases (step)"
"""Phase plot category of the kernels whose innermost range is the step itself."""


@dataclass(frozen=True)
class Plot:
    """A drawn figure, or ``figure=None`` and ``note`` saying why it was skipped."""

    figure: Figure | None
    note: str = ""

    def save(self, path: str | Path) -> Path | None:
        """Write the figure as PNG (parent created); None when skipped."""
        if self.figure is None:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.figure.savefig(path, dpi=120, bbox_inches="tight")
        return path

    def _repr_png_(self) -> bytes | None:
        """The figure in a notebook (IPython's display protocol)."""
        if self.figure is None:
            return None
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return buffer.getvalue()

    def _repr_markdown_(self) -> str | None:
        """Why the plot was skipped, in a notebook."""
        return None if self.figure is not None else f"*skipped: {self.note}*"


def _figure(title: str, caption: str, width: float = 7.0, height: float = 4.5) -> tuple[Figure, Axes]:
    """A one-axes figure with ``title`` above (the figure's, from its left edge, so an outside legend
    in the right margin never reaches it) and ``caption`` (hardware, notes) below."""
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.subplots()
    fig.suptitle(title, x=0.01, horizontalalignment="left")
    fig.supxlabel(caption, fontsize=8, color="dimgray")
    return fig, ax


def _config_labels(table: pd.DataFrame, exclude: Iterable[str]) -> pd.Series:
    """Label of each row's configuration: its run and axes that vary in ``table``, but ``exclude``."""
    exclude = set(exclude)
    axes = [a for a in tables.varying_axes(table) if a not in exclude]
    if not axes:
        return pd.Series(["all points"] * len(table), index=table.index)
    return tables.point_labels(table, axes)


def _caption(df: pd.DataFrame, extra: str = "") -> str:
    return f"hardware: {tables.hardware(df)}" + (f"; {extra}" if extra else "")


def _cp_axis(ax: Axes, cps: Iterable[object]) -> None:
    """x axis of CP degrees: one integer tick per measured cp, device-neutral wording."""
    cps = sorted({int(c) for c in cps})
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel(CP_AXIS_LABEL)


def phase_category(range_name: str) -> str:
    """The phase a ``dsv4cp.*`` range times, named as the cost model names it (forward, backward,
    launch and wait of one phase together: ``dsv4cp.reducescatter.kv.wait`` -> ``allgather.kv``; the loss's
    scores with the loss: ``dsv4cp.indexer.score.bwd`` -> ``indexer.loss``, as
    :func:`dsv4cp.model.measured_phase` pairs them, since the model's ``indexer.score`` is the top-k's
    scoring, timed in ``indexer.topk``); a range the model has no phase for keeps its own name, the step
    itself is :data:`OUTSIDE_PHASES`."""
    if range_name.removeprefix("dsv4cp.") == "step":
        return OUTSIDE_PHASES
    mapped = measured_phase(range_name)
    return mapped[0] if mapped is not None else range_name.removeprefix("dsv4cp.")


# ------------------------------------------------------------------------------------------ scaling
def strong_scaling(df: pd.DataFrame) -> Plot:
    """Speedup T(1)/T(cp) against cp at fixed total tokens, one line per configuration, with the ideal."""
    table = tables.scaling(df, "strong")
    if table.empty:
        return Plot(None, "strong scaling: no configuration measured at CP = 1 and another CP with the same tokens")
    fig, ax = _figure("Strong scaling (fixed total tokens)", _caption(df, "speedup = T(1) / T(cp), median step time"))
    labels = _config_labels(table, ["cp", "tokens_per_rank"])
    for i, (label, group) in enumerate(table.groupby(labels, sort=False)):
        ax.plot(group["cp"], group["speedup"], label=label, **series_style(i).kwargs())
    cps = np.array(sorted(table["cp"].unique()))
    ax.plot(cps, cps, linestyle="--", color="black", label="ideal (speedup = cp)")
    _cp_axis(ax, cps)
    ax.set_ylabel("speedup over CP = 1 (x)")
    outside_legend(fig, ax)
    return Plot(fig)


def weak_scaling(df: pd.DataFrame) -> Plot:
    """Efficiency T(1)/T(cp) against cp at fixed tokens per rank, with the ideal (1.0)."""
    table = tables.scaling(df, "weak")
    if table.empty:
        return Plot(None, "weak scaling: no configuration measured at CP = 1 and another CP "
                          "with the same tokens per rank")
    fig, ax = _figure("Weak scaling (fixed tokens per rank)",
                      _caption(df, "efficiency = T(1) / T(cp), median step time"))
    labels = _config_labels(table, ["cp", "tokens"])
    for i, (label, group) in enumerate(table.groupby(labels, sort=False)):
        ax.plot(group["cp"], group["efficiency"], label=label, **series_style(i).kwargs())
    cps = np.array(sorted(table["cp"].unique()))
    ax.axhline(1.0, linestyle="--", color="black", label="ideal (efficiency = 1)")
    _cp_axis(ax, cps)
    ax.set_ylabel("weak-scaling efficiency")
    ax.set_ylim(bottom=0)
    outside_legend(fig, ax)
    return Plot(fig)


# ------------------------------------------------------------------------------------------ phases
def phase_times(df: pd.DataFrame) -> Plot:
    """Stacked per-phase busy time (compute + exposed comm, rank 0) per profiled point, ordered by cp.
    Every phase is drawn by name (the cost model's phases, forward and backward summed, in the order
    a forward pass runs them; then ranges the model has no phase for)."""
    table = tables.phase_breakdown(df)
    table = table[(table["phase"] != TOTAL) & (table["rank"] == 0)]
    if table.empty:
        return Plot(None, "phase times: no profiled point (run the sweep with --profile)")
    table = table.assign(point=_config_labels(table, ["rank"]), category=table["phase"].map(phase_category))
    order = table.drop_duplicates("point").sort_values([a for a in ("run", "cp") if a in table])["point"]
    wide = table.pivot_table(index="point", columns="category", values="busy_ms", aggfunc="sum").reindex(order)
    model_order = [p for p in PHASES if p in wide.columns]
    others = sorted(c for c in wide.columns if c not in PHASES and c != OUTSIDE_PHASES)
    wide = wide[model_order + others + ([OUTSIDE_PHASES] if OUTSIDE_PHASES in wide.columns else [])]
    fig, ax = _figure("Where the step time goes (rank 0)",
                      _caption(df, "busy = compute + exposed communication; forward + backward per phase"),
                      width=4.0 + 0.06 * max(map(len, wide.index)), height=1.5 + 0.4 * len(wide))
    left = np.zeros(len(wide))
    for i, phase in enumerate(wide.columns):
        values = wide[phase].fillna(0.0).to_numpy()
        color = "lightgray" if phase == OUTSIDE_PHASES else area_color(i)
        ax.barh(wide.index, values, left=left, label=str(phase), color=color)
        left += values
    ax.set_xlabel("time per step (ms)")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    outside_legend(fig, ax, fontsize=6, title="phase")
    return Plot(fig)


def overlap_per_phase(df: pd.DataFrame) -> Plot:
    """Overlap ratio (hidden / total communication) of each communicating phase of each profiled
    point, as a heat map (points x phases; blank: the phase did not communicate)."""
    table = tables.phase_breakdown(df)
    table = table[(table["comm_ms"] > 0) & (table["phase"] != TOTAL) & (table["rank"] == 0)]
    if table.empty:
        return Plot(None, "overlap per phase: no profiled point with communication (profile a CP > 1 point)")
    table = table.assign(point=_config_labels(table, ["rank"]))
    wide = table.pivot_table(index="point", columns="phase", values="overlap_ratio", aggfunc="mean", sort=False)
    fig, ax = _figure("Communication hidden behind compute, per phase (rank 0)",
                      _caption(df, "overlap ratio = overlapped comm / comm time; blank: no communication"),
                      width=3.0 + 0.6 * len(wide.columns) + 0.07 * max(map(len, wide.index)),
                      height=2.5 + 0.3 * len(wide))
    image = ax.imshow(wide.to_numpy(dtype=float), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(wide.columns)), [p.removeprefix("dsv4cp.") for p in wide.columns],
                  rotation=40, ha="right", fontsize=7)
    ax.set_yticks(range(len(wide)), wide.index, fontsize=7)
    fig.colorbar(image, ax=ax, label="overlap ratio")
    return Plot(fig)


# ------------------------------------------------------------------------------------------ memory, bound, packing
def memory_vs_tokens(df: pd.DataFrame) -> Plot:
    """Peak memory (max over ranks) against total tokens, one line per cp/configuration: the CUDA
    allocator's peak on GPU, the process's peak RSS on CPU (the axis says which)."""
    table = tables.memory(df)
    table = table.assign(peak_gib=table["peak_allocated_gib"].fillna(table["peak_rss_gib"])).dropna(
        subset=["peak_gib"])
    if table.empty or table["tokens"].nunique() < 2:
        return Plot(None, "memory vs tokens: needs measured peak memory at two or more token counts")
    labels = _config_labels(table, ["tokens", "tokens_per_rank"])
    table = table[labels.map(table.groupby(labels)["tokens"].nunique()) >= 2]  # a line needs two sizes
    if table.empty:
        return Plot(None, "memory vs tokens: no configuration measured at two or more token counts")
    gpu, cpu = table["peak_allocated_gib"].notna().any(), table["peak_rss_gib"].notna().any()
    kind = ("peak allocated (CUDA allocator) on GPU, peak RSS (host process) on CPU" if gpu and cpu
            else "peak allocated (CUDA allocator)" if gpu else "peak RSS of the host process")
    fig, ax = _figure("Peak memory per rank", _caption(df, f"max over ranks of {kind}; configurations "
                                                         "measured at two or more token counts"))
    labels = _config_labels(table, ["tokens", "tokens_per_rank"])
    for i, (label, group) in enumerate(table.sort_values("tokens").groupby(labels, sort=False)):
        ax.plot(group["tokens"], group["peak_gib"], label=label, **series_style(i).kwargs())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total tokens")
    ax.set_ylabel("peak memory per rank (GiB)" if gpu and cpu
                  else "peak allocated per rank (GiB)" if gpu else "peak RSS per rank (GiB)")
    outside_legend(fig, ax)
    return Plot(fig)


def measured_vs_bound(df: pd.DataFrame) -> Plot:
    """Measured median time against the cost model's two lower bounds (log-log), with the bound line:
    filled markers at the physical limits (``bound_ms``), hollow ones at the measured ceilings
    (``bound_measured_ms``; a record from before the physical bound has only these)."""
    table = tables.measured_vs_bound(df)
    bounds = ("bound_ms", "bound_measured_ms")
    shown = {column: table.dropna(subset=["time_ms_median", column]) for column in bounds}
    if all(part.empty for part in shown.values()):
        return Plot(None, "measured vs bound: no point with a model bound")
    fig, ax = _figure("Measured step time vs the cost model's bounds",
                      _caption(df, "median step time; filled: bound at the physical limits (spec sheet), hollow: "
                                   "at the measured ceilings"))
    labelled = next(column for column in bounds if not shown[column].empty)  # one legend entry per cp
    for j, column in enumerate(bounds):  # the caption says which markers are which bound
        for i, (cp, group) in enumerate(shown[column].groupby("cp")):
            style = series_style(i)
            ax.scatter(group[column], group["time_ms_median"], marker=style.marker,
                       label=cp_label(cp) if column == labelled else "_nolegend_",
                       **({"color": style.color} if j == 0 else {"facecolors": "none", "edgecolors": style.color}))
    values = pd.concat([shown[column][name] for column in bounds for name in ("time_ms_median", column)])
    low, high = values.min(), values.max()
    ax.plot([low, high], [low, high], linestyle="--", color="black", label="measured = bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model bound (ms)")
    ax.set_ylabel("measured (ms)")
    outside_legend(fig, ax)
    return Plot(fig)


def imbalance_per_packing(df: pd.DataFrame) -> Plot:
    """Per-rank time imbalance (max / mean of the rank medians) of every point, by packing and cp."""
    table = tables.imbalance(df)
    table = table[table["cp"] > 1].dropna(subset=["imbalance_max_over_mean"])
    if table.empty:
        return Plot(None, "imbalance per packing: no CP > 1 point with per-rank times")
    fig, ax = _figure("Load imbalance by packing", _caption(df, "each dot: one point; 1.0 = perfectly balanced"))
    packings = list(dict.fromkeys(table["packing"]))
    cps = sorted(table["cp"].unique())
    for j, cp in enumerate(cps):
        group = table[table["cp"] == cp]
        x = group["packing"].map(packings.index) + (j - (len(cps) - 1) / 2) * 0.15
        style = series_style(j)
        ax.scatter(x, group["imbalance_max_over_mean"], label=cp_label(cp), color=style.color, marker=style.marker)
    ax.axhline(1.0, linestyle="--", color="black", linewidth=0.8)
    ax.set_xticks(range(len(packings)), packings)
    ax.set_xlabel("packing")
    ax.set_ylabel("max / mean of per-rank times")
    outside_legend(fig, ax)
    return Plot(fig)


def cost_growth(df: pd.DataFrame) -> Plot:
    """Step time and its bound against tokens per cp (log-log, growth per doubling printed) and
    parallel efficiency against cp (:mod:`dsv4cp.report.growth`)."""
    fig = growth.cost_growth_figure(df, _caption(df, "median step time; bound: the cost model's, with overlap"))
    if fig is None:
        return Plot(None, "cost growth: no configuration measured at two or more token counts at one cp")
    return Plot(fig)


def roofline(df: pd.DataFrame) -> Plot:
    """Each compute phase's achieved FLOP/s against its intensity under the roofs
    (:mod:`dsv4cp.report.roofline`)."""
    machine = roofline_module.GPU_MACHINE
    fig = roofline_module.roofline_figure(df, _caption(df, f"roofs: {machine.name} ceilings "
                                                           f"({machine.peak_flops / 1e12:.0f} TFLOP/s, "
                                                           f"{machine.hbm_bandwidth / 1e12:.2f} TB/s); every rank "
                                                           "of every profiled point"))
    if fig is None:
        return Plot(None, "roofline: no profiled GPU point (a CPU run records no ceilings; profile with --profile)")
    return Plot(fig)


def all_plots(df: pd.DataFrame) -> dict[str, Plot]:
    """Every report plot by file stem."""
    return {
        "strong_scaling": strong_scaling(df),
        "weak_scaling": weak_scaling(df),
        "phase_times": phase_times(df),
        "overlap_per_phase": overlap_per_phase(df),
        "memory_vs_tokens": memory_vs_tokens(df),
        "measured_vs_bound": measured_vs_bound(df),
        "imbalance_per_packing": imbalance_per_packing(df),
        "cost_growth": cost_growth(df),
        "roofline": roofline(df),
    }


# ------------------------------------------------------------------------------------------ traces
def phase_timeline(kernels: list[KernelRecord], ranges: list[RangeRecord], *, title: str = "Phase timeline",
                   caption: str = "") -> Plot:
    """Per rank, three lanes on one time axis (ms from the first event): the ``dsv4cp.*`` ranges
    (host; one colour per phase, nested ranges drawn thinner), compute kernels and communication
    kernels (device). Input: the records of ``dsv4cp.profiling.trace.load_kineto_dir``."""
    if not kernels and not ranges:
        return Plot(None, "phase timeline: the trace has no kernel and no dsv4cp range")
    origin = min([k.start_ns for k in kernels] + [r.start_ns for r in ranges])
    ranks = sorted({k.rank for k in kernels} | {r.rank for r in ranges})
    phases = list(dict.fromkeys(r.name for r in sorted(ranges, key=lambda r: r.start_ns)))
    colors = {name: area_color(i) for i, name in enumerate(phases)}
    fig, ax = _figure(title, caption or "lanes per rank: host ranges (launch side), compute kernels, "
                      "communication kernels (device)", width=11.0, height=max(4.0, 1.2 + 1.2 * len(ranks)))
    ticks, tick_labels = [], []
    for i, rank in enumerate(ranks):
        base = 3 * (len(ranks) - 1 - i)
        rank_ranges = sorted((r for r in ranges if r.rank == rank), key=lambda r: (r.start_ns, -r.end_ns))
        open_ends: list[int] = []
        for r in rank_ranges:  # depth = ranges still open when this one starts
            open_ends = [end for end in open_ends if end > r.start_ns]
            shrink = min(0.15 * len(open_ends), 0.6)
            ax.broken_barh([((r.start_ns - origin) / 1e6, (r.end_ns - r.start_ns) / 1e6)],
                           (base + 2 + shrink / 2, 0.8 - shrink), color=colors[r.name], linewidth=0)
            open_ends.append(r.end_ns)
        for lane, is_comm in ((1, False), (0, True)):
            spans = [((k.start_ns - origin) / 1e6, (k.end_ns - k.start_ns) / 1e6)
                     for k in kernels if k.rank == rank and k.is_comm == is_comm]
            ax.broken_barh(spans, (base + lane + 0.1, 0.8), color="tab:red" if is_comm else "tab:gray", linewidth=0)
        ticks += [base + 2.5, base + 1.5, base + 0.5]
        tick_labels += [f"rank {rank} ranges", f"rank {rank} compute", f"rank {rank} comm"]
    ax.set_yticks(ticks, tick_labels, fontsize=7)
    ax.set_xlabel("time (ms)")
    for name in phases:
        ax.plot([], [], color=colors[name], linewidth=6, label=name.removeprefix("dsv4cp."))
    outside_legend(fig, ax, fontsize=6)
    return Plot(fig)


def trace_overlap(table: pd.DataFrame, *, title: str = "Communication per phase", caption: str = "") -> Plot:
    """Hidden vs exposed communication (ms) per phase and rank, from an overlap table
    (``dsv4cp.profiling.overlap.COLUMNS``, e.g. ``kineto_overlap_table``)."""
    comm = table[(table["comm_ms"] > 0) & (table["phase"] != TOTAL)]
    if comm.empty:
        return Plot(None, "trace overlap: no communication in any phase")
    labels = [f"r{rank} {phase.removeprefix('dsv4cp.')}" for rank, phase in zip(comm["rank"], comm["phase"])]
    fig, ax = _figure(title, caption or "per phase: communication overlapped by compute vs exposed",
                      width=8.0, height=1.5 + 0.35 * len(comm))
    ax.barh(labels, comm["overlap_ms"], color="tab:green", label="overlapped")
    ax.barh(labels, comm["exposed_comm_ms"], left=comm["overlap_ms"], color="tab:red", label="exposed")
    ax.invert_yaxis()
    ax.set_xlabel("communication time (ms)")
    outside_legend(fig, ax)
    return Plot(fig)
