"""Each phase's achieved FLOP/s against its arithmetic intensity, under the machine's roofs.

Per profiled point, rank and compute phase of the cost model (forward and backward apart): the
model's FLOPs and HBM bytes of that rank's phase (:func:`dsv4cp.report.tables.point_estimate`), the
measured compute time of the ranges that time it (the record's ``phases``, per step), and from them
intensity = FLOPs / bytes and achieved = FLOPs / time. The roof at an intensity ``I`` is
``min(peak_flops, I * hbm_bandwidth)`` of :class:`dsv4cp.model.Machine`; the ceilings are the H200
ones (the ``h200x2`` preset) for GPU points; a CPU point's host ceilings are not recorded, so its
roof is left blank. Communication phases (no FLOPs) have no intensity and are left out.

A row is a measured key (:func:`dsv4cp.model.measured_phase`) with the FLOPs and bytes of every model phase
whose work its ranges time (:func:`dsv4cp.model.phase_measured_in`): ``indexer.topk fwd`` carries the
top-k's scoring (the model's ``indexer.score``, timed inside ``indexer.topk.fwd``) beside its selection,
and ``indexer.loss`` its time in the ``indexer.score`` ranges (the loss's scores).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dsv4cp.model import DIRECTIONS, PHASES, Machine, measured_phase, phase_measured_in
from dsv4cp.report import tables
from dsv4cp.report.styles import outside_legend, series_style

GPU_MACHINE = Machine.preset("h200x2")
"""Ceilings of GPU points' roofs (measured on H200)."""

MEASURED_COLUMNS: tuple[str, ...] = (
    "rank", "phase", "direction", "flops", "hbm_bytes", "measured_ms", "intensity_flop_per_byte",
    "achieved_tflops", "roof_tflops", "fraction_of_roof",
)


def _measured_ms(phases: list[dict]) -> dict[tuple[int, str, str], float]:
    """(rank, model phase, direction) -> compute ms per step summed over the ranges whose time faces its
    bound (:func:`dsv4cp.model.measured_phase`)."""
    out: dict[tuple[int, str, str], float] = {}
    for row in phases:
        mapped = measured_phase(str(row.get("phase")))
        compute = row.get("compute_ms")
        if mapped is None or compute is None or (isinstance(compute, float) and math.isnan(compute)):
            continue
        key = (int(row.get("rank", 0)), *mapped)
        out[key] = out.get(key, 0.0) + float(compute)
    return out


def model_work(table: pd.DataFrame) -> pd.DataFrame:
    """``rank, phase, direction, flops, hbm_bytes`` of the compute records of a cost-model table, summed
    per key their work is measured under (:func:`dsv4cp.model.phase_measured_in`), keys with FLOPs and
    bytes only."""
    table = table[table["resource"] == "compute"]
    keys = [phase_measured_in(p, d) for p, d in zip(table["phase"], table["direction"])]
    table = table.assign(phase=[p for p, _ in keys], direction=[d for _, d in keys])
    work = table.groupby(["rank", "phase", "direction"], as_index=False, sort=False)[["flops", "hbm_bytes"]].sum()
    return work[(work["flops"] > 0) & (work["hbm_bytes"] > 0)]


def roof_flops(machine: Machine, intensity: float | np.ndarray) -> float | np.ndarray:
    """The attainable FLOP/s at ``intensity`` FLOP/byte: ``min(peak, intensity * bandwidth)``."""
    return np.minimum(machine.peak_flops, np.asarray(intensity) * machine.hbm_bandwidth)


def roofline(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (profiled point, rank, compute phase, direction) with FLOPs and a measured time:
    the varying axes, then :data:`MEASURED_COLUMNS` (``fraction_of_roof`` = achieved / roof)."""
    points = tables.ok_points(df).dropna(subset=list(tables.MODEL_AXES))
    points = points[points["phases"].map(lambda p: isinstance(p, list)).astype(bool)]  # a mask even when empty
    axes = list(dict.fromkeys([*tables.varying_axes(points), "cp"]))
    rows = []
    for (_, point), cpu in zip(points.iterrows(), tables.on_cpu(points)):
        measured = _measured_ms(point["phases"])
        model = model_work(tables.point_estimate(point, GPU_MACHINE).table())
        for record in model.itertuples(index=False):
            ms = measured.get((int(record.rank), record.phase, record.direction))
            if ms is None or ms <= 0:
                continue
            intensity = record.flops / record.hbm_bytes
            achieved = record.flops / (ms / 1e3)
            roof = math.nan if cpu else float(roof_flops(GPU_MACHINE, intensity))
            rows.append({**{a: point[a] for a in axes}, "rank": int(record.rank), "phase": record.phase,
                         "direction": record.direction, "flops": record.flops, "hbm_bytes": record.hbm_bytes,
                         "measured_ms": ms, "intensity_flop_per_byte": intensity, "achieved_tflops": achieved / 1e12,
                         "roof_tflops": roof / 1e12, "fraction_of_roof": achieved / roof})
    return pd.DataFrame(rows, columns=[*axes, *MEASURED_COLUMNS])


def roofline_figure(df: pd.DataFrame, caption: str) -> Figure | None:
    """Achieved TFLOP/s against intensity (log-log), one marker series per phase and direction
    (every rank of every profiled GPU point), under the compute and bandwidth roofs. None without a
    profiled GPU point."""
    table = roofline(df).dropna(subset=["roof_tflops"])
    if table.empty:
        return None
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.subplots()
    fig.suptitle("Roofline of each phase", x=0.01, horizontalalignment="left")
    fig.supxlabel(caption, fontsize=8, color="dimgray")
    order = {phase: i for i, phase in enumerate(PHASES)} | {direction: i for i, direction in enumerate(DIRECTIONS)}
    table = table.sort_values(["phase", "direction"], key=lambda column: column.map(order), kind="stable")
    for i, ((phase, direction), group) in enumerate(table.groupby(["phase", "direction"], sort=False)):
        style = series_style(i)
        ax.scatter(group["intensity_flop_per_byte"], group["achieved_tflops"], color=style.color,
                   marker=style.marker, s=22, label=f"{phase} {direction}")
    low = table["intensity_flop_per_byte"].min() / 2
    ridge = GPU_MACHINE.peak_flops / GPU_MACHINE.hbm_bandwidth
    high = max(table["intensity_flop_per_byte"].max() * 2, ridge * 4)
    x = np.geomspace(low, high, 200)
    ax.plot(x, roof_flops(GPU_MACHINE, x) / 1e12, color="black", linewidth=1.2)
    ax.annotate(f"compute roof {GPU_MACHINE.peak_flops / 1e12:.0f} TFLOP/s", (high, GPU_MACHINE.peak_flops / 1e12),
                textcoords="offset points", xytext=(-4, 4), ha="right", fontsize=7)
    ax.annotate(f"HBM roof {GPU_MACHINE.hbm_bandwidth / 1e12:.2f} TB/s", (low, low * GPU_MACHINE.hbm_bandwidth / 1e12),
                textcoords="offset points", xytext=(4, 6), ha="left", fontsize=7, rotation=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (model FLOP per model HBM byte)")
    ax.set_ylabel("achieved TFLOP/s (model FLOPs / measured compute time)")
    outside_legend(fig, ax)
    return fig
