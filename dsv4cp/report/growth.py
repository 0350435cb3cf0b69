"""How step cost grows with context: measured time and the cost model's bound against tokens.

A configuration (every axis but ``tokens`` / ``tokens_per_rank``, within one run) at one cp measured
at two or more token counts is a growth series. Between consecutive sizes ``n1 < n2`` the growth per
doubling of a cost ``c`` is ``(c2 / c1) ** (1 / log2(n2 / n1))``: 2.0 is linear in tokens, 4.0
quadratic. Time growing faster than its bound while measured / bound stays flat says the extra cost
is modelled work (e.g. the indexer's quadratic score term), not slower kernels. Parallel efficiency at
a size is ``T(1) / (cp * T(cp))`` against the same configuration's CP = 1 point.
"""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from dsv4cp.records import AXES
from dsv4cp.report import tables
from dsv4cp.report.styles import CP_AXIS_LABEL, outside_legend, series_style

SERIES_AXES: tuple[str, ...] = tuple(a for a in AXES if a not in ("tokens", "tokens_per_rank"))
"""Axes a growth series holds fixed (``cp`` among them)."""

COLUMNS_AFTER_AXES: tuple[str, ...] = (
    "time_ms_median", "bound_ms", "measured_over_bound", "time_growth_per_doubling",
    "bound_growth_per_doubling", "parallel_efficiency",
)


def per_doubling(cost_ratio: float, size_ratio: float) -> float:
    """Growth per doubling of size of a cost that grew ``cost_ratio``-fold while the size grew
    ``size_ratio``-fold (``size_ratio > 1``); NaN where either ratio is not positive and finite."""
    if not (size_ratio > 1 and cost_ratio > 0 and math.isfinite(cost_ratio) and math.isfinite(size_ratio)):
        return math.nan
    return cost_ratio ** (1.0 / math.log2(size_ratio))


def cost_growth(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point of every growth series, by series then tokens: the varying axes, median time,
    bound, measured / bound, growth per doubling of time and of bound from the series' previous size
    (blank on its first), and the parallel efficiency against the CP = 1 point at the same size
    (blank without one, 1.0 at CP = 1)."""
    points = tables.ok_points(df)
    axes = list(dict.fromkeys([*tables.varying_axes(points), "cp", "tokens"]))
    columns = [*axes, *COLUMNS_AFTER_AXES]
    if points.empty:
        return pd.DataFrame(columns=columns)
    points = points.assign(time_ms_median=pd.to_numeric(points["time_ms_median"], errors="coerce"),
                           bound_ms=pd.to_numeric(points["bound_ms"], errors="coerce"))
    fixed = ["run", *(a for a in SERIES_AXES if a != "cp")]
    base_key = tables.group_key(points, fixed)
    cp1 = {(key, tokens): time for key, tokens, cp, time in
           zip(base_key, points["tokens"], points["cp"], points["time_ms_median"]) if cp == 1}
    rows = []
    for _, series in points.groupby(tables.group_key(points, ["run", *SERIES_AXES]), sort=False):
        series = series.drop_duplicates("tokens", keep="last").sort_values("tokens")
        if len(series) < 2:
            continue
        previous = None
        for index, point in series.iterrows():
            time, bound, tokens, cp = point["time_ms_median"], point["bound_ms"], point["tokens"], int(point["cp"])
            t1 = cp1.get((base_key[index], tokens))
            row = {**{a: point[a] for a in axes}, "time_ms_median": time, "bound_ms": bound,
                   "measured_over_bound": time / bound if bound > 0 else math.nan,
                   "time_growth_per_doubling": math.nan, "bound_growth_per_doubling": math.nan,
                   "parallel_efficiency": t1 / (cp * time) if t1 is not None else math.nan}
            if previous is not None:
                size = tokens / previous["tokens"]
                row["time_growth_per_doubling"] = per_doubling(time / previous["time_ms_median"], size)
                row["bound_growth_per_doubling"] = per_doubling(bound / previous["bound_ms"], size)
            rows.append(row)
            previous = point
    return pd.DataFrame(rows, columns=columns)


def _series_labels(table: pd.DataFrame) -> pd.Series:
    axes = [a for a in tables.varying_axes(table) if a not in ("tokens", "tokens_per_rank")]
    if "cp" in table and "cp" not in axes:
        axes.append("cp")  # each cp is its own series even when the table holds one
    return tables.point_labels(table, axes)


def cost_growth_figure(df: pd.DataFrame, caption: str) -> Figure | None:
    """Left: median step time (solid) and its bound (dashed, same colour) against total tokens,
    log-log, one series per configuration and cp, each segment labelled with the time's growth per
    doubling; right: parallel efficiency against cp, one line per configuration and size. None when
    no configuration was measured at two sizes."""
    table = cost_growth(df)
    if table.empty:
        return None
    fig = Figure(figsize=(12.0, 5.0), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    fig.suptitle("Cost growth with context", x=0.01, horizontalalignment="left")
    fig.supxlabel(caption, fontsize=8, color="dimgray")
    labels = _series_labels(table)
    count = 0
    for label, series in table.groupby(labels, sort=False):
        style = series_style(count)
        count += 1
        tokens = series["tokens"].to_numpy(dtype=float)
        times = series["time_ms_median"].to_numpy(dtype=float)
        left.plot(tokens, times, label=label, **style.kwargs())
        left.plot(tokens, series["bound_ms"].to_numpy(dtype=float), color=style.color, linestyle="--",
                  linewidth=1.0)
        for (n1, n2), (t1, t2), growth in zip(zip(tokens, tokens[1:]), zip(times, times[1:]),
                                             series["time_growth_per_doubling"].iloc[1:]):
            left.annotate(f"x{growth:.2f}", (math.sqrt(n1 * n2), math.sqrt(t1 * t2)), fontsize=6,
                          color=style.color, textcoords="offset points", xytext=(0, 4), ha="center")
    left.plot([], [], color="black", linestyle="--", linewidth=1.0, label="model bound (dashed, same colour)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("total tokens")
    left.set_ylabel("median step time (ms)")
    left.set_title("time and bound; labels: time growth per doubling", fontsize=9)
    efficiency = table.dropna(subset=["parallel_efficiency"])
    efficiency = efficiency[_series_key_without_cp(efficiency).map(
        efficiency.groupby(_series_key_without_cp(efficiency))["cp"].nunique()) >= 2]
    if efficiency.empty:
        right.text(0.5, 0.5, "no size measured at CP = 1 and another cp", ha="center", va="center",
                   transform=right.transAxes, fontsize=8)
    else:
        axes = [a for a in tables.varying_axes(efficiency) if a not in ("cp", "tokens_per_rank")]
        for label, series in efficiency.groupby(tables.point_labels(efficiency, axes), sort=False):
            style = series_style(count)
            count += 1
            right.plot(series["cp"], series["parallel_efficiency"], label=f"efficiency: {label}", **style.kwargs())
        cps = sorted({int(c) for c in efficiency["cp"]})
        right.set_xticks(cps, [str(c) for c in cps])
        right.axhline(1.0, color="black", linestyle=":", linewidth=0.8)
    right.set_ylim(0, 1.1)
    right.set_xlabel(CP_AXIS_LABEL)
    right.set_ylabel("parallel efficiency T(1) / (cp T(cp))")
    right.set_title("parallel efficiency at each size", fontsize=9)
    outside_legend(fig, [left, right])
    return fig


def _series_key_without_cp(table: pd.DataFrame) -> pd.Series:
    return tables.group_key(table, [a for a in table.columns if a in ("run", *SERIES_AXES) and a != "cp"]
                            + ["tokens"])


def summary_lines(table: pd.DataFrame) -> list[str]:
    """Markdown lines of the growth per doubling of each series (time, then bound, then measured /
    bound per size), for ``summary.md``; empty without a growth series."""
    if table.empty:
        return []
    lines = ["## Cost growth with context", "",
             "Per doubling of tokens (2.0 = linear, 4.0 = quadratic): measured time, the model bound, and "
             "measured / bound at each size ([table](tables/cost_growth.md), "
             "[plot](plots/cost_growth.png)).", ""]
    for label, series in table.groupby(_series_labels(table), sort=False):
        times = ", ".join(f"x{g:.2f}" for g in series["time_growth_per_doubling"].iloc[1:])
        bounds = ", ".join(f"x{g:.2f}" for g in series["bound_growth_per_doubling"].iloc[1:])
        ratios = ", ".join(f"{r:.2f}" for r in series["measured_over_bound"])
        sizes = "..".join(str(int(t)) for t in series["tokens"].iloc[[0, -1]])
        lines.append(f"- {label} ({sizes} tokens): time {times}; bound {bounds}; measured / bound {ratios}")
    return lines + [""]
