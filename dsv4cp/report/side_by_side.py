"""Two runs side by side (``dsv4cp report A B``): matched points in columns with compare's verdict,
unmatched points with how the nearest point of the other run differs.

Points match by ``point_id`` (every axis) and the configuration they ran
(:func:`dsv4cp.records.configuration_key`: every resolved kernel option, the backends): two records of one
point id that ran other kernels are listed apart, each "only in" its run, naming the options that differ.
The ratio, noise bands
and verdict are compare's own (:func:`dsv4cp.report.compare.compare` on the median step time at
:data:`THRESHOLD`), here with different hardware allowed: the run-level differences (machine, GPU,
commit, library versions) are named beside the table instead.
"""

from __future__ import annotations

import math

import pandas as pd

from dsv4cp.records import AXES, configuration_key, option_differences, resolved_options
from dsv4cp.report import compare as compare_module
from dsv4cp.report import tables

METRIC = "time_ms_median"
THRESHOLD = 0.05
"""Relative change beyond which compare calls a point changed: ``dsv4cp compare``'s default 5%."""

MATCHED, ONLY_A, ONLY_B = "matched", "only in A", "only in B"
RUN_FIELDS: tuple[str, ...] = ("machine", "gpu_name", "git_sha", "git_dirty")
"""Fields of each run compared in :func:`run_differences`."""

VALUE_COLUMNS: tuple[str, ...] = ("match", "a_time_ms", "a_band_ms", "b_time_ms", "b_band_ms", "b_over_a", "verdict",
                                  "differences")


def _latest(points: pd.DataFrame) -> pd.DataFrame:
    return points.drop_duplicates("point_id", keep="last").set_index("point_id")


def _same_kernels(point_id: str, point: pd.Series, others: pd.DataFrame) -> bool:
    """Whether ``others`` holds ``point_id`` measured with the same kernels as ``point``."""
    return point_id in others.index and configuration_key(point) == configuration_key(others.loc[point_id])


def _axis_text(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "None" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _differences(point: pd.Series, others: pd.DataFrame, mine: str, theirs: str) -> str:
    """How the nearest point of ``others`` (fewest differing axes) differs from ``point``:
    ``"overlap none (A) vs async (B)"``; ``"B has no point"`` when ``others`` is empty."""
    if others.empty:
        return f"{theirs} has no point"
    if point.name in others.index:  # the same axes, other kernels
        other = others.loc[point.name]
        changes = option_differences(resolved_options(point), resolved_options(other) or {})
        named = ", ".join(f"{name} {old} ({mine}) vs {new} ({theirs})" for name, (old, new) in changes.items())
        return "kernels differ: " + (named or "the backends that ran")
    differing = [[a for a in AXES if _axis_text(point[a]) != _axis_text(other[a])] for _, other in others.iterrows()]
    best = min(range(len(differing)), key=lambda i: len(differing[i]))
    nearest = others.iloc[best]
    return ", ".join(f"{a} {_axis_text(point[a])} ({mine}) vs {_axis_text(nearest[a])} ({theirs})"
                     for a in differing[best])


def _band(low: float, high: float) -> str:
    return "" if math.isnan(low) or math.isnan(high) else f"{low:.4g}..{high:.4g}"


def comparison(df: pd.DataFrame) -> pd.DataFrame:
    """For records of exactly two runs (A first): one row per point of either run, the axes that vary
    over both, then :data:`VALUE_COLUMNS`: ``match`` (matched / only in A / only in B), A's and B's
    median time and p20..p80 band, B / A, compare's verdict (matched points) and ``differences``
    (unmatched: how the nearest point of the other run differs). Empty unless there are two runs."""
    runs = tables.runs_of(df)
    if len(runs) != 2:
        return pd.DataFrame(columns=list(VALUE_COLUMNS))
    latest = {run: _latest(df[df["run"] == run]) for run in runs}
    a_points, b_points = latest[runs[0]], latest[runs[1]]
    everything = pd.concat([a_points, b_points])
    axes = [a for a in tables.varying_axes(everything.reset_index()) if a != "run"]
    paths = [df.loc[df["run"] == run, "run_path"].iloc[0] for run in runs]
    verdicts = _verdicts(paths)
    rows = []
    for point_id, a in a_points.iterrows():
        row = {axis: a[axis] for axis in axes}
        if _same_kernels(point_id, a, b_points):
            b = b_points.loc[point_id]
            row.update(match=MATCHED, **_values(a, "a"), **_values(b, "b"))
            row["b_over_a"] = row["b_time_ms"] / row["a_time_ms"] if row["a_time_ms"] > 0 else math.nan
            row["verdict"] = verdicts.get(point_id, _not_compared(a, b))
            row["differences"] = ""
        else:
            row.update(match=ONLY_A, **_values(a, "a"), verdict="", differences=_differences(a, b_points, "A", "B"))
        rows.append(row)
    for point_id, b in b_points.iterrows():
        if not _same_kernels(point_id, b, a_points):
            rows.append({**{axis: b[axis] for axis in axes}, "match": ONLY_B, **_values(b, "b"), "verdict": "",
                         "differences": _differences(b, a_points, "B", "A")})
    return pd.DataFrame(rows, columns=[*axes, *VALUE_COLUMNS])


def _values(point: pd.Series, side: str) -> dict[str, object]:
    """A side's median and band (blank when the point did not measure)."""
    if point["status"] != "ok":
        return {f"{side}_time_ms": math.nan, f"{side}_band_ms": point["status"]}
    median, low, high = (pd.to_numeric(point[c], errors="coerce") for c in ("time_ms_median", "time_ms_p20",
                                                                             "time_ms_p80"))
    return {f"{side}_time_ms": float(median), f"{side}_band_ms": _band(float(low), float(high))}


def _not_compared(a: pd.Series, b: pd.Series) -> str:
    """Why compare gave a matched point no verdict: it judges points A measured, with a value."""
    if a["status"] != "ok":
        return f"not compared: A {a['status']}"
    return f"failed: {b['status']}" if b["status"] != "ok" else "no value"


def _verdicts(paths: list[str]) -> dict[str, str]:
    """point_id -> compare's verdict of B against A; empty when compare finds nothing to judge."""
    try:
        sides = [compare_module.load_side(path, METRIC) for path in paths]
        result = compare_module.compare(*sides, METRIC, threshold=THRESHOLD, allow_different_hardware=True)
    except compare_module.UnusableInputError:  # no matched point measured in A: every row says why
        return {}
    return dict(zip(result.table["key"], result.table["verdict"]))


def _run_text(value: object) -> str:
    """A run field as the summary shows it: a 40-hex commit cut to 10 digits."""
    text = _axis_text(value)
    return text[:10] if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else text


def run_differences(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """``(field, A's value, B's value)`` for each run field of :data:`RUN_FIELDS` on which the two runs
    differ (their first records); empty unless there are two runs."""
    runs = tables.runs_of(df)
    if len(runs) != 2:
        return []
    first = [df[df["run"] == run].iloc[0] for run in runs]
    return [(name, _run_text(first[0][name]), _run_text(first[1][name])) for name in RUN_FIELDS
            if _run_text(first[0][name]) != _run_text(first[1][name])]


def summary_lines(df: pd.DataFrame, table: pd.DataFrame) -> list[str]:
    """Markdown for ``summary.md``: which run is A and B, how the runs differ, the verdict counts and
    the unmatched points; empty unless there are two runs."""
    runs = tables.runs_of(df)
    if len(runs) != 2:
        return []
    lines = ["## A vs B", "", f"A = {runs[0]}, B = {runs[1]}; median step time per matched point, B / A and "
             f"`dsv4cp compare`'s verdict at {100 * THRESHOLD:g}% (and its test: a significant U test of the "
             "repetitions' times, or without them both p20..p80 bands apart) "
             "([table](tables/comparison.md)).", ""]
    differences = run_differences(df)
    lines.append("Runs differ in: " + "; ".join(f"{name} {a} (A) vs {b} (B)" for name, a, b in differences) + "."
                 if differences else "Runs agree on machine, GPU and commit.")
    matched = table[table["match"] == MATCHED]
    counts = matched["verdict"].value_counts()
    lines += ["", f"{len(matched)} matched points: " + (", ".join(f"{n} {v}" for v, n in counts.items()) or "none")
              + "."]
    for kind in (ONLY_A, ONLY_B):
        alone = table[table["match"] == kind]
        if len(alone):
            lines.append(f"- {len(alone)} {kind}: " + "; ".join(dict.fromkeys(alone["differences"])))
    return lines + [""]
