"""Sections of ``summary.md`` beyond the headline: cost growth, memory peaks and, for two runs, A vs B.

Each section is markdown lines built from tables :func:`dsv4cp.report.summary.all_tables` already
computed; a section whose table is empty or absent is left out.
"""

from __future__ import annotations

import pandas as pd

from dsv4cp.report import growth, side_by_side, tables


def memory_lines(peaks: pd.DataFrame) -> list[str]:
    """Where each rank's memory peak sits and what holds it (``memory_peaks``); empty without a point
    recorded with ``--memory-phases``."""
    if peaks.empty:
        return []
    lines = ["## Where the memory peak sits", "",
             "Per rank: the peak (CUDA allocator on GPU, process RSS on CPU), the phase open at it and the "
             "closed phases that left the most memory allocated before it ([table](tables/memory_peaks.md)).", ""]
    axes = [c for c in peaks.columns if c not in ("rank", "memory_kind", "peak_gib", "peak_phase", "open_phases",
                                                  "held_by")]
    labels = tables.point_labels(peaks, axes) if axes else pd.Series("point", index=peaks.index)
    for label, row in zip(labels, peaks.itertuples(index=False)):
        held = f"; held by {row.held_by}" if row.held_by else ""
        lines.append(f"- {label}, rank {row.rank}: peak {row.peak_gib:.3g} GiB ({row.memory_kind}) in "
                     f"{row.peak_phase} (open: {row.open_phases or 'none'}){held}")
    return lines + [""]


def extra_sections(df: pd.DataFrame, report_tables: dict[str, pd.DataFrame]) -> list[str]:
    """The sections' lines in summary order: A vs B (two runs), cost growth, memory peaks."""
    lines: list[str] = []
    if "comparison" in report_tables:
        lines += side_by_side.summary_lines(df, report_tables["comparison"])
    lines += growth.summary_lines(report_tables.get("cost_growth", pd.DataFrame()))
    lines += memory_lines(report_tables.get("memory_peaks", pd.DataFrame()))
    return lines
