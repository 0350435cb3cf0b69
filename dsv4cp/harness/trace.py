"""Trace pass: a Kineto trace of a Case's step on every rank, and the tables read from it.

Run after the timed steps (no profiler is attached while timing): ``steps`` steps recorded per rank (one
profiled warm-up step discarded first) into ``trace_dir/rank<r>.json``, then, on the rank that reads them
(rank 0, or the emulated rank, whose trace is the only one), the per-phase overlap table
(``overlap.csv``), the per-rank attribution of the step's time (``attribution.csv``) and the kernels
(``kernels.csv``) beside the traces. Times in the overlap and attribution tables are per step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch.distributed as dist

from dsv4cp.cp.emulate import emulated_rank
from dsv4cp.profiling.nvtx import full_name
from dsv4cp.profiling.overlap import TOTAL, attribution_table, kernel_table, overlap_table
from dsv4cp.profiling.trace import POINT_FILE, capture_trace, load_kineto_dir

PER_STEP_COLUMNS = ("compute_ms", "comm_ms", "overlap_ms", "exposed_comm_ms", "idle_ms")
"""Overlap-table columns summed over the traced steps; divided by their number in the record."""


@dataclass(frozen=True)
class TraceTables:
    """What :func:`trace_step` read from the traces (on the reading rank; empty on the others)."""

    overlap: pd.DataFrame | None = None
    """The per-phase overlap table, per step."""
    attribution: pd.DataFrame | None = None
    """Per rank, the step's unattributed and idle time, per step."""
    metrics: dict = field(default_factory=dict)
    """``phases`` (the overlap table's rows) and, for real ranks, ``exposed_comm_ms``, ``comm_ms`` and
    ``overlap_ratio`` of rank 0's whole step (``dsv4cp.records.METRICS`` names)."""


def trace_step(step: Callable[[], object], trace_dir: str | Path, *, steps: int, group: dist.ProcessGroup | None,
               trace_point: Mapping | None = None) -> TraceTables:
    """Record ``steps`` calls of ``step`` on this rank of ``group`` (None: one process) under ``trace_dir``
    and read the tables (module docstring). ``trace_point``: the point's axes, written beside the traces
    (``POINT_FILE``) so a calibration from the trace checks the point its phase times belong to."""
    rank = dist.get_rank(group) if group is not None else 0
    emulated = emulated_rank(group)
    capture_trace(step, trace_dir, steps=steps, warmup=1, rank=rank)
    if group is not None:
        dist.barrier(group)  # every rank's file is written before the reading rank reads them
    reader = emulated if emulated is not None else 0  # an emulated rank wrote the only trace
    if rank != reader:
        return TraceTables()
    trace_dir = Path(trace_dir)
    kernels, ranges = load_kineto_dir(trace_dir)  # parsed once for the three tables
    overlap = per_step(overlap_table(kernels, ranges), steps)
    overlap.to_csv(trace_dir / "overlap.csv", index=False)
    if trace_point is not None:
        (trace_dir / POINT_FILE).write_text(json.dumps(trace_point) + "\n")
    attribution = attribution_table(kernels, ranges, step_range=full_name("step"))
    attribution.to_csv(trace_dir / "attribution.csv", index=False)
    kernel_table(kernels, ranges).to_csv(trace_dir / "kernels.csv", index=False)
    metrics: dict = {"phases": overlap.to_dict(orient="records")}
    if emulated is None:  # an emulated rank's collectives move nothing: no communication to report
        total = overlap[(overlap["rank"] == 0) & (overlap["phase"] == TOTAL)].iloc[0]
        metrics.update(exposed_comm_ms=float(total["exposed_comm_ms"]), comm_ms=float(total["comm_ms"]),
                       overlap_ratio=_float_or_none(total["overlap_ratio"]))
    return TraceTables(overlap, attribution, metrics)


def per_step(table: pd.DataFrame, steps: int) -> pd.DataFrame:
    """``table`` (an overlap table summed over ``steps`` traced steps) with its summed times per step."""
    table = table.copy()
    for column in PER_STEP_COLUMNS:
        table[column] = table[column] / steps
    return table


def _float_or_none(value) -> float | None:
    value = float(value)
    return None if np.isnan(value) else value
