"""The report a person reads first: ``summary.md`` plus every table (CSV + markdown) and plot (PNG).

:func:`write_report` is what ``dsv4cp report`` calls; :func:`render_summary` builds the markdown from
already computed tables and plots (it computes nothing itself), one section function after another
(:data:`SECTIONS`: a new section is one more function there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dsv4cp.profiling.overlap import TOTAL
from dsv4cp.report import diagnosis as diagnosis_module
from dsv4cp.report import growth, roofline, sections, side_by_side
from dsv4cp.report import plots as plots_module
from dsv4cp.report import tables as tables_module
from dsv4cp.report import targets as targets_module
from dsv4cp.report.parity import parity_failures
from dsv4cp.report.plots import Plot

TOP_PHASES = 3
"""Phases named per profiled point in "Where the time goes" and per point in the straggler view."""


@dataclass(frozen=True)
class ReportParts:
    """What every summary section reads: the records, the computed tables and plots, link folders."""

    df: pd.DataFrame
    tables: dict[str, pd.DataFrame]
    plots: dict[str, Plot]
    table_dir: str = "tables"
    plot_dir: str = "plots"

    def table(self, name: str) -> pd.DataFrame:
        """A table by name; an empty one when the report holds none of that name."""
        return self.tables.get(name, pd.DataFrame())


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


def _time_section(report: ReportParts) -> list[str]:
    lines = ["## Where the time goes", ""]
    phases = report.table("phases")
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
    return lines + [""] + _step_own_lines(report.table("diagnosis"))


def _step_own_lines(diagnosis: pd.DataFrame) -> list[str]:
    """What ``dsv4cp.step``'s own time is, per diagnosed point (its slowest rank)."""
    if diagnosis.empty:
        return []
    lines = ["`step` is the range around the whole step: its own time is the work between and around the named "
             "phases (the autograd functions' Python and host operations that enclose a phase range on CPU, "
             "launches and copies on GPU). Above, a phase's busy time counts every operation attributed to it, "
             "enclosing ones too; counted exclusively (each instant to the innermost running operation, as the "
             "diagnosis does), the step's own time is:", ""]
    labels = diagnosis_module.label_points(diagnosis)
    for _, group in diagnosis.groupby("point_id", sort=False):
        slow = diagnosis_module.slowest_rank(group)
        share = 100 * slow["step_own_ms"] / slow["step_ms"] if slow["step_ms"] > 0 else math.nan
        top = f", mostly {slow['step_own_top']}" if slow["step_own_top"] else ""
        lines.append(f"- {labels[slow.name]}, rank {int(slow['rank'])}: {slow['step_own_ms']:.3g} ms "
                     f"({share:.0f}% of the traced step){top}")
    return lines + [""]


def _measured(headline: pd.DataFrame) -> pd.DataFrame:
    """The headline's measured points (the others are listed under "Points that did not measure")."""
    return headline[headline["status"] == "ok"].drop(columns="status").reset_index(drop=True)


def _short_status(status: str, limit: int = 100) -> str:
    """A status cut to ``limit`` characters: a library's install hint would make the table unreadable."""
    return status if len(status) <= limit else status[: limit - 3] + "..."


def _headline_section(report: ReportParts) -> list[str]:
    lines = ["## Headline", "",
             "Per point: median step time [p20, p80] in ms (max over ranks per repetition), tokens/s, TFLOP/s per "
             "GPU, MFU, measured / model bound at the hardware's physical limits (`measured_over_bound`: the H200 "
             "spec sheet, 989 TFLOP/s, 4.8 TB/s, 450 GB/s per NVLink direction) and at the measured ceilings of "
             "`bound_machine` (`measured_over_measured_bound`: 784 TFLOP/s, 4.26 TB/s on the h200x2 preset; on a "
             "machine without a spec sheet here, a CPU, the two agree), peak memory per rank (GiB, max over ranks), "
             "exposed "
             "communication as % of communication time (profiled points only), parity with CP = 1 "
             "(`sweep --check`; blank when not checked).", ""]
    emulated = report.df["emulated_rank"].notna() if "emulated_rank" in report.df else pd.Series(dtype=bool)
    if emulated.any():
        lines += [f"{int(emulated.sum())} point(s) with an `emulated_rank` are **compute only**: ranks measured alone "
                  "on one device (`all`: every rank in turn, its time the slowest rank's), collectives replaced by "
                  "no-ops, so they hold no communication and no waiting for peers.", ""]
    return lines + _unmeasured_lines(report.table("failures"), len(report.table("headline"))) + _invalid_lines(
        report.df) + [tables_module.to_markdown(_measured(report.table("headline")))]


def _invalid_lines(df: pd.DataFrame) -> list[str]:
    """The headline's list of records holding values no measurement can (``load_runs``' ``invalid``)."""
    held = df[df["invalid"].notna()] if "invalid" in df else df.iloc[:0]
    if held.empty:
        return []
    labels = tables_module.point_labels(held, tables_module.varying_axes(df))
    return [f"**{len(held)} record(s) hold values no measurement can**: left blank below, never judged against "
            "a target (the `invalid` column):", "",
            *(f"- {label} ({point_id}): {tables_module.invalid_cell(invalid)}"
              for label, point_id, invalid in zip(labels, held["point_id"], held["invalid"])), ""]


def _unmeasured_lines(failures: pd.DataFrame, points: int) -> list[str]:
    """The headline's count of the points that did not measure, by status kind (none: no line), so a run
    whose every point failed says so first rather than showing an empty table alone."""
    if failures.empty:
        return []
    kinds = failures["status"].map(lambda status: status.split(":")[0]).value_counts()
    tally = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    lead = "**No point measured**: all" if len(failures) >= points else f"{len(failures)} of"
    return [f"{lead} {points} points did not measure ({tally}): their statuses are under "
            "\"Points that did not measure\".", ""]


def _targets_section(report: ReportParts) -> list[str]:
    lines = ["## Targets", ""]
    judged = report.table("targets")
    if judged.empty:
        return lines + ["No target declared: a spec's `targets:` list names them (metric, points, comparison, "
                        "value); the shipped specs in `sweeps/` declare the project's.", ""]
    lines += ["Each run's declared targets (its spec's `targets:`), judged on its measured points "
              "(`tables/targets.md` lists every point); a missed one names the cause its diagnosis finds.", ""]
    causes = diagnosis_module.point_causes(report.table("diagnosis"))
    for (run, name, rule), rows in judged.groupby(["run", "target", "rule"], sort=False):
        counts = rows["verdict"].value_counts()
        verdicts = targets_module.VERDICTS
        tally = ", ".join(f"{verdict} {counts[verdict]}" for verdict in verdicts if verdict in counts)
        if len(rows) == 1:
            lines.append(f"- {run}: {name} ({rule}): {_verdict(rows.iloc[0], causes, with_point=True)}")
            continue
        lines.append(f"- {run}: {name} ({rule}): {len(rows)} points: {tally}")
        for row in rows[rows["verdict"] != targets_module.MET].itertuples(index=False):
            lines.append(f"  - {row.point}: {_verdict(row, causes, with_point=False)}")
    return lines + [""]


def _verdict(row, causes: dict[str, str], with_point: bool) -> str:
    """One judged target row in words (led by its point when ``with_point``); a missed one with its
    point's cause."""
    where = f"on {row.point}: " if with_point and isinstance(row.point, str) and row.point else ""
    if row.verdict == targets_module.MET:
        return f"{where}**{row.measured:.4g}**: met"
    if row.verdict == targets_module.MISSED:
        cause = causes.get(row.point_id, "not profiled: `sweep --profile` gives the diagnosis that names the cause")
        return f"{where}**{row.measured:.4g}**: MISSED by {row.miss_pct:.1f}%; {cause}"
    if row.verdict == targets_module.INVALID:
        return f"{where}INVALID, not judged: {row.reason}"
    return f"{where}not applicable: {row.reason}"


def _diagnosis_section(report: ReportParts) -> list[str]:
    lines = ["## Why: diagnosis of each profiled step", ""]
    diagnosis = report.table("diagnosis")
    if diagnosis.empty:
        return lines + ["No diagnosed point (the sweep's `--profile` traces, RUN_DIR/traces/, are needed).", ""]
    lines += ["Per rank, the traced step = model bound + kernel excess + capacity padding + imbalance wait + exposed "
              "communication + host idle + unattributed (`tables/diagnosis.md`; per phase: "
              "`tables/diagnosis_phases.md`). The bound is the cost model's, at the ceilings of the records' "
              "bound. A host thread blocked in a collective counts as communicating here even inside an "
              "enclosing operation (the per-phase overlap table below counts that operation as compute). For the "
              "slowest rank of each point on several ranks (and each emulated rank), the largest part above its "
              "bound:", ""]
    labels = diagnosis_module.label_points(diagnosis)
    causes = diagnosis_module.point_causes(diagnosis)
    stragglers = report.table("stragglers")
    several = diagnosis.groupby("point_id", sort=False)["rank"].transform("nunique") > 1
    emulated = diagnosis["kind"] == diagnosis_module.EMULATED
    shown = diagnosis[several | emulated]
    if shown.empty:
        return lines + ["Every diagnosed point ran on one rank: `tables/diagnosis.md` has their parts.", ""]
    for point_id, group in shown.groupby("point_id", sort=False):
        line = f"- {labels[group.index[0]]}: {causes[point_id]}"
        spread = stragglers[stragglers["point_id"] == point_id].head(TOP_PHASES) if len(stragglers) else stragglers
        if len(spread):
            line += "; stragglers (max / mean over ranks): " + ", ".join(
                f"{p} {r:.3g} (rank {k})" for p, r, k in zip(spread["phase"], spread["max_over_mean"],
                                                             spread["slowest_rank"]))
        lines.append(line)
    return lines + [""]


def _parity_section(report: ReportParts) -> list[str]:
    lines = ["## Parity with CP = 1", ""]
    checked = report.df["parity"].map(lambda p: isinstance(p, list) and len(p) > 0)
    if not checked.any():
        return lines + ["No point was checked (`sweep --check` compares each CP > 1 point with CP = 1).", ""]
    failed = report.table("parity_failures")
    if failed.empty:
        count = int(checked.sum())
        text = f"All {count} checked points match CP = 1." if count > 1 else "The checked point matches CP = 1."
        return lines + [text, ""]
    return lines + [f"{failed['point_id'].nunique()} of {int(checked.sum())} checked points differ from CP = 1:", "",
                    tables_module.to_markdown(failed)]


def _failures_section(report: ReportParts) -> list[str]:
    failures = report.table("failures")
    if failures.empty:
        return []
    failed = failures.assign(status=failures["status"].map(_short_status))
    return ["## Points that did not measure", "", tables_module.to_markdown(failed)]


def _tables_section(report: ReportParts) -> list[str]:
    lines = ["## Tables", ""]
    for name, table in report.tables.items():
        state = f"{len(table)} rows" if not table.empty else "empty: the runs lack the points it needs"
        lines.append(f"- [{name}]({report.table_dir}/{name}.md) ([csv]({report.table_dir}/{name}.csv)): {state}")
    return lines + [""]


def _plots_section(report: ReportParts) -> list[str]:
    lines = ["## Plots", ""]
    for name, plot in report.plots.items():
        drawn = plot.figure is not None
        lines.append(f"![{name}]({report.plot_dir}/{name}.png)" if drawn else f"- {name}: skipped ({plot.note})")
        lines.append("")
    return lines


def _growth_and_memory_sections(report: ReportParts) -> list[str]:
    """A vs B, cost growth with context and where each rank's memory peaks (:mod:`dsv4cp.report.sections`)."""
    return sections.extra_sections(report.df, report.tables)


def _determinism_section(report: ReportParts) -> list[str]:
    return tables_module.determinism_lines(report.table("determinism_cost"))


def _compile_section(report: ReportParts) -> list[str]:
    return tables_module.compile_lines(report.table("compile_cost"))


SECTIONS: tuple[Callable[[ReportParts], list[str]], ...] = (
    _headline_section, _targets_section, _diagnosis_section, _time_section, _determinism_section,
    _compile_section, _growth_and_memory_sections,
    _parity_section, _failures_section, _tables_section, _plots_section,
)
"""The summary's sections after its title and runs, in order: each returns its markdown lines."""


def all_tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Every report table by file name, in the order the summary lists them."""
    two_runs = {"comparison": side_by_side.comparison(df)} if len(tables_module.runs_of(df)) == 2 else {}
    return {
        **two_runs,
        "headline": tables_module.headline(df),
        "phases": tables_module.phase_breakdown(df),
        "strong_scaling": tables_module.scaling(df, "strong"),
        "weak_scaling": tables_module.scaling(df, "weak"),
        "overlap": tables_module.overlap_comparison(df),
        "determinism_cost": tables_module.determinism_cost(df),
        "compile_cost": tables_module.compile_cost(df),
        "memory": tables_module.memory(df),
        "memory_peaks": tables_module.memory_peaks(df),
        "imbalance": tables_module.imbalance(df),
        "model_imbalance": tables_module.model_imbalance(df),
        "measured_vs_bound": tables_module.measured_vs_bound(df),
        "cost_growth": growth.cost_growth(df),
        "roofline": roofline.roofline(df),
        "failures": tables_module.failures(df),
    }


def _cpu_lines(df: pd.DataFrame) -> list[str]:
    """Why CP > 1 is slower on a CPU machine, when a run's records ran on one (nothing otherwise)."""
    machines = sorted({str(m) for m in df.loc[tables_module.on_cpu(df), "machine"]})
    if not machines:
        return []
    return [f"**On a CPU machine ({', '.join(machines)}), CP > 1 is expected to be slower than CP = 1**: the ranks "
            "are processes sharing the same host cores (on 2 cores, CP = 2 gives each rank one core where CP = 1 "
            "had both) and their collectives copy through host memory (gloo), so scaling targets miss there. "
            "A CPU run checks that every code path runs and agrees; how CP scales is measured on GPUs.", ""]


def render_summary(df: pd.DataFrame, tables: dict[str, pd.DataFrame], plots: dict[str, Plot],
                   table_dir: str = "tables", plot_dir: str = "plots") -> str:
    """``summary.md``'s text: runs, then :data:`SECTIONS` (headline, targets, diagnosis, where the time
    goes, parity, failed points, links to the tables (``table_dir/NAME.md``) and plots
    (``plot_dir/NAME.png``), relative paths)."""
    report = ReportParts(df, tables, plots, table_dir, plot_dir)
    lines = [f"# dsv4cp report: {', '.join(tables_module.runs_of(df))}", "",
             f"Hardware: {tables_module.hardware(df)}.", "", *_cpu_lines(df), "## Runs", "",
             tables_module.to_markdown(_runs_table(df))]
    for section in SECTIONS:
        lines += section(report)
    return "\n".join(lines)


def report_tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Every table of the report by file name: the headline, the judged targets, the diagnosis tables
    and parity failures first, then the other tables of :func:`all_tables`."""
    tables = all_tables(df)
    diagnosed = diagnosis_module.diagnosis_tables(df)
    checked = tables_module.ok_points(df)
    extra = {"targets": targets_module.evaluate(df), **diagnosed,
             "parity_failures": parity_failures(checked, tables_module.varying_axes(checked))}
    return {"headline": tables.pop("headline"), **extra, **tables}


def write_report(df: pd.DataFrame, out_dir: str | Path) -> Path:
    """Write ``out_dir/summary.md``, ``out_dir/tables/*.{csv,md}`` and ``out_dir/plots/*.png``;
    returns the summary's path."""
    out_dir = Path(out_dir)
    df = tables_module.with_kernel_configuration(df)
    tables = report_tables(df)
    plots = plots_module.all_plots(df)
    for name, table in tables.items():
        tables_module.write_table(table, out_dir / "tables", name)
    for name, plot in plots.items():
        plot.save(out_dir / "plots" / f"{name}.png")
    summary = out_dir / "summary.md"
    summary.write_text(render_summary(df, tables, plots))
    return summary
