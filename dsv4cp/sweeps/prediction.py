"""Predicted CP steps for measured records (:mod:`dsv4cp.model.step_prediction`), beside what was measured.

Two kinds of record give each rank's compute:

* a real CP run profiled with a trace (``phases``): a rank's compute is its busy plus idle device time per
  step (``total`` row), so the host's gaps stay in it as they do in an emulated step; the measured step is
  the record's median, so the prediction is checked like with like (same commit, same run);
* an all-ranks emulation summary (``emulated_rank`` ``"all"``): each rank's emulated step time, which holds no
  communication; there is no measured step to check against, only the prediction.

Each record's layout (batch, split, cp) is rebuilt from its axes exactly as the measurement built it.
"""

from __future__ import annotations

import math

import pandas as pd

from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.model import Machine, estimate
from dsv4cp.model.costs import measured_phase
from dsv4cp.model.step_prediction import StepPrediction, predict_step
from dsv4cp.packing import PackedSeqs
from dsv4cp.records import AXES, STATUS_OK, point_id
from dsv4cp.sweeps.measure import point_inputs
from dsv4cp.sweeps.spec import ALL_RANKS, make_point

COLUMNS = ("point_id", "label", "source", "cp", "overlap", "partition", "measured_ms", "predicted_ms",
           "error_pct", "slowest_rank", "max_exposed_comm_ms", "max_comm_ms", "cp1_ms", "predicted_over_cp1")


def traced_compute(phases: list[dict], cp: int) -> tuple[list[float], dict[tuple[int, str, str], float]]:
    """Per rank, busy + idle device milliseconds per step (the ``total`` rows of a record's ``phases``) and
    the measured compute of every model phase, keyed ``(rank, phase, direction)`` as
    :func:`dsv4cp.model.measured_phase` pairs ranges with phases (the loss's ``indexer.score`` ranges under
    ``indexer.loss``; the top-k's scoring is inside ``indexer.topk``)."""
    totals: dict[int, float] = {}
    per_phase: dict[tuple[int, str, str], float] = {}
    for row in phases:
        rank = int(row["rank"])
        if row["phase"] == "total":
            totals[rank] = float(row["compute_ms"]) + float(row["idle_ms"])
            continue
        phase = measured_phase(row["phase"])
        if phase is not None:
            key = (rank, *phase)
            per_phase[key] = per_phase.get(key, 0.0) + float(row["compute_ms"])
    missing = [rank for rank in range(cp) if rank not in totals]
    if missing:
        raise ValueError(f"phases: no 'total' row for rank(s) {missing}")
    return [totals[rank] for rank in range(cp)], per_phase


def predict_record(record: dict, machine: Machine) -> StepPrediction | None:
    """The predicted step of one record, or None when it gives no per-rank compute (cp 1, an unprofiled real
    run, a single emulated rank)."""
    if record.get("status") != STATUS_OK or (record.get("cp") or 1) < 2:
        return None
    emulated = record.get("emulated_rank")
    if emulated == ALL_RANKS:
        compute, per_phase = list(record["rank_time_ms_median"]), None
    elif emulated is None and record.get("phases"):
        compute, per_phase = traced_compute(record["phases"], record["cp"])
    else:
        return None
    axes = {name: record.get(name) for name in AXES if record.get(name) is not None}
    axes.pop("emulated_rank", None)
    axes.pop("tokens_per_rank", None)  # derived from tokens and cp
    point = make_point(axes)
    cfg, lengths = point_inputs(point)
    packed = PackedSeqs.from_lengths(lengths, total=point.tokens)
    split = RowSplit(tuple(record["split"])) if record.get("split") else RowSplit.equal(point.tokens, point.cp)
    est = estimate(cfg, point.ratio, packed, point.cp, machine, split=split,
                   kernel_options=KernelOptions.resolve())  # as a point's bound is priced outside its measurement
    return predict_step(est, compute, overlap=point.overlap, direction=point.direction, phase_compute_ms=per_phase)


def prediction_frame(records: list[dict], machine: Machine) -> pd.DataFrame:
    """One row per record with a prediction (:data:`COLUMNS`); ``measured_ms`` and ``error_pct`` for real
    runs, ``cp1_ms`` / ``predicted_over_cp1`` where the records hold the same point at CP = 1."""
    cp1 = {_identity(r): r["time_ms_median"] for r in records
           if r.get("status") == STATUS_OK and r.get("cp") == 1 and r.get("emulated_rank") is None}
    rows = []
    for record in records:
        prediction = predict_record(record, machine)
        if prediction is None:
            continue
        real = record.get("emulated_rank") is None
        measured = record["time_ms_median"] if real else None
        base = cp1.get(_identity(record))
        rows.append({
            "point_id": record["point_id"], "label": _label(record), "source": "traced" if real else "emulated",
            "cp": record["cp"], "overlap": record["overlap"], "partition": record.get("partition", "equal"),
            "measured_ms": measured, "predicted_ms": prediction.step_ms,
            "error_pct": None if measured is None else 100.0 * (prediction.step_ms - measured) / measured,
            "slowest_rank": prediction.slowest_rank, "max_exposed_comm_ms": max(prediction.exposed_comm_ms),
            "max_comm_ms": max(prediction.comm_ms), "cp1_ms": base,
            "predicted_over_cp1": None if base is None else prediction.step_ms / base,
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _identity(record: dict) -> str:
    """The point without its cp, emulation or split policy: what a CP = 1 run shares with it (the id of
    its other axes, so a mapping value such as ``kernel_options`` keys it as the point id does)."""
    return point_id({**record, **dict.fromkeys(("cp", "tokens_per_rank", "emulated_rank", "partition", "overlap"))})


def _label(record: dict) -> str:
    tokens = record["tokens"]
    size = f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)
    recompute = " recompute" if record.get("recompute") else ""
    return f"{record['preset']} r{record['ratio']} {size} {record['packing']} {record['pass']}{recompute}"


def worst_error_pct(frame: pd.DataFrame) -> float:
    """The largest absolute prediction error over the rows with a measured step (nan when none)."""
    errors = frame["error_pct"].dropna().abs()
    return float(errors.max()) if len(errors) else math.nan
