"""The per-row balanced split of the contiguous CP layout (docs/design.md §3.1) and the policy entry point.

The ``balanced`` policy keeps the ranks' slices contiguous but moves their boundaries so that no rank's
modelled work exceeds the others': a query's indexer scoring and compressed attention grow with its
position in its document, so with equal slices the rank holding the end of a long document is the slowest.

:func:`balanced_split` minimises the maximum over ranks of the summed per-row cost
(:class:`~dsv4cp.model.row_costs.RowCosts`), subject to every slice holding at least ``min_rows`` rows
(the halo it must send) and every inner boundary lying on a multiple of ``align``. It is computed on the
host from the document extents alone (no device read beyond the offsets' one copy), deterministically,
so every rank derives the same split: prefix sums of the per-row cost (``O(T)``), then a bisection on
the largest slice cost whose feasibility test is a greedy sweep with binary searches (``O(cp log T)``
per test). :func:`dsv4cp.model.partition.refine_split` then improves it on the model's per-rank times.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import POLICIES, RowSplit, check_positive_int, floor_rows
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.machine import Machine
from dsv4cp.model.phase_classes import PhaseFactors
from dsv4cp.model.row_costs import SPLIT_DIRECTIONS, RowCosts, row_costs
from dsv4cp.packing import PackedSeqs

_BISECTION_STEPS = 100
"""Enough halvings to bring the bracket on the largest slice cost to float64 resolution."""


class InfeasibleSplitError(ValueError):
    """No split of the rows gives every rank ``min_rows`` rows (too many ranks for the batch)."""


# ---------------------------------------------------------------------------------- balanced split
def balanced_split(prefix: np.ndarray, cp: int, min_rows: int = 1, align: int = 1,
                   rank_weights: Sequence[float] | None = None) -> RowSplit:
    """The split minimising the largest slice cost (``prefix = [0, cumsum(row costs)]``, costs >= 0),
    each slice holding ``>= min_rows`` rows, each inner boundary a multiple of ``align``; with
    ``rank_weights`` (``[cp]``, > 0) rank ``rho``'s slice costs ``rank_weights[rho]`` times its rows' sum
    (a calibration's per-rank factors: the same rows take longer on some ranks).

    Bisection on the largest slice cost ``c``; ``c`` is feasible when :func:`_greedy` (each rank takes
    as many rows as ``c`` allows while leaving enough for the ranks after it) reaches ``T``, which is
    exact (any feasible split's boundaries lie at or before the greedy ones) unless a slice would be
    cut below ``min_rows``; only then the exact reachability test :func:`_exact_split` decides.
    """
    weights = np.ones(cp) if rank_weights is None else np.asarray(rank_weights, dtype=float)
    if weights.shape != (cp,) or not (np.isfinite(weights) & (weights > 0)).all():
        raise ValueError(f"rank_weights: needs {cp} positive finite weights, got {list(weights)!r}")
    total = prefix.size - 1
    if total < cp * min_rows:
        raise InfeasibleSplitError(
            f"cp: {cp} ranks of at least {min_rows} rows each need {cp * min_rows} rows, the batch has {total}"
        )
    grid = np.arange(0, total + 1, align, dtype=np.int64)  # where inner boundaries may lie
    if not _fits(grid, total, cp, min_rows):
        raise InfeasibleSplitError(
            f"align: no split of {total} rows over cp={cp} ranks with boundaries on multiples of {align} "
            f"gives every rank {min_rows} rows"
        )
    lo, hi = 0.0, float(prefix[-1] * weights.max())
    best = _split_within(prefix, grid, min_rows, np.full(cp, np.inf))  # no cap: always fits
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        found = _split_within(prefix, grid, min_rows, mid / weights)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return RowSplit(tuple(int(b) for b in best))


def _split_within(prefix, grid, min_rows, caps):
    """A split whose slice of rank ``rho`` costs at most ``caps[rho]`` (rows' sum), or None when none exists."""
    bounds, clamped = _greedy(prefix, grid, min_rows, caps)
    if bounds is None and clamped:
        return _exact_split(prefix, grid, min_rows, caps)
    return bounds


def _fits(grid: np.ndarray, total: int, cp: int, min_rows: int) -> bool:
    """Whether any split gives every rank ``min_rows`` rows: place each inner boundary at the first
    grid point ``min_rows`` past the previous one (the earliest choice leaves the most rows after it)."""
    start = 0
    for _ in range(cp - 1):
        at = int(np.searchsorted(grid, start + min_rows, side="left"))
        if at == grid.size:
            return False
        start = int(grid[at])
    return total - start >= min_rows


def _greedy(prefix, grid, min_rows, caps):
    """Greedy boundaries under the per-rank costs ``caps``: ``(bounds or None, whether a slice came out
    below min_rows)``; a failure without that is proof that no split fits under ``caps``."""
    total, cp = prefix.size - 1, len(caps)
    bounds, start = [0], 0
    for rank in range(cp - 1):
        after = cp - 1 - rank  # ranks still to come after this one
        # the furthest grid point whose slice costs at most its cap (prefix is non-decreasing)
        end = int(grid[np.searchsorted(grid, np.searchsorted(prefix, prefix[start] + caps[rank], side="right") - 1,
                                       side="right") - 1])
        end = min(end, int(grid[np.searchsorted(grid, total - after * min_rows, side="right") - 1]))
        if end < start + min_rows:
            return None, True
        bounds.append(end)
        start = end
    if total - start < min_rows:
        return None, True
    if prefix[total] > prefix[start] + caps[-1]:  # the same comparison as every other slice's
        return None, False
    bounds.append(total)
    return bounds, False


def _exact_split(prefix, grid, min_rows, caps):
    """A split with every slice ``>= min_rows`` rows and rank ``rho``'s cost ``<= caps[rho]``, or None:
    forward reachability of boundary positions (one boolean per grid point and rank, ``O(cp T / align)``),
    then a walk back."""
    total, cp = prefix.size - 1, len(caps)
    points = np.unique(np.append(grid, total))
    n = points.size
    pp = prefix[points]
    reach = [np.zeros(n, dtype=bool)]
    reach[0][0] = True
    index = np.arange(n)
    # rank rho's slice from point i may end at points j in [first[i], last[rho][i]]: points[j] >= points[i]
    # + min_rows and pp[j] <= pp[i] + caps[rho]
    first = np.searchsorted(points, points + min_rows, side="left")
    last = [np.searchsorted(pp, pp + cap, side="right") - 1 for cap in caps]
    for rank in range(cp):
        ok = reach[-1] & (first <= last[rank])
        opened = np.bincount(first[ok], minlength=n + 1) - np.bincount(last[rank][ok] + 1, minlength=n + 1)
        reach.append(np.cumsum(opened[:n]) > 0)
    if not reach[cp][n - 1]:
        return None
    bounds, j = [total], n - 1
    for rank in range(cp, 0, -1):
        starts = index[reach[rank - 1] & (first <= j) & (j <= last[rank - 1])]
        j = int(starts[0])
        bounds.append(int(points[j]))
    return bounds[::-1]


# ---------------------------------------------------------------------------------- entry point
def partition(
    packed: PackedSeqs | Sequence[int], cp: int, cfg: DSv4Config, ratio: int, *, policy: str = "equal",
    machine: Machine | None = None, align: int = 1, min_rows: int | None = None, costs: RowCosts | None = None,
    total: int | None = None, direction: str = "fwd+bwd", calibration: PhaseFactors | None = None,
    kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> RowSplit:
    """The row split of ``packed`` (or plain document lengths) over ``cp`` ranks under ``policy``.

    Args:
        policy: ``"equal"`` (``T / cp`` rows each, today's layout) or ``"balanced"`` (the largest
            per-rank cost of :class:`RowCosts` minimised).
        machine: ceilings turning FLOPs and bytes into seconds (see :meth:`RowCosts.for_layer`).
        align: inner boundaries on multiples of this (e.g. the compression ratio, or 8 rows).
        min_rows: the fewest rows a rank may hold; default the layer's halo (at least 1).
        costs: per-row costs overriding the ones derived from ``cfg``, ``ratio`` and ``machine``.
        total: rows of the batch when ``packed`` is a list of lengths (default their sum; more rows
            form a tail padding segment).
        direction: the work to equalise: ``fwd+bwd`` (a training step; default), ``fwd`` or ``bwd``.
            Equal step times leave each pass unequal: the indexer scores only in forward, so the rank
            holding a document's end is slower in forward and faster in backward.
        calibration: measured-over-bound factors per phase class (needs ``machine``): the balanced split
            then equalises measured-like per-rank times (see :meth:`RowCosts.for_layer`), each rank's
            scaled by the calibration's per-rank factor at ``cp`` (``rank_scale``).
        kernel_options: the options the step runs (see :meth:`RowCosts.for_layer`).

    Identical inputs give the identical split on every rank (host arithmetic only).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
    if direction not in SPLIT_DIRECTIONS:
        raise ValueError(f"direction: must be one of {SPLIT_DIRECTIONS}, got {direction!r}")
    check_positive_int("cp", cp)
    check_positive_int("align", align)
    cfg.check_ratio(ratio)
    floor = floor_rows(cfg, ratio, cp, min_rows)
    field = "packed.total" if isinstance(packed, PackedSeqs) else "total"
    if isinstance(packed, PackedSeqs):
        cu = np.asarray(packed.cu_seqlens_padded.cpu().tolist(), dtype=np.int64)
        total = packed.total
    else:
        lengths = np.asarray(list(packed), dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 0).any():
            raise ValueError(f"packed: document lengths must be non-negative ints, got {list(packed)[:5]!r}")
        cu = np.concatenate(([0], np.cumsum(lengths)))
        total = int(cu[-1]) if total is None else total
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < cu[-1]:
            raise ValueError(f"total: must be an int >= the documents' {int(cu[-1])} rows, got {total!r}")
        total = int(total)
    if policy == "equal":
        return RowSplit.equal(total, cp, field).validate(total, cp, floor, field=field)
    costs = costs or RowCosts.for_layer(cfg, ratio, machine, direction, calibration, kernel_options)
    prefix = np.concatenate(([0.0], np.cumsum(row_costs(costs, cu, total, cfg, ratio))))
    weights = None if calibration is None else calibration.rank_scale(cp)
    return balanced_split(prefix, cp, floor, align, weights)
