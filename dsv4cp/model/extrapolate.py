"""Extrapolation over CP sizes and batch sizes, and comparison of measurements with the bounds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from dsv4cp.config import DSv4Config
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.costs import LayerEstimate, estimate, measured_phase, phase_measured_in
from dsv4cp.model.machine import Machine, resolve_machine
from dsv4cp.workloads import pack_lengths

DEFAULT_CPS = (8, 16, 32, 64)
DEFAULT_TOKENS = (1 << 16, 1 << 18, 1 << 20)

EXTRAPOLATE_COLUMNS: tuple[str, ...] = (
    "cp", "tokens", "tokens_per_rank", "docs", "direction", "attention_s", "compute_s", "comm_s",
    "comm_bytes_per_rank", "comm_over_attention", "comm_over_compute", "comm_exceeds_attention",
    "comm_exceeds_compute", "bound_overlap_s", "bound_serial_s", "flops_imbalance", "time_imbalance",
    "tflops_per_gpu_at_bound",
)
"""Columns of :func:`extrapolate`, in order."""


def extrapolate(
    cfg: DSv4Config, ratio: int, packing: str = "one", cps: Iterable[int] = DEFAULT_CPS,
    tokens: Iterable[int] = DEFAULT_TOKENS, machine: Machine | None = None, *,
    tokens_per_rank: Iterable[int] | None = None, doc_len: int | None = 4096, seed: int = 0,
    direction: str = "fwd", kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> pd.DataFrame:
    """Model a layer over a grid of CP sizes and batch sizes: where does communication take over?

    Strong scaling over ``tokens`` (total tokens per batch), or weak scaling when ``tokens_per_rank``
    is given (total = tokens_per_rank x cp). Batches come from :func:`dsv4cp.workloads.pack_lengths`
    (``packing``, ``doc_len`` for ``fixed``, ``seed`` for the histograms), one per total. Points the
    layout cannot run (total not divisible by cp, fewer rows per rank than the halo) are left out.

    Columns :data:`EXTRAPOLATE_COLUMNS`; times are lower bounds in seconds of the slowest rank
    (compute and comm maxima may come from different ranks). ``comm_over_attention`` compares the
    communication bound with the sparse-attention bound alone (the comparison of where CP time goes),
    ``comm_over_compute`` with the rank's whole compute bound.
    """
    machine = resolve_machine(machine)
    points: list[tuple[int, int]] = []
    for cp in cps:
        totals = (int(t) * cp for t in tokens_per_rank) if tokens_per_rank is not None else tokens
        points.extend((int(cp), int(total)) for total in totals)
    cache: dict[int, list[int]] = {}
    rows = []
    for cp, total in points:
        if total % cp or total // cp < _halo_needed(cfg, ratio):
            continue
        if total not in cache:
            cache[total] = pack_lengths(total, packing, doc_len=doc_len, seed=seed)
        est = estimate(cfg, ratio, cache[total], cp, machine, kernel_options=kernel_options)
        rec = est.summary(direction).as_record()
        attention, compute, comm = rec["attention_s"], rec["compute_s"], rec["comm_s"]
        rows.append({
            "cp": cp, "tokens": total, "tokens_per_rank": total // cp, "docs": est.counts.n_docs,
            "direction": direction, "attention_s": attention, "compute_s": compute, "comm_s": comm,
            "comm_bytes_per_rank": rec["comm_bytes_per_rank"],
            "comm_over_attention": comm / attention if attention > 0 else float("nan"),
            "comm_over_compute": comm / compute if compute > 0 else float("nan"),
            "comm_exceeds_attention": comm > attention, "comm_exceeds_compute": comm > compute,
            "bound_overlap_s": rec["bound_overlap_s"], "bound_serial_s": rec["bound_serial_s"],
            "flops_imbalance": rec["flops_imbalance"], "time_imbalance": rec["time_imbalance"],
            "tflops_per_gpu_at_bound": rec["tflops_per_gpu_at_bound"],
        })
    return pd.DataFrame(rows, columns=list(EXTRAPOLATE_COLUMNS))


def _halo_needed(cfg: DSv4Config, ratio: int) -> int:
    from dsv4cp.cp.layout import halo_rows

    return halo_rows(cfg, ratio, 2)


def measured_vs_bound(
    measured: float | Sequence[float] | Mapping[str, float] | pd.DataFrame, est: LayerEstimate,
    direction: str = "fwd",
) -> dict | pd.DataFrame:
    """Set measurements beside the model's lower bounds.

    ``measured`` may be:

    * a layer time in seconds (the max over ranks, as docs/design.md §5 times a repetition) or a sequence of
      per-rank times: returns a dict with the bounds, ``efficiency`` = bound with overlap / measured
      (<= 1 when the model holds), the gap to the serial bound, model TFLOPs/GPU at the measured time
      and, for per-rank input, the measured time imbalance beside the modelled one;
    * a mapping ``phase -> seconds`` (slowest rank) for ``direction``, keyed by the model's phases, each
      against its own bound (a measured top-k time holds the scoring too: it faces ``indexer.score`` +
      ``indexer.topk``, which the breakdown form below pairs for it): returns a DataFrame per phase;
    * a breakdown table in the profiling overlap-table schema (columns ``rank, phase, compute_ms,
      comm_ms``; phases are NVTX range names such as ``dsv4cp.allgather.kv.launch``): ranges map to
      the ``(phase, direction)`` whose bound they face (:func:`~dsv4cp.model.costs.measured_phase`) and
      their compute + comm times are summed per rank; returns a DataFrame per (rank, phase, direction)
      with measured and bound seconds and their ratio, the bound summed over the model phases measured
      under that key (:func:`~dsv4cp.model.costs.phase_measured_in`: ``indexer.topk`` fwd holds the
      top-k's scoring, ``indexer.score``, too).
    """
    if isinstance(measured, pd.DataFrame):
        return _breakdown_vs_bound(measured, est)
    if isinstance(measured, Mapping):
        bounds = est.phase_table(direction).set_index("phase")
        rows = []
        for phase, seconds in measured.items():
            if phase not in bounds.index:
                raise ValueError(f"measured: phase {phase!r} has no {direction} record in this layer")
            bound = float(bounds.loc[phase, "max_rank_bound_s"])
            rows.append({"phase": phase, "direction": direction, "measured_s": float(seconds),
                         "bound_s": bound, "efficiency": bound / seconds if seconds > 0 else float("nan")})
        return pd.DataFrame(rows)
    per_rank = None
    if isinstance(measured, (int, float, np.floating, np.integer)):
        seconds = float(measured)
    else:
        per_rank = [float(v) for v in measured]
        if len(per_rank) != est.cp:
            raise ValueError(f"measured: expected {est.cp} per-rank times, got {len(per_rank)}")
        seconds = max(per_rank)
    if not seconds > 0:
        raise ValueError(f"measured: must be a positive time in seconds, got {measured!r}")
    s = est.summary(direction)
    out = {
        **est.setup(), "direction": direction, "measured_s": seconds,
        "bound_overlap_s": s.bound_overlap_s, "bound_serial_s": s.bound_serial_s,
        "efficiency": s.bound_overlap_s / seconds, "serial_efficiency": s.bound_serial_s / seconds,
        "model_tflops_per_gpu": s.model_tflops_per_gpu(seconds),
        "model_time_imbalance": s.time_imbalance, "model_flops_imbalance": s.flops_imbalance,
    }
    if per_rank is not None:
        mean = float(np.mean(per_rank))
        out["measured_time_imbalance"] = seconds / mean if mean > 0 else 1.0
    return out


def _breakdown_vs_bound(table: pd.DataFrame, est: LayerEstimate) -> pd.DataFrame:
    missing = {"rank", "phase", "compute_ms", "comm_ms"} - set(table.columns)
    if missing:
        raise ValueError(f"measured: breakdown table lacks columns {sorted(missing)}")
    mapped = table["phase"].map(lambda name: measured_phase(str(name)))
    keep = mapped.notna()
    sub = table[keep].copy()
    sub["model_phase"] = [p for p, _ in mapped[keep]]
    sub["direction"] = [d for _, d in mapped[keep]]
    sub["measured_s"] = (sub["compute_ms"].fillna(0) + sub["comm_ms"].fillna(0)) / 1e3
    measured = sub.groupby(["rank", "model_phase", "direction"], as_index=False)["measured_s"].sum()
    measured = measured.rename(columns={"model_phase": "phase"})
    bounds = est.records[["rank", "phase", "direction", "resource", "time_lower_bound_s"]]
    keys = [phase_measured_in(p, d) for p, d in zip(bounds["phase"], bounds["direction"])]
    bounds = (bounds.assign(phase=[p for p, _ in keys], direction=[d for _, d in keys])
              .groupby(["rank", "phase", "direction"], as_index=False, sort=False)
              .agg(resource=("resource", "first"), time_lower_bound_s=("time_lower_bound_s", "sum")))
    out = measured.merge(bounds, on=["rank", "phase", "direction"], how="left")
    out = out.rename(columns={"time_lower_bound_s": "bound_s"})
    out["efficiency"] = np.where(out["measured_s"] > 0, out["bound_s"] / out["measured_s"], np.nan)
    return out


__all__ = ["DEFAULT_CPS", "DEFAULT_TOKENS", "EXTRAPOLATE_COLUMNS", "extrapolate", "measured_vs_bound"]
