"""Predicted per-rank balance of the row-split policies (docs/design.md §3.1): equal slices against the
cost-balanced split, from the analytic cost model.

:func:`compare_policies` splits a batch under each policy (the balanced one with the model's per-row
costs at ``machine``'s ceilings, :meth:`dsv4cp.model.row_costs.RowCosts.for_layer`, then refined on the
model's own per-rank evaluation, :func:`refine_split`), evaluates the cost model on each split and
reports, forward + backward, the slowest rank's compute bound and its ratio to the mean (the imbalance
a rank waiting in a collective shows as exposed communication).

With a :class:`~dsv4cp.model.calibration.Calibration` both the balanced split and the reported
per-rank compute times use the calibrated (measured-like) phase times instead of the bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.partition import POLICIES, RowSplit, check_positive_int, floor_rows
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.balanced_split import partition
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.costs import BOTH, estimate
from dsv4cp.model.counts import DocsLike, document_extents
from dsv4cp.model.machine import Machine, resolve_machine
from dsv4cp.model.row_costs import SPLIT_DIRECTIONS, RowCosts, row_costs, scanned_slots

POLICY_COLUMNS = (
    "policy", "cp", "tokens", "split", "min_rows", "max_rows", "max_compute_s", "mean_compute_s",
    "compute_imbalance", "max_bound_overlap_s", "bound_imbalance",
)
"""Columns of :func:`compare_policies` (times in seconds per rank, in the compared direction)."""

UNREFINED = "balanced-unrefined"
"""The extra :func:`compare_policies` row of the per-row balanced split before :func:`refine_split`."""

MAX_EVALUATIONS = 200
"""Default bound on the cost-model evaluations of :func:`refine_split` (each one :func:`estimate` plus,
with a calibration, :meth:`Calibration.rank_compute_s`: ~3-10 ms at 64K tokens / cp 8, ~30 ms at 1M
tokens / cp 64 on one CPU core)."""

_LINE_POINTS = 8
"""The line search tries the start, equal slices and the 7 splits evenly between them."""

_CAPACITIES = 8
"""Row caps tried by the capacity-aware splits (evenly from ``T / cp`` to the start's largest slice)."""

_CAP_BISECTIONS = 40
"""Halvings of the largest-cost bracket of one capacity-aware split (to ~1e-12 of the start's bound)."""


def policy_split(
    cfg: DSv4Config, ratio: int, docs: DocsLike, cp: int, policy: str, machine: Machine | None = None,
    total: int | None = None, align: int = 1, direction: str = BOTH, calibration: Calibration | None = None,
    refine: bool = True, kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> RowSplit:
    """The split of ``docs`` over ``cp`` ranks under ``policy``, balanced on the model's per-row times
    in ``direction`` (``fwd+bwd``: a training step), scaled by ``calibration`` when given.

    With ``refine`` (default) the balanced split is then refined on the model's per-rank evaluation
    (:func:`refine_split`), which also sees the padding of the gathered buffers to the largest rank;
    ``refine=False`` gives the per-row split alone. ``refine`` has no effect on ``equal``, which needs no
    ``machine`` (the balanced split's default is the machine this process runs on). ``kernel_options``: the
    options the step runs (the indexer loss's scores, :func:`~dsv4cp.model.costs.loss_takes_selection_scores`)."""
    machine = resolve_machine(machine) if policy == "balanced" else machine
    cu, total = document_extents(docs, total)
    lengths = np.diff(cu).tolist()
    split = partition(lengths, cp, cfg, ratio, policy=policy, machine=machine, align=align,
                      total=total, direction=direction, calibration=calibration, kernel_options=kernel_options)
    if policy != "balanced" or not refine:
        return split
    return refine_split(cfg, ratio, lengths, split, machine, total, align=align, direction=direction,
                        calibration=calibration, kernel_options=kernel_options)


def refine_split(
    cfg: DSv4Config, ratio: int, docs: DocsLike, start: RowSplit, machine: Machine | None = None,
    total: int | None = None, *, align: int = 1, min_rows: int | None = None, direction: str = BOTH,
    calibration: Calibration | None = None, max_evaluations: int = MAX_EVALUATIONS,
    kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> RowSplit:
    """``start`` (e.g. the per-row balanced split) improved on the cost model's own per-rank times.

    Why: the per-row balanced split (:func:`dsv4cp.model.balanced_split.balanced_split`) minimises the largest
    per-rank sum of per-row costs, but a rank's modelled time also depends on the split itself: the
    gathered compressed buffers are padded to the largest rank's slot count (static capacity), and
    under the ``prefix`` indexer scan rank ``rho``'s row ``t`` scans ``rho * capacity + t // r + 1``
    slots, so every row given to the largest rank lengthens every later rank's scan.

    Objective (minimised): the largest per-rank compute time of :func:`estimate` on the split in
    ``direction`` (``Calibration.rank_compute_s`` with ``calibration``, else the bound
    ``summary(direction).rank_compute_s``); ties go to the smaller sum over ranks, then to the
    lexicographically smaller split points, so every rank derives the same split from the same inputs.

    Search (deterministic; the best split seen wins, so the result is never worse than ``start``, nor,
    given a budget of two evaluations or more, than equal slices when these lie on the ``align`` grid):

    1. A line search between ``start`` and equal slices (:data:`_LINE_POINTS` + 1 splits, points
       rounded to ``align``): the padding makes the per-row split overshoot, and better splits often
       lie between the two.
    2. Capacity-aware splits (C layers charged on the ``prefix`` or ``all`` scan only): for
       :data:`_CAPACITIES` caps on a rank's rows, the split minimising the per-row costs plus the
       padded scan at that cap's capacity (:meth:`_Search.capacities`). Far from balance (cp 64) the
       moves of step 3 alone stall: with equal slices every rank sets the capacity, so any move raises it.
    3. Boundary moves from the best split so far, step sizes halving from ``~T / (4 cp)`` down to
       ``align``: move the slowest rank's left or right point by the step, shift the points between
       the slowest and the fastest rank by it (moving rows from one to the other), or give the
       largest rank (the one that sets the capacity) fewer rows, towards its faster neighbour. The
       best improving move is taken; when none improves, the step halves; at ``align`` it stops.

    Every slice keeps ``min_rows`` rows (default the layer's halo, at least 1) and every inner point
    other than ``start``'s lies on a multiple of ``align``. Cost: at most ``max_evaluations`` model
    evaluations (the search stops there; default :data:`MAX_EVALUATIONS`), each ``O(cp x documents)``,
    plus ``O(cp log T)`` host arithmetic per bisection step of step 2. The result is a local optimum of
    these moves, not necessarily the global one (the tests bound its distance on small cases)."""
    check_positive_int("align", align)
    check_positive_int("max_evaluations", max_evaluations)
    if direction not in SPLIT_DIRECTIONS:
        raise ValueError(f"direction: must be one of {SPLIT_DIRECTIONS}, got {direction!r}")
    machine = resolve_machine(machine)
    cu, total = document_extents(docs, total)
    if not isinstance(start, RowSplit):
        raise ValueError(f"start: must be a RowSplit, got {start!r}")
    cp = start.cp
    floor = floor_rows(cfg, ratio, cp, min_rows)
    start.validate(total, cp, floor, field="start")
    if cp == 1:
        return start
    search = _Search(cfg, ratio, cu, total, machine, direction, calibration, floor, align, max_evaluations,
                     kernel_options)
    best = search.evaluate(start.bounds)
    equal = tuple(total * rho // cp for rho in range(cp + 1))
    if total % cp == 0 and search.legal(equal) and not search.exhausted:
        best = min(best, search.evaluate(equal))
    best = search.line(start.bounds, equal, best)
    best = search.capacities(start, best)
    return RowSplit(search.descend(best)[2])


_Key = tuple[float, float, tuple[int, ...]]
"""What :func:`refine_split` minimises: (largest rank time, summed rank time, split points)."""


class _Search:
    """The cached model evaluations and moves of :func:`refine_split`; a key is ``(max, sum, bounds)``."""

    def __init__(self, cfg: DSv4Config, ratio: int, cu: np.ndarray, total: int, machine: Machine, direction: str,
                 calibration: Calibration | None, min_rows: int, align: int, budget: int,
                 kernel_options: KernelOptions) -> None:
        self.cfg, self.ratio, self.cu, self.total = cfg, ratio, cu, total
        self.kernel_options = kernel_options
        self.lengths = np.diff(cu).tolist()  # the documents, as estimate() takes them
        self.machine, self.direction, self.calibration = machine, direction, calibration
        self.min_rows, self.align, self.budget = min_rows, align, budget
        self.times: dict[tuple[int, ...], np.ndarray] = {}

    @property
    def exhausted(self) -> bool:
        return len(self.times) >= self.budget

    def legal(self, bounds: tuple[int, ...]) -> bool:
        rows = np.diff(bounds)
        return bool((rows >= self.min_rows).all()) and all(b % self.align == 0 for b in bounds[1:-1])

    def rank_times(self, bounds: tuple[int, ...]) -> np.ndarray:
        """``[cp]`` modelled compute seconds per rank of the split ``bounds`` (cached)."""
        if bounds not in self.times:
            est = estimate(self.cfg, self.ratio, self.lengths, len(bounds) - 1, self.machine, self.total,
                           split=RowSplit(bounds), kernel_options=self.kernel_options)
            if self.calibration is None:
                times = np.asarray(est.summary(self.direction).rank_compute_s, dtype=float)
            else:
                times = np.asarray(self.calibration.rank_compute_s(est, self.direction), dtype=float)
            self.times[bounds] = times
        return self.times[bounds]

    def evaluate(self, bounds: tuple[int, ...]) -> _Key:
        times = self.rank_times(bounds)
        return float(times.max()), float(times.sum()), bounds

    def line(self, start: tuple[int, ...], equal: tuple[int, ...], best: _Key) -> _Key:
        """The best key of ``best`` and the splits between ``start`` and ``equal`` on the align grid."""
        for k in range(1, _LINE_POINTS):
            if self.exhausted:
                break
            mix = [a + (b - a) * k / _LINE_POINTS for a, b in zip(start, equal)]
            bounds = (0, *(int(round(x / self.align)) * self.align for x in mix[1:-1]), self.total)
            if self.legal(bounds):
                best = min(best, self.evaluate(bounds))
        return best

    def capacities(self, start: RowSplit, best: _Key) -> _Key:
        """The best key of ``best`` and the capacity-aware splits: for row caps ``R`` from ``T / cp`` to
        ``start``'s largest slice, the split minimising the largest per-rank cost when the gathered
        slots are padded to ``C = ceil(R / r)`` (:meth:`_capped_split`). Only C layers whose indexer
        scan counts slots (``prefix`` or ``all``) have this padding term; others return ``best``."""
        if layer_kind(self.ratio) != "C":
            return best
        costs = RowCosts.for_layer(self.cfg, self.ratio, self.machine, self.direction, self.calibration,
                                   self.kernel_options)
        if not (costs.per_prefix_entry or costs.per_batch_entry):  # the visible scan: no padding term
            return best
        rest = dataclasses.replace(costs, per_prefix_entry=0.0, per_batch_entry=0.0)
        prefix = np.concatenate(([0.0], np.cumsum(row_costs(rest, self.cu, self.total, self.cfg, self.ratio))))
        cp, a = start.cp, self.align
        low = -(-self.total // cp)
        caps = np.linspace(low, max(low, start.max_rows), _CAPACITIES)
        for rows in sorted({int(-(-int(round(x)) // a) * a) for x in caps}):
            if self.exhausted:
                break
            bounds = self._capped_split(prefix, costs, cp, rows)
            if bounds is not None and self.legal(bounds):
                best = min(best, self.evaluate(bounds))
        return best

    def _capped_split(self, prefix: np.ndarray, costs: RowCosts, cp: int, cap_rows: int) -> tuple[int, ...] | None:
        """The split (bounds, or None) with slices of at most ``cap_rows`` rows minimising the largest
        rank cost ``w_rho (prefix[e] - prefix[b] + per_prefix_entry * (n rho C + scanned_slots(n))
        + per_batch_entry * n cp C)`` (``n = e - b``, ``C = ceil(cap_rows / r)``, ``w`` the calibration's
        per-rank factors at this cp, else 1): bisection on the cost
        with a greedy sweep (each rank takes the most rows the cost allows, leaving ``min_rows`` per
        later rank), a heuristic candidate the model then judges."""
        total, a, r, floor = self.total, self.align, self.ratio, self.min_rows
        slots = -(-cap_rows // r)
        weight = np.ones(cp) if self.calibration is None else self.calibration.rank_scale(cp)  # per-rank factors

        def cost(rho: int, b: int, e: int) -> float:
            n = e - b
            return float(weight[rho] * (prefix[e] - prefix[b]
                                        + costs.per_prefix_entry * (n * rho * slots + int(scanned_slots(n, r)))
                                        + costs.per_batch_entry * n * cp * slots))

        def sweep(limit: float) -> tuple[int, ...] | None:
            bounds = [0]
            for rho in range(cp - 1):
                b = bounds[-1]
                lo = -(-(b + floor) // a) * a
                hi = min(b + cap_rows, total - (cp - 1 - rho) * floor) // a * a
                if lo > hi or cost(rho, b, lo) > limit:
                    return None
                while lo < hi:  # the furthest aligned end within the limit (cost grows with the end)
                    mid = (lo + hi + a) // 2 // a * a
                    lo, hi = (mid, hi) if cost(rho, b, mid) <= limit else (lo, mid - a)
                bounds.append(lo)
            last = total - bounds[-1]
            if not floor <= last <= cap_rows or cost(cp - 1, bounds[-1], total) > limit:
                return None
            return (*bounds, total)

        lo, hi = 0.0, max(cost(rho, 0, total) for rho in range(cp))  # one rank holding every row bounds any slice
        found = sweep(hi)
        if found is None:
            return None
        for _ in range(_CAP_BISECTIONS):
            mid = 0.5 * (lo + hi)
            bounds = sweep(mid)
            lo, hi, found = (mid, hi, found) if bounds is None else (lo, mid, bounds)
        return found

    def descend(self, best: _Key) -> _Key:
        """Boundary moves from ``best`` (a key) until no move of the smallest step improves it."""
        cp = len(best[2]) - 1
        step = max(self.align, self.total // (4 * cp) // self.align * self.align)
        while not self.exhausted:
            candidates = [self.evaluate(b) for b in self._moves(best[2], step) if not self.exhausted]
            better = min(candidates, default=best)
            if better < best:
                best = better
            elif step == self.align:
                break
            else:
                step = max(self.align, step // 2 // self.align * self.align)
        return best

    def _moves(self, bounds: tuple[int, ...], step: int) -> list[tuple[int, ...]]:
        """Legal splits one move of ``step`` rows away from ``bounds`` (see :func:`refine_split`), new ones
        only, in a fixed order."""
        times, rows = self.rank_times(bounds), np.diff(bounds)
        cp = len(bounds) - 1
        slow, fast, large = int(np.argmax(times)), int(np.argmin(times)), int(np.argmax(rows))
        shifts = [((slow,), step), ((slow + 1,), -step)]  # (points to move, by how many rows)
        if fast > slow + 1:
            shifts.append((tuple(range(slow + 1, fast + 1)), -step))
        elif fast < slow - 1:
            shifts.append((tuple(range(fast + 1, slow + 1)), step))
        if large != slow:  # towards the faster neighbour
            left = times[large - 1] if large > 0 else np.inf
            right = times[large + 1] if large < cp - 1 else np.inf
            shifts.append(((large,), step) if left <= right else ((large + 1,), -step))
        out = []
        for points, by in shifts:
            if any(p <= 0 or p >= cp for p in points):
                continue
            moved = list(bounds)
            for p in points:
                moved[p] += by
            moved = tuple(moved)
            if moved not in self.times and moved not in out and self.legal(moved):
                out.append(moved)
        return out


def compare_policies(
    cfg: DSv4Config, ratio: int, docs: DocsLike, cp: int, machine: Machine | None = None,
    total: int | None = None, *, policies: Sequence[str] = POLICIES, align: int = 1, direction: str = BOTH,
    calibration: Calibration | None = None, unrefined: bool = True, kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> pd.DataFrame:
    """One row per policy (columns :data:`POLICY_COLUMNS`): the split and the predicted per-rank
    compute bound in ``direction`` (max, mean, max / mean) and layer bound with overlap.

    ``balanced`` is the refined split (:func:`refine_split`); with ``unrefined`` (default) a row
    :data:`UNREFINED` after it shows the per-row balanced split it started from.

    The default ``fwd+bwd`` is a training step: its ranks meet at the start of forward (halo,
    all-gathers) and at the end of backward (the reduce-scatters' deferred waits, the halo gradient),
    so the step takes the slowest rank's forward + backward. With ``calibration`` the compute times
    are the calibrated ones (:meth:`Calibration.rank_compute_s`)."""
    machine = resolve_machine(machine)
    cu, total = document_extents(docs, total)
    lengths = np.diff(cu).tolist()
    splits = []
    for policy in policies:
        split = policy_split(cfg, ratio, lengths, cp, policy, machine, total, align, direction, calibration,
                             refine=False, kernel_options=kernel_options)
        if policy == "balanced":
            refined = refine_split(cfg, ratio, lengths, split, machine, total, align=align, direction=direction,
                                   calibration=calibration, kernel_options=kernel_options)
            splits.append((policy, refined))
            if unrefined:
                splits.append((UNREFINED, split))
        else:
            splits.append((policy, split))
    rows = []
    for policy, split in splits:
        est = estimate(cfg, ratio, lengths, cp, machine, total, split=split, kernel_options=kernel_options)
        step = est.summary(direction)
        if calibration is None:
            compute = np.asarray(step.rank_compute_s)
        else:
            compute = calibration.rank_compute_s(est, direction)
        bound = np.maximum(compute, np.asarray(step.rank_comm_s))
        rows.append({
            "policy": policy, "cp": cp, "tokens": split.total, "split": split.bounds,
            "min_rows": split.min_rows, "max_rows": split.max_rows,
            "max_compute_s": float(compute.max()), "mean_compute_s": float(compute.mean()),
            "compute_imbalance": _ratio(compute), "max_bound_overlap_s": float(bound.max()),
            "bound_imbalance": _ratio(bound),
        })
    return pd.DataFrame(rows, columns=list(POLICY_COLUMNS))


def _ratio(values: np.ndarray) -> float:
    mean = values.mean()
    return float(values.max() / mean) if mean > 0 else 1.0
