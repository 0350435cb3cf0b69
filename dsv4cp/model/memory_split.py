"""Row splits under a per-rank memory bound, and the time / memory trade-off of the split policies.

A balanced split gives the ranks holding cheap rows (a long document's start) more rows, and with them
more activation memory: at 256K tokens on cp 8 the first rank's estimated peak is about twice the
last's. :func:`memory_capped_split` keeps every rank's estimated peak (:func:`dsv4cp.model.memory.rank_peak_bytes`)
at or below a bound: it returns the split unchanged when it fits, else the fastest split (the model's
largest per-rank time) on the line from it to equal slices that fits; equal slices minimise the largest
rank's rows, so when they do not fit no contiguous split does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.costs import BOTH, estimate
from dsv4cp.model.machine import Machine
from dsv4cp.model.memory import rank_peak_bytes

LINE_POINTS = 32
"""Splits tried between the given split and equal slices."""

TRADE_OFF_COLUMNS = ("policy", "split", "max_compute_ms", "compute_imbalance", "max_peak_gib", "min_peak_gib")


def rank_time_s(cfg: DSv4Config, ratio: int, lengths: Sequence[int], split: RowSplit, machine: Machine,
                direction: str = BOTH, calibration: Calibration | None = None,
                kernel_options: KernelOptions = DEFAULT_OPTIONS) -> np.ndarray:
    """``[cp]`` modelled compute seconds of each rank of ``split`` (calibrated when given) under the options
    the step runs."""
    est = estimate(cfg, ratio, list(lengths), split.cp, machine, split.total, split=split,
                   kernel_options=kernel_options)
    if calibration is not None:
        return calibration.rank_compute_s(est, direction)
    return np.asarray(est.summary(direction).rank_compute_s)


def memory_capped_split(
    cfg: DSv4Config, ratio: int, lengths: Sequence[int], split: RowSplit, max_rank_bytes: int, *,
    dtype: torch.dtype, direction: str = BOTH, recompute: bool = False, machine: Machine | None = None,
    calibration: Calibration | None = None, align: int = 1, kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> RowSplit:
    """``split`` when every rank's estimated peak fits ``max_rank_bytes``, else the split of the line towards
    equal slices that fits with the smallest largest per-rank modelled time. ``ValueError`` naming
    ``max_rank_memory`` when not even equal slices fit."""
    if isinstance(max_rank_bytes, bool) or not isinstance(max_rank_bytes, int) or max_rank_bytes <= 0:
        raise ValueError(f"max_rank_memory: must be a positive number of bytes, got {max_rank_bytes!r}")
    machine = machine or Machine()
    memory_direction = "fwd" if direction == "fwd" else "fwd+bwd"

    def peak(candidate: RowSplit) -> int:
        return max(rank_peak_bytes(cfg, ratio, list(lengths), candidate, memory_direction, dtype, recompute))

    if peak(split) <= max_rank_bytes:
        return split
    total, cp = split.total, split.cp
    equal = np.array([total * rho // cp for rho in range(cp + 1)], dtype=float)
    start = np.asarray(split.bounds, dtype=float)
    best = None
    for step in range(1, LINE_POINTS + 1):
        mix = start + (equal - start) * step / LINE_POINTS
        inner = [int(round(b / align) * align) for b in mix[1:-1]]
        candidate = RowSplit((0, *inner, total)) if step < LINE_POINTS else RowSplit(tuple(map(int, equal)))
        if any(n <= 0 for n in candidate.rank_rows) or peak(candidate) > max_rank_bytes:
            continue
        slowest = float(rank_time_s(cfg, ratio, lengths, candidate, machine, direction, calibration,
                                    kernel_options).max())
        if best is None or slowest < best[0]:
            best = (slowest, candidate)
    if best is None:
        raise ValueError(f"max_rank_memory: {max_rank_bytes / 2**30:.4g} GiB is below the estimated peak of equal "
                         f"slices ({peak(RowSplit(tuple(map(int, equal)))) / 2**30:.4g} GiB per rank); no "
                         "contiguous split fits")
    return best[1]


def trade_off(cfg: DSv4Config, ratio: int, lengths: Sequence[int], splits: dict[str, RowSplit], *,
              dtype: torch.dtype, direction: str = BOTH, recompute: bool = False, machine: Machine | None = None,
              calibration: Calibration | None = None, kernel_options: KernelOptions = DEFAULT_OPTIONS,
              ) -> pd.DataFrame:
    """One row per named split (:data:`TRADE_OFF_COLUMNS`): the modelled slowest rank and max/mean, and the
    largest and smallest rank's estimated peak memory."""
    machine = machine or Machine()
    memory_direction = "fwd" if direction == "fwd" else "fwd+bwd"
    rows = []
    for name, split in splits.items():
        times = rank_time_s(cfg, ratio, lengths, split, machine, direction, calibration, kernel_options)
        peaks = rank_peak_bytes(cfg, ratio, list(lengths), split, memory_direction, dtype, recompute)
        rows.append({"policy": name, "split": split.bounds, "max_compute_ms": float(times.max()) * 1e3,
                     "compute_imbalance": float(times.max() / times.mean()) if times.mean() > 0 else 1.0,
                     "max_peak_gib": max(peaks) / 2**30, "min_peak_gib": min(peaks) / 2**30})
    return pd.DataFrame(rows, columns=list(TRADE_OFF_COLUMNS))
