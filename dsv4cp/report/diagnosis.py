"""Diagnosis of every profiled point: where each rank's step goes beyond the model's bound (docs/design.md §5).

Per (point, rank), from the point's traces (``RUN_DIR/traces/<point_id>/rank{R}.json``) and its record:

    step_ms = bound_ms + kernel_excess_ms + padding_ms + imbalance_wait_ms + exposed_comm_ms
              + host_idle_ms + unattributed_ms

* ``step_ms``: the traced step (the ``dsv4cp.step`` range, per step; a profiled step runs slower than
  the timed median).
* ``bound_ms``: the cost model's compute bound of the rank's own work without capacity padding;
  ``padding_ms``: the modelled compute on the gathered buffer's capacity padding (the padded bound
  minus the unpadded one). Both come from :func:`dsv4cp.report.tables.point_estimate` at the default
  machine's ceilings, scaled so the slowest rank's padded bound equals the record's ``bound_measured_ms`` (its
  ``bound_ms`` where it has none; a
  sweep run with ``--machine cpu`` recorded bounds at other ceilings; ``bound_scale`` says by how much).
* ``kernel_excess_ms``: measured compute minus ``bound_ms`` minus ``padding_ms``; split per phase
  class (a phase and direction, e.g. ``indexer.topk.fwd``) in ``diagnosis_phases``. A class pairs the
  ranges that time a model phase's work with the bounds of the model phases they time
  (:func:`dsv4cp.model.measured_phase`, :func:`dsv4cp.model.phase_measured_in`): ``indexer.topk.fwd``
  faces the model's ``indexer.score.fwd`` + ``indexer.topk.fwd`` (the top-k scores and selects in one
  range), ``indexer.loss.D`` holds the ``indexer.score.D`` ranges too (the loss's scores).
* ``imbalance_wait_ms``, ``exposed_comm_ms``, ``host_idle_ms``:
  :func:`dsv4cp.profiling.overlap.step_decomposition` (collectives matched across ranks by order: the
  shortest rank's duration is the transfer, the rest of a longer one is waiting for a slower peer).
* ``unattributed_ms``: what is left (rounding; on an emulated rank, every communication-only instant).

An emulated record (``emulated_rank`` set: one rank measured alone, collectives replaced by no-ops)
is compute-only: its wait and communication parts are NaN and its ``kind`` says so.
The largest part above the bound is the cause the summary names, with the phase behind it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from dsv4cp.model import BOTH, COMM_PHASES, DIRECTIONS, measured_phase, phase_measured_in
from dsv4cp.profiling.nvtx import full_name
from dsv4cp.profiling.overlap import TOTAL, UNATTRIBUTED, step_decomposition
from dsv4cp.profiling.trace import RANGE_PREFIX
from dsv4cp.report.load import load_trace
from dsv4cp.report.tables import MODEL_AXES, ok_points, point_estimate, point_labels, varying_axes

STEP_RANGE = full_name("step")
STEP_OWN = "step (own)"
"""Phase class of work inside the step range but outside every named phase (glue between phases)."""
NO_RANGE = "(no range)"
"""Phase class of work outside every range."""

PARTS: tuple[str, ...] = (
    "bound_ms", "kernel_excess_ms", "padding_ms", "imbalance_wait_ms", "exposed_comm_ms", "host_idle_ms",
    "unattributed_ms",
)
"""The parts of ``step_ms``, in the order of the definition."""

CAUSES: dict[str, str] = {
    "kernel_excess_ms": "kernel excess", "padding_ms": "capacity padding", "imbalance_wait_ms": "imbalance wait",
    "exposed_comm_ms": "exposed communication", "host_idle_ms": "host idle (no kernel running)",
    "unattributed_ms": "unattributed time",
}
"""The parts above the bound -> how the summary names them."""

MEASURED = "measured"
EMULATED = "emulated rank (compute only)"

RANK_COLUMNS: tuple[str, ...] = (
    "point_id", "rank", "kind", "steps", "step_ms", *PARTS, "unmatched_comm_ms", "bound_scale", "cause", "cause_ms",
    "cause_share", "cause_phase", "cause_phase_over_bound", "step_own_ms", "step_own_top",
)
PHASE_COLUMNS: tuple[str, ...] = (
    "point_id", "rank", "phase", "compute_ms", "bound_ms", "padding_ms", "excess_ms", "measured_over_bound",
)
STRAGGLER_COLUMNS: tuple[str, ...] = (
    "point_id", "phase", "mean_ms", "max_ms", "max_over_mean", "slowest_rank",
)
STEP_OWN_TOP = 3
"""Operations named for the step range's own time."""


# ------------------------------------------------------------------------------------- the bound
def phase_class(range_name: str) -> str:
    """The phase class of a range: the model phase and direction whose bound its compute faces
    (:func:`dsv4cp.model.measured_phase`: ``dsv4cp.indexer.score.bwd`` -> ``indexer.loss.bwd``), else
    (communication, ranges the model has no phase for) its name without the domain."""
    if range_name == STEP_RANGE:
        return STEP_OWN
    if range_name == UNATTRIBUTED:
        return NO_RANGE
    mapped = measured_phase(range_name)
    if mapped is not None and mapped[0] not in COMM_PHASES:
        return ".".join(mapped)
    return range_name.removeprefix(RANGE_PREFIX)


def rank_bounds(point: pd.Series) -> tuple[pd.DataFrame, float]:
    """Per (rank, compute phase class) of the point's pass: the model's bound without padding and
    the padding's modelled time (ms), summed over the model phases the class's ranges time
    (:func:`dsv4cp.model.phase_measured_in`), and the scale applied (see the module docstring)."""
    padded, unpadded = point_estimate(point), point_estimate(point, padding=False)
    direction = point["pass"]
    directions = DIRECTIONS if direction == BOTH else (direction,)
    recomputed = padded.summary(direction).bound_overlap_s * 1e3
    recorded = point.get("bound_measured_ms")  # the record's bound at record_machine's ceilings, as recomputed
    if not isinstance(recorded, (int, float)) or pd.isna(recorded):
        recorded = point.get("bound_ms")
    scale = 1.0
    if isinstance(recorded, (int, float)) and recorded > 0 and recomputed > 0:
        scale = float(recorded) / recomputed
    rows = []
    for with_padding, without in zip(padded.records.itertuples(), unpadded.records.itertuples()):
        if with_padding.phase in COMM_PHASES or with_padding.direction not in directions:
            continue
        bound = without.time_lower_bound_s * 1e3 * scale
        rows.append({"rank": with_padding.rank,
                     "phase": ".".join(phase_measured_in(with_padding.phase, with_padding.direction)),
                     "bound_ms": bound, "padding_ms": with_padding.time_lower_bound_s * 1e3 * scale - bound})
    bounds = pd.DataFrame(rows, columns=["rank", "phase", "bound_ms", "padding_ms"])
    return bounds.groupby(["rank", "phase"], as_index=False, sort=False)[["bound_ms", "padding_ms"]].sum(), scale


# ------------------------------------------------------------------------------------- one point
def diagnose(point: pd.Series, kernels: list, ranges: list) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-rank diagnosis (``RANK_COLUMNS``) and the per-phase compute against its bound
    (``PHASE_COLUMNS``) of one profiled point from its trace records (``dsv4cp.report.load_trace``)."""
    decomposition, compute = step_decomposition(kernels, ranges, STEP_RANGE)
    bounds, scale = rank_bounds(point)
    compute = compute.assign(phase=compute["phase"].map(phase_class))
    measured = compute.groupby(["rank", "phase"], as_index=False, sort=False)["compute_ms"].sum()
    phases = measured.merge(bounds[bounds["rank"].isin(decomposition["rank"])], on=["rank", "phase"], how="outer")
    phases = phases.fillna({"compute_ms": 0.0, "bound_ms": 0.0, "padding_ms": 0.0})
    phases["excess_ms"] = phases["compute_ms"] - phases["bound_ms"] - phases["padding_ms"]
    modelled = phases["bound_ms"] + phases["padding_ms"]
    phases["measured_over_bound"] = (phases["compute_ms"] / modelled).where(modelled > 0)
    phases.insert(0, "point_id", point["point_id"])
    emulated = point.get("emulated_rank") is not None and not pd.isna(point.get("emulated_rank"))
    rows = []
    for part in decomposition.itertuples(index=False):
        mine = phases[phases["rank"] == part.rank]
        bound, padding = float(mine["bound_ms"].sum()), float(mine["padding_ms"].sum())
        wait, exposed = part.imbalance_wait_ms, part.exposed_comm_ms
        leftover = part.step_ms - part.compute_ms - wait - exposed - part.host_idle_ms
        if emulated:  # its collectives moved nothing: communication-only time is not a transfer
            leftover, wait, exposed = leftover + wait + exposed, math.nan, math.nan
        own = compute[(compute["rank"] == part.rank) & (compute["phase"] == STEP_OWN)].nlargest(STEP_OWN_TOP,
                                                                                                 "compute_ms")
        row = {
            "point_id": point["point_id"], "rank": part.rank, "kind": EMULATED if emulated else MEASURED,
            "steps": part.steps, "step_ms": part.step_ms, "bound_ms": bound,
            "kernel_excess_ms": part.compute_ms - bound - padding, "padding_ms": padding,
            "imbalance_wait_ms": wait, "exposed_comm_ms": exposed, "host_idle_ms": part.host_idle_ms,
            "unattributed_ms": leftover, "unmatched_comm_ms": math.nan if emulated else part.unmatched_comm_ms,
            "bound_scale": scale, "step_own_ms": float(mine.loc[mine["phase"] == STEP_OWN, "compute_ms"].sum()),
            "step_own_top": ", ".join(f"{k} {t:.3g} ms" for k, t in zip(own["kernel"], own["compute_ms"])),
        }
        row.update(_cause(row, mine, point, part.rank))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(RANK_COLUMNS)), phases[list(PHASE_COLUMNS)]


def _cause(row: dict, phases: pd.DataFrame, point: pd.Series, rank: int) -> dict:
    """The largest part above the bound, its share of the gap and the phase behind it."""
    gap = row["step_ms"] - row["bound_ms"]
    parts = {p: row[p] for p in CAUSES if not math.isnan(row[p])}
    cause = max(parts, key=parts.get)
    out = {"cause": CAUSES[cause], "cause_ms": parts[cause], "cause_share": parts[cause] / gap if gap > 0 else math.nan,
           "cause_phase": "", "cause_phase_over_bound": math.nan}
    if cause in ("kernel_excess_ms", "padding_ms") and len(phases):
        top = phases.loc[phases["excess_ms" if cause == "kernel_excess_ms" else "padding_ms"].idxmax()]
        out.update(cause_phase=top["phase"], cause_phase_over_bound=top["measured_over_bound"])
    elif cause in ("exposed_comm_ms", "imbalance_wait_ms", "host_idle_ms"):
        column = "idle_ms" if cause == "host_idle_ms" else "comm_ms"
        recorded = [p for p in point["phases"]
                    if p.get("rank", 0) == rank and p.get("phase") not in (TOTAL, STEP_RANGE)]
        if recorded:
            top = max(recorded, key=lambda p: p.get(column) or 0.0)
            out["cause_phase"] = phase_class(top["phase"])
    return out


# ------------------------------------------------------------------------------------- every point
def trace_directory(point: pd.Series) -> Path | None:
    """``RUN_DIR/traces/<point_id>`` of a record read from a run directory, when it holds a trace."""
    run_path = point.get("run_path")
    if not isinstance(run_path, str):
        return None
    directory = Path(run_path) / "traces" / str(point["point_id"])
    return directory if directory.is_dir() and any(directory.glob("rank*.json*")) else None


def diagnosis_tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """``diagnosis`` (one row per profiled point and rank), ``diagnosis_phases`` (per point, rank and
    phase class) and ``stragglers`` (per CP > 1 point measured on every rank and phase class: max /
    mean over ranks of the phase's compute), each led by the points' varying axes. A point whose
    traces are missing (a bare ``.jsonl`` of records, a moved run) is left out."""
    points = ok_points(df).dropna(subset=list(MODEL_AXES))
    points = points[points["phases"].map(lambda p: isinstance(p, list))]
    axes = varying_axes(points)
    ranks, phases = [], []
    for _, point in points.iterrows():
        directory = trace_directory(point)
        if directory is None:
            continue
        rank_rows, phase_rows = diagnose(point, *load_trace(directory))
        for table, into in ((rank_rows, ranks), (phase_rows, phases)):
            for axis in reversed(axes):
                table.insert(0, axis, point[axis])
            into.append(table)
    rank_table = pd.concat(ranks, ignore_index=True) if ranks else pd.DataFrame(columns=[*axes, *RANK_COLUMNS])
    phase_table = pd.concat(phases, ignore_index=True) if phases else pd.DataFrame(columns=[*axes, *PHASE_COLUMNS])
    return {"diagnosis": rank_table, "diagnosis_phases": phase_table,
            "stragglers": stragglers(rank_table, phase_table, axes)}


def stragglers(ranks: pd.DataFrame, phases: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Per real CP > 1 point and phase class: mean and max over ranks of the phase's compute, their
    ratio and the rank at the max; the phases whose slowest rank is furthest above the mean first."""
    real = ranks[ranks["kind"] == MEASURED].groupby("point_id")["rank"].nunique()
    rows = []
    for point_id, group in phases[phases["point_id"].isin(real[real > 1].index)].groupby("point_id", sort=False):
        first = group.iloc[0]
        for phase, by_rank in group.groupby("phase", sort=False):
            mean, peak = float(by_rank["compute_ms"].mean()), float(by_rank["compute_ms"].max())
            rows.append({**{a: first[a] for a in axes}, "point_id": point_id, "phase": phase, "mean_ms": mean,
                         "max_ms": peak, "max_over_mean": peak / mean if mean > 0 else math.nan,
                         "slowest_rank": int(by_rank.loc[by_rank["compute_ms"].idxmax(), "rank"])})
    out = pd.DataFrame(rows, columns=[*axes, *STRAGGLER_COLUMNS])
    order = (out["max_ms"] - out["mean_ms"]).sort_values(ascending=False, kind="stable").index
    return out.loc[order].reset_index(drop=True)


# ------------------------------------------------------------------------------------- text
def slowest_rank(ranks: pd.DataFrame) -> pd.Series:
    """The rank with the most time of its own (its step minus its wait for peers)."""
    own = ranks["step_ms"] - ranks["imbalance_wait_ms"].fillna(0.0)
    return ranks.loc[own.idxmax()]


def cause_text(ranks: pd.DataFrame) -> str:
    """One point's cause in words, from its ``diagnosis`` rows: the slowest rank's largest part above
    its bound with the phase behind it, and which ranks wait for it."""
    slow = slowest_rank(ranks)
    text = f"rank {int(slow['rank'])}: step {slow['step_ms']:.3g} ms, bound {slow['bound_ms']:.3g} ms; "
    share = slow["cause_share"]
    text += (f"{100 * share:.0f}% of the gap above the bound is {slow['cause']}" if not math.isnan(share)
             else f"{slow['cause']} {slow['cause_ms']:.3g} ms")
    if slow["cause_phase"]:
        ratio = slow["cause_phase_over_bound"]
        text += f", most in {slow['cause_phase']}" + (f" ({ratio:.3g}x its bound)" if not math.isnan(ratio) else "")
        if slow["cause_phase"] == STEP_OWN and slow["step_own_top"]:
            text += f" (outside the named phases: {slow['step_own_top']})"
    waiting = ranks[(ranks["rank"] != slow["rank"]) & (ranks["imbalance_wait_ms"] > 0)]
    if len(waiting):
        longest = waiting.loc[waiting["imbalance_wait_ms"].idxmax()]
        text += (f"; rank {int(longest['rank'])} waits {longest['imbalance_wait_ms']:.3g} ms for rank "
                 f"{int(slow['rank'])} (imbalance)")
    if (ranks["kind"] == EMULATED).any():
        text += " (emulated rank: compute only)"
    return text


def point_causes(ranks: pd.DataFrame) -> dict[str, str]:
    """``point_id`` -> :func:`cause_text` of every diagnosed point."""
    return {pid: cause_text(group) for pid, group in ranks.groupby("point_id", sort=False)}


def label_points(table: pd.DataFrame) -> pd.Series:
    """The points' labels from the axes columns a diagnosis table leads with."""
    axes = [c for c in table.columns if c not in (*RANK_COLUMNS, *PHASE_COLUMNS, *STRAGGLER_COLUMNS)]
    return point_labels(table, axes) if axes else table["point_id"]
