"""Judge the targets each run's spec declares (``targets:``, :mod:`dsv4cp.targets`) on its records.

Every target gives one row per point it applies to (a pair metric: per numerator point), or one row
saying why it applies to none: met, missed (by how much) or not applicable (with the reason). The
targets come from each run's ``meta.json`` (the spec as loaded); a bare ``.jsonl`` of records or a
spec without ``targets:`` declares none.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from dsv4cp.records import AXES, META_FILE, read_meta
from dsv4cp.report.parity import failure_count, max_rel_error
from dsv4cp.report.tables import GIB, ok_points, point_labels, runs_of, varying_axes
from dsv4cp.targets import PAIR_METRICS, Target, parse_targets

MET, MISSED, NOT_APPLICABLE, INVALID = "met", "missed", "not applicable", "invalid"
VERDICTS: tuple[str, ...] = (MET, MISSED, INVALID, NOT_APPLICABLE)

SOURCES: dict[str, tuple[str, ...]] = {
    "time_ms": ("time_ms_median",), "imbalance": ("imbalance_max_over_mean",), "peak_gib": ("peak_allocated_bytes",),
    "exposed_comm_fraction": ("comm_ms", "exposed_comm_ms"), "time_ratio": ("time_ms_median",),
    "memory_ratio": ("peak_allocated_bytes",), "scaling_efficiency": ("time_ms_median",),
}
"""A target metric -> the record columns it is computed from (default: the column of its name)."""

COLUMNS: tuple[str, ...] = (
    "run", "target", "rule", "point", "point_id", "partner_id", "measured", "verdict", "miss_pct", "reason",
)
"""``rule``: the target in words; ``point``/``point_id``: the point judged (a pair metric: its numerator
point; ``partner_id`` the denominator's); ``miss_pct``: how far past the value a missed target is, in %
of the value; ``reason``: why a target is not applicable, or ``invalid``: which value it would be judged
on cannot be a measurement, and why (a NaN or impossible value is never met)."""

_NEEDS = {
    "exposed_comm_fraction": "not profiled (sweep --profile measures communication)",
    "parity_failures": "not checked (sweep --check compares with CP = 1)",
    "parity_max_rel_error": "not checked (sweep --check compares with CP = 1)",
    "mfu": "no MFU off GPU (the ceiling is a GPU's)",
}
"""Why a metric can be missing from a measured point."""


def _missing(metric: str, point: pd.Series) -> str:
    """Why a measured point holds no value of ``metric``."""
    if metric in ("exposed_comm_fraction", "parity_failures", "parity_max_rel_error"):
        if point.get("emulated_rank") is not None and not pd.isna(point.get("emulated_rank")):
            return "an emulated rank: its collectives move nothing, it is compute only"
        if int(point["cp"]) == 1:
            return "CP = 1: nothing to communicate or compare"
    return _NEEDS.get(metric, f"the record holds no {metric}")


def declared_targets(df: pd.DataFrame) -> dict[str, tuple[Target, ...]]:
    """Per run: the targets of its spec (from ``RUN_DIR/meta.json``; none for a bare ``.jsonl``);
    ``ValueError`` naming the file and the target when one is malformed."""
    out = {}
    for run, group in df.groupby("run", sort=False):
        path = Path(str(group["run_path"].iloc[0]))
        spec = read_meta(path).get("spec") if (path / META_FILE).is_file() else None
        try:
            out[run] = parse_targets(spec.get("targets")) if isinstance(spec, dict) else ()
        except ValueError as err:  # a hand-edited meta.json: say which run holds it
            raise ValueError(f"{path / META_FILE}: spec.{err}") from None
    return out


def _peak_gib(point: pd.Series) -> float:
    values = point["peak_allocated_bytes"]
    known = [v for v in values if v is not None] if isinstance(values, list) else []
    return max(known) / GIB if known else math.nan


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def point_metric(metric: str, point: pd.Series) -> float:
    """A point metric of one record (NaN when the record lacks it)."""
    if metric == "time_ms":
        return _number(point["time_ms_median"])
    if metric == "imbalance":
        return _number(point["imbalance_max_over_mean"])
    if metric == "peak_gib":
        return _peak_gib(point)
    if metric == "exposed_comm_fraction":
        comm, exposed = _number(point["comm_ms"]), _number(point["exposed_comm_ms"])
        return exposed / comm if comm > 0 else math.nan
    if metric == "parity_failures":
        return failure_count(point["parity"])
    if metric == "parity_max_rel_error":
        return max_rel_error(point["parity"])
    return _number(point[metric])  # measured_over_bound, tflops_per_gpu, mfu: record columns


def pair_metric(metric: str, numerator: pd.Series, denominator: pd.Series) -> float:
    """A pair metric of two records."""
    t_num, t_den = _number(numerator["time_ms_median"]), _number(denominator["time_ms_median"])
    if metric == "time_ratio":
        return t_num / t_den
    if metric == "memory_ratio":
        return _peak_gib(numerator) / _peak_gib(denominator)
    return t_den * int(denominator["cp"]) / (t_num * int(numerator["cp"]))  # scaling_efficiency


def _miss_pct(target: Target, measured: float) -> float:
    scale = abs(target.value) if target.value != 0 else 1.0
    return 100.0 * abs(measured - target.value) / scale


def _partner(points: pd.DataFrame, point: pd.Series, target: Target) -> pd.Series | None:
    """The measured point equal to ``point`` on every axis but the pair's (and ``tokens_per_rank`` when
    the pair is on ``cp``), holding the denominator value."""
    axis, _, denominator = target.pair
    free = {axis, "tokens_per_rank"} if axis == "cp" else {axis}
    same = pd.Series(True, index=points.index)
    for name in AXES:
        if name not in free:
            same &= points[name].map(str) == str(point[name])
    same &= points[axis] == denominator
    matches = points[same]
    return matches.iloc[-1] if len(matches) else None


def _invalid_source(metric: str, points: list[pd.Series]) -> str | None:
    """Why a target's value would be computed from an impossible value (``load_runs`` blanked it and named it
    in the record's ``invalid``), or None."""
    for point in points:
        invalid = point.get("invalid")
        if not isinstance(invalid, dict):
            continue
        for column in SOURCES.get(metric, (metric,)):
            if column in invalid:
                return f"point {point['point_id']}: {column}: {invalid[column]}"
    return None


def evaluate(df: pd.DataFrame, declared: dict[str, tuple[Target, ...]] | None = None) -> pd.DataFrame:
    """Every declared target of every run judged on that run's measured points (``COLUMNS``).
    ``declared``: the targets per run (default: :func:`declared_targets`)."""
    declared = declared_targets(df) if declared is None else declared
    points_all = ok_points(df)
    axes = varying_axes(points_all)
    rows = []
    for run in runs_of(df):
        points = points_all[points_all["run"] == run]
        labels = point_labels(points, [a for a in axes if a != "run"]) if len(points) else pd.Series(dtype=object)
        for target in declared.get(run, ()):
            base = {"run": run, "target": target.name, "rule": target.describe()}
            kept = points[points.apply(lambda p, t=target: t.applies_to(p), axis=1)] if len(points) else points
            if target.metric in PAIR_METRICS:
                kept = kept[kept[target.pair[0]] == target.pair[1]]
            if kept.empty:
                rows.append({**base, "verdict": NOT_APPLICABLE, "reason": "no measured point it applies to"})
                continue
            for index, point in kept.iterrows():
                row = {**base, "point": labels[index], "point_id": point["point_id"]}
                if target.metric in PAIR_METRICS:
                    partner = _partner(points, point, target)
                    if partner is None:
                        rows.append({**row, "verdict": NOT_APPLICABLE,
                                     "reason": f"no measured partner with {target.pair[0]} = {target.pair[2]}"})
                        continue
                    row["partner_id"] = partner["point_id"]
                    measured = pair_metric(target.metric, point, partner)
                else:
                    partner, measured = None, point_metric(target.metric, point)
                broken = _invalid_source(target.metric, [point] if partner is None else [point, partner])
                if broken is not None:
                    rows.append({**row, "verdict": INVALID, "reason": broken})
                    continue
                if math.isnan(measured):
                    rows.append({**row, "verdict": NOT_APPLICABLE, "reason": _missing(target.metric, point)})
                    continue
                verdict = MET if target.met(measured) else MISSED
                rows.append({**row, "measured": measured, "verdict": verdict,
                             "miss_pct": _miss_pct(target, measured) if verdict == MISSED else math.nan})
    return pd.DataFrame(rows, columns=list(COLUMNS))
