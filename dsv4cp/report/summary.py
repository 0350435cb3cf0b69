"""The report a person reads first: ``summary.md`` plus every table (CSV + markdown) and plot (PNG).

:func:`write_report` is what ``dsv4cp report`` calls; :func:`render_summary` builds the markdown from
already computed tables and plots (it computes nothing itself).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dsv4cp.profiling.overlap import TOTAL
from dsv4cp.report import plots as plots_module
from dsv4cp.report import sections
from dsv4cp.report import tables as tables_module
from dsv4cp.report.plots import Plot

TOP_PHASES = 3
"""Phases named per profiled point in "Where the time goes"."""


def _runs_table(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run, group in df.groupby("run", sort=False):
        first = group.iloc[0]
        sha = first["git_sha"]
        rows.append({
            "run": run, "machine": first["machine"], "gpu": first["gpu_name"],
            "git_sha": (sha[:10] + ("+dirty" if first["git_dirty"] else "")) if sha else "unknown",
            "points": len(group), "ok": int((group["status"] == "ok").sum()),
        })
    return pd.DataFrame(rows)


def _why(df: pd.DataFrame, point_id: str, run: str) -> str:
    """Where the CP = 2 target point's time and exposed communication go (its profiled phases)."""
    in_scope = df["point_id"] == point_id
    if run != tables_module.ALL_RUNS:
        in_scope &= df["run"] == run
    profiled = [p for p in df[in_scope]["phases"] if isinstance(p, list)]
    if not profiled:
        return "the point was not profiled (sweep --profile tells why)"
    rows = pd.DataFrame([p for p in profiled[-1] if p.get("phase") != TOTAL])
    rows["busy_ms"] = rows["compute_ms"] + rows["exposed_comm_ms"]
    busiest = rows.nlargest(TOP_PHASES, "busy_ms")
    exposed = rows[rows["exposed_comm_ms"] > 0].nlargest(TOP_PHASES, "exposed_comm_ms")

    def named(table: pd.DataFrame, column: str) -> str:  # every overlap row names its rank
        return ", ".join(f"{p.removeprefix('dsv4cp.')} (rank {r}) {t:.3g} ms"
                         for p, r, t in zip(table["phase"], table["rank"], table[column]))

    parts = ["busiest phases " + named(busiest, "busy_ms")]
    if len(exposed):
        parts.append("exposed communication in " + named(exposed, "exposed_comm_ms"))
    return "; ".join(parts)


def _targets_section(df: pd.DataFrame, targets: pd.DataFrame) -> list[str]:
    target_text = ", ".join(f"{k}={v}" for k, v in tables_module.TARGET_POINT.items())
    lines = ["## Targets", "", f"Issue 10 targets, on the configuration {target_text}:", ""]
    for row in targets.itertuples(index=False):
        if row.met == tables_module.NOT_MEASURED:
            verdict = tables_module.NOT_MEASURED
        elif row.met == "yes":
            verdict = f"**{row.measured:.3f}** (target <= {row.limit:g}): met"
        else:
            verdict = (f"**{row.measured:.3f}** (target <= {row.limit:g}): MISSED by {row.miss_pct:.1f}%; "
                       f"CP = 2 point {row.cp2_point_id}: {_why(df, row.cp2_point_id, row.run)}")
        lines.append(f"- {row.run}: {row.target}: {verdict}")
    return lines + [""]


def _time_section(phases: pd.DataFrame) -> list[str]:
    lines = ["## Where the time goes", ""]
    phases = phases[phases["phase"] != TOTAL] if len(phases) else phases
    if phases.empty:
        return lines + ["No profiled point (run the sweep with `--profile` for per-phase times).", ""]
    axes = [c for c in phases.columns if c not in ("rank", "phase", *tables_module.PHASE_METRICS, "busy_ms")]
    phases = phases.assign(point=tables_module.point_labels(phases, axes) if axes else "point")
    for (point, rank), group in phases.groupby(["point", "rank"], sort=False):
        busy = group["busy_ms"].sum()
        top = group.sort_values("busy_ms", ascending=False).head(TOP_PHASES)
        parts = [f"{p.removeprefix('dsv4cp.')} {t:.3g} ms ({100 * t / busy:.0f}%)"
                 for p, t in zip(top["phase"], top["busy_ms"]) if busy > 0]
        comm, exposed = group["comm_ms"].sum(), group["exposed_comm_ms"].sum()
        comm_text = (f"; communication {comm:.3g} ms, {exposed:.3g} ms exposed ({100 * exposed / comm:.0f}%)"
                     if comm > 0 else "; no communication")
        lines.append(f"- {point}, rank {rank}: busy {busy:.3g} ms: " + ", ".join(parts) + comm_text)
    return lines + [""]


def _measured(headline: pd.DataFrame) -> pd.DataFrame:
    """The headline's measured points (the others are listed under "Points that did not measure")."""
    return headline[headline["status"] == "ok"].drop(columns="status").reset_index(drop=True)


def _short_status(status: str, limit: int = 100) -> str:
    """A status cut to ``limit`` characters: a library's install hint would make the table unreadable."""
    return status if len(status) <= limit else status[: limit - 3] + "..."


def render_summary(df: pd.DataFrame, tables: dict[str, pd.DataFrame], plots: dict[str, Plot],
                   table_dir: str = "tables", plot_dir: str = "plots") -> str:
    """``summary.md``'s text: runs, headline table, targets, where the time goes, failed points, and
    links to the tables (``table_dir/NAME.md``) and plots (``plot_dir/NAME.png``), relative paths."""
    lines = [f"# dsv4cp report: {', '.join(tables_module.runs_of(df))}", "",
             f"Hardware: {tables_module.hardware(df)}.", "", "## Runs", "",
             tables_module.to_markdown(_runs_table(df)), "## Headline", "",
             "Per point: median step time [p20, p80] in ms (max over ranks per repetition), tokens/s, TFLOP/s per "
             "GPU, MFU, measured / model bound, peak memory per rank (GiB, max over ranks), exposed "
             "communication as % of communication time (profiled points only).", "",
             tables_module.to_markdown(_measured(tables["headline"]))]
    lines += _targets_section(df, tables["targets"])
    lines += _time_section(tables["phases"])
    lines += tables_module.determinism_lines(tables["determinism_cost"])
    lines += sections.extra_sections(df, tables)
    if not tables["failures"].empty:
        failed = tables["failures"].assign(status=tables["failures"]["status"].map(_short_status))
        lines += ["## Points that did not measure", "", tables_module.to_markdown(failed)]
    lines += ["## Tables", ""]
    for name, table in tables.items():
        state = f"{len(table)} rows" if not table.empty else "empty: the runs lack the points it needs"
        lines.append(f"- [{name}]({table_dir}/{name}.md) ([csv]({table_dir}/{name}.csv)): {state}")
    lines += ["", "## Plots", ""]
    for name, plot in plots.items():
        drawn = plot.figure is not None
        lines.append(f"![{name}]({plot_dir}/{name}.png)" if drawn else f"- {name}: skipped ({plot.note})")
        lines.append("")
    return "\n".join(lines)


def write_report(df: pd.DataFrame, out_dir: str | Path) -> Path:
    """Write ``out_dir/summary.md``, ``out_dir/tables/*.{csv,md}`` and ``out_dir/plots/*.png``;
    returns the summary's path."""
    out_dir = Path(out_dir)
    tables = tables_module.all_tables(df)
    plots = plots_module.all_plots(df)
    for name, table in tables.items():
        tables_module.write_table(table, out_dir / "tables", name)
    for name, plot in plots.items():
        plot.save(out_dir / "plots" / f"{name}.png")
    summary = out_dir / "summary.md"
    summary.write_text(render_summary(df, tables, plots))
    return summary

