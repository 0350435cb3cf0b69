"""Row partitions of the contiguous CP layout: equal slices or cost-balanced ones (docs/design.md §3.1).

A :class:`RowSplit` is the list of split points ``0 = b_0 <= ... <= b_cp = T``; rank ``rho`` holds
the rows ``[b_rho, b_{rho+1})``. The ``equal`` policy gives every rank ``T / cp`` rows. The
``balanced`` policy keeps the slices contiguous but moves their boundaries so that no rank's modelled
work exceeds the others': a query's indexer scoring and compressed attention grow with its position in
its document, so with equal slices the rank holding the end of a long document is the slowest.

The balanced split minimises the maximum over ranks of the summed per-row cost (:class:`RowCosts`),
subject to every slice holding at least ``min_rows`` rows (the halo it must send) and every inner
boundary lying on a multiple of ``align``. It is computed on the host from the document extents alone
(no device read beyond the offsets' one copy), deterministically, so every rank derives the same
split: prefix sums of the per-row cost (``O(T)``), then a bisection on the largest slice cost whose
feasibility test is a greedy sweep with binary searches (``O(cp log T)`` per test).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.packing import PackedSeqs

POLICIES = ("equal", "balanced")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
"""What the balanced split equalises: a training step (``fwd+bwd``) or one pass."""

_BISECTION_STEPS = 100
"""Enough halvings to bring the bracket on the largest slice cost to float64 resolution."""


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")


class InfeasibleSplitError(ValueError):
    """No split of the rows gives every rank ``min_rows`` rows (too many ranks for the batch)."""


@dataclass(frozen=True)
class RowSplit:
    """Split points of ``T`` rows over ``cp`` ranks: rank ``rho`` holds ``[bounds[rho], bounds[rho + 1])``."""

    bounds: tuple[int, ...]

    @classmethod
    def equal(cls, total: int, cp: int, field: str = "packed.total") -> RowSplit:
        """``T / cp`` rows per rank; ``ValueError`` naming ``field`` when ``cp`` does not divide ``T``."""
        check_positive_int("cp", cp)
        if total % cp:
            raise ValueError(f"{field}: {total} rows are not divisible by cp={cp}")
        rows = total // cp
        return cls(tuple(rho * rows for rho in range(cp + 1)))

    @property
    def cp(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def start(self, rank: int) -> int:
        return self.bounds[rank]

    def rows(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    @property
    def rank_rows(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def max_rows(self) -> int:
        return max(self.rank_rows)

    @property
    def min_rows(self) -> int:
        return min(self.rank_rows)

    @property
    def is_equal(self) -> bool:
        return len(set(self.rank_rows)) == 1

    def validate(self, total: int, cp: int, min_rows: int = 1, field: str = "split") -> RowSplit:
        """``self`` when it splits ``total`` rows over ``cp`` ranks, each holding ``>= min_rows`` rows;
        otherwise ``ValueError`` naming ``field`` (call it before any collective, on every rank)."""
        bounds = self.bounds
        if not isinstance(bounds, tuple) or not all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in bounds
        ):
            raise ValueError(f"{field}.bounds: must be a tuple of ints, got {bounds!r}")
        if len(bounds) != cp + 1:
            raise ValueError(f"{field}.bounds: must hold cp + 1 = {cp + 1} split points, got {len(bounds)}")
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"{field}.bounds: must run from 0 to packed.total={total}, got {bounds[0]}..{bounds[-1]}")
        rows = self.rank_rows
        if any(n < 0 for n in rows):
            raise ValueError(f"{field}.bounds: must be non-decreasing, got {bounds}")
        smallest = min(rows)
        if cp > 1 and smallest < min_rows:  # one rank exchanges no halo: even an empty batch is legal
            rank = rows.index(smallest)
            raise ValueError(
                f"{field}: rank {rank} holds {smallest} rows, fewer than the {min_rows} it needs "
                f"(the halo of max(window, compression reach) rows, at least 1); bounds={bounds}"
            )
        return self


def as_split(split: RowSplit | Sequence[int] | None, total: int, cp: int, min_rows: int = 1,
             field: str = "split") -> RowSplit:
    """A validated :class:`RowSplit`: ``None`` means equal slices; a sequence is taken as the bounds."""
    if split is None:
        split = RowSplit.equal(total, cp)
    elif not isinstance(split, RowSplit):
        if isinstance(split, (str, bytes)) or not hasattr(split, "__iter__"):
            raise ValueError(f"{field}: must be a RowSplit or a sequence of split points, got {split!r}")
        split = RowSplit(tuple(split))
    return split.validate(total, cp, min_rows, field)


def compression_reach(compress_ratio: int) -> int:
    """Rows before an owned group's last row that its entry reads (``d`` of docs/design.md §3.2)."""
    if compress_ratio == 0:
        return 0
    return 2 * compress_ratio if layer_kind(compress_ratio) == "C" else compress_ratio


def halo_rows(cfg: DSv4Config, compress_ratio: int, cp: int) -> int:
    """Rows each rank borrows from its predecessor: ``max(W, d_comp)``, none without CP."""
    return 0 if cp == 1 else max(cfg.window, compression_reach(compress_ratio))


def floor_rows(cfg: DSv4Config, ratio: int, cp: int, min_rows: int | None) -> int:
    """The fewest rows a rank may hold: ``min_rows`` (checked to be a positive int), default the
    layer's halo, at least 1."""
    if min_rows is None:
        return max(halo_rows(cfg, ratio, cp), 1)
    check_positive_int("min_rows", min_rows)
    return min_rows


# ---------------------------------------------------------------------------------- per-row cost
PHASE_CLASSES: tuple[str, ...] = ("indexer", "attention", "projections", "compressors", "loss")
"""Groups of layer phases that a calibration scales by one measured factor per direction: the
indexer's scoring + top-k selection, sparse (window + compressed) attention, the matrix projections
(queries, window KV, output, indexer queries and head weights), both compressors, the indexer loss."""


INDEXER_SCANS: tuple[str, ...] = ("visible", "prefix", "all")
"""Which entries the indexer's top-k pays for per query: ``visible`` (the entries of its own document
before it: the cost model's count), ``prefix`` (every entry of the batch before it, other documents'
included: the static chunk plans of the Triton and torch top-k under ``key_row_limit``, whose columns
start at key row 0) or ``all`` (every entry of the batch: the torch top-k without ``key_row_limit``)."""


class PhaseFactors(Protocol):
    """Measured time over modelled bound per phase class and direction (e.g. a
    :class:`dsv4cp.model.calibration.Calibration`), and the indexer scan its factor was fitted on."""

    indexer_scan: str

    def factor(self, phase_class: str, direction: str) -> float: ...


@dataclass(frozen=True)
class RowCosts:
    """Forward + backward cost of one row (a query) as a linear function of its work counts.

    A row at document position ``t`` costs ``per_row + per_window_key * min(t + 1, W)
    + per_visible_entry * ((t + 1) // r) + per_compressed_key * keys_c(t)`` with ``keys_c`` the
    compressed keys its attention reads (``min(K, visible)`` for C layers, ``visible`` for H). Rows of the
    tail padding segment cost ``per_row`` only (they are projected but see no key), plus on C layers,
    for every row ``g`` of the batch, ``per_prefix_entry * (g // r + 1)`` and ``per_batch_entry * (T // r)``
    (the indexer scans of :data:`INDEXER_SCANS`: the gathered slots a query's top-k scans, as with equal
    slices; unequal ones pad every rank's slots to the largest, which the model's evaluation counts and
    this per-row cost cannot). Units are whatever the builder chose (FLOPs, or seconds from a machine's
    ceilings); only ratios matter.
    """

    per_row: float
    per_window_key: float = 0.0
    per_visible_entry: float = 0.0
    per_compressed_key: float = 0.0
    per_prefix_entry: float = 0.0
    per_batch_entry: float = 0.0

    @classmethod
    def for_layer(cls, cfg: DSv4Config, ratio: int, machine=None, direction: str = "fwd+bwd",
                  calibration: PhaseFactors | None = None) -> RowCosts:
        """The cost model's accounting (docs/design.md §4.3, :mod:`dsv4cp.model.costs`) per row in ``direction``
        (``fwd``, ``bwd`` or ``fwd+bwd``: a training step, the default).

        Without ``machine`` the unit is one FLOP and memory-bound work (the top-k's score reads) is not
        counted; with a machine (any object with ``peak_flops`` and ``hbm_bandwidth``, e.g.
        :class:`dsv4cp.model.Machine`) the unit is one second at its ceilings and the top-k's bytes count.
        ``calibration`` (needs ``machine``) multiplies each phase class's seconds in each direction by
        its measured factor, so the costs follow the measured phase times rather than the bounds, and
        charges the indexer on the entries its ``indexer_scan`` says the kernel scans.
        Halo rows and the gathered buffers cost every rank the same and do not move the optimum: omitted.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: must be one of {DIRECTIONS}, got {direction!r}")
        if calibration is not None and machine is None:
            raise ValueError("machine: a calibration scales seconds at a machine's ceilings; pass the machine "
                             "its factors were fitted against")
        fitted_on = getattr(calibration, "machine", "")
        if calibration is not None and fitted_on and fitted_on != machine.name:
            raise ValueError(f"calibration.machine: fitted against the ceilings of {fitted_on!r}, applied with "
                             f"machine {machine.name!r}; refit it for that machine (dsv4cp model --calibrate)")
        cfg.check_ratio(ratio)
        scan = "visible" if calibration is None else calibration.indexer_scan
        if scan not in INDEXER_SCANS:
            raise ValueError(f"calibration.indexer_scan: must be one of {INDEXER_SCANS}, got {scan!r}")
        total = np.zeros(6)
        for pass_, (fwd, bwd) in (("fwd", (1.0, 0.0)), ("bwd", (0.0, 1.0))):
            if direction not in (pass_, "fwd+bwd"):
                continue
            for phase_class, terms in _class_terms(cfg, ratio, fwd, bwd, machine).items():
                terms = np.append(terms, [0.0, 0.0])
                if phase_class == "indexer" and scan != "visible":  # the same per-entry price, other entries
                    terms[4 if scan == "prefix" else 5], terms[2] = terms[2], 0.0
                total += terms * (1.0 if calibration is None else calibration.factor(phase_class, pass_))
        return cls(*(float(v) for v in total))


def _class_terms(cfg: DSv4Config, ratio: int, fwd: float, bwd: float, machine) -> dict[str, np.ndarray]:
    """Per phase class, the ``[per_row, per_window_key, per_visible_entry, per_compressed_key]`` cost of
    one pass (``fwd``/``bwd`` are 1.0 or 0.0): FLOPs, or seconds at ``machine``'s ceilings."""
    kind = layer_kind(ratio)
    h, d, hidden, ql = cfg.n_heads, cfg.head_dim, cfg.hidden, cfg.q_lora_rank
    hi, di, og, olr = cfg.index_n_heads, cfg.index_head_dim, cfg.o_groups, cfg.o_lora_rank
    # matrix products of m MACs: forward 2 m FLOPs; backward 4 m with an input gradient, 2 m for
    # only one of the two gradients (a detached input, or a rotation without weight)
    full, single = 2 * fwd + 4 * bwd, 2 * fwd + 2 * bwd
    attention = 4 * d * h * (fwd + 2.5 * bwd)  # per (query, valid key), backward 2.5x
    terms = {name: np.zeros(4) for name in PHASE_CLASSES}
    projections, compressors = terms["projections"], terms["compressors"]
    projections[0] += full * (hidden * ql + ql * h * d)  # query projections
    projections[0] += full * hidden * d  # window KV projection of the own row
    projections[0] += full * (h * d * olr + og * olr * hidden)  # grouped wo_a, then wo_b
    terms["attention"][1] = attention
    if kind != "W":
        overlap = 2 if kind == "C" else 1
        compressors[0] += full * hidden * 2 * overlap * d  # compressor values and gates
        # pooling of an owned entry (one per r rows): 2 FLOPs per (slot, channel), backward 2x
        compressors[0] += (2 * fwd + 4 * bwd) * overlap * ratio * d / ratio
        terms["attention"][3] = attention
    if kind == "C":
        compressors[0] += single * hidden * 4 * di  # indexer compressor (detached input)
        compressors[0] += (2 * fwd + 4 * bwd) * 2 * ratio * di / ratio
        compressors[0] += single * di * di / ratio if cfg.hadamard else 0
        projections[0] += single * (ql * hi * di + hidden * hi)  # indexer queries and head weights (detached)
        projections[0] += single * hi * di * di if cfg.hadamard else 0  # rotation of the indexer queries
        terms["indexer"][2] = 2 * hi * di * fwd  # indexer scoring (forward only)
        loss_scores = 2 * hi * di * (fwd + 2 * bwd)  # the loss's scores, differentiated (2x)
        loss_logits = 2 * d * h * fwd  # the loss recomputes attention logits (target: no backward)
        if cfg.indexer_loss == "dense":  # scores every visible entry; logits over window keys too
            terms["loss"][2] = loss_scores + loss_logits
            terms["loss"][1] = loss_logits
        else:  # scores the selected entries only
            terms["loss"][3] = loss_scores + loss_logits
    if machine is not None:
        for name in PHASE_CLASSES:
            terms[name] = terms[name] / machine.peak_flops
        if kind == "C":
            terms["indexer"][2] += 4.0 * fwd / machine.hbm_bandwidth  # the top-k reads an fp32 score per entry
    return terms


def row_costs(costs: RowCosts, cu_padded: np.ndarray, total: int, cfg: DSv4Config, ratio: int) -> np.ndarray:
    """``[total]`` float64 cost of every row of a batch with padded document offsets ``cu_padded``."""
    end = int(cu_padded[-1])
    lengths = np.diff(cu_padded)
    u = np.arange(1, end + 1, dtype=np.int64) - np.repeat(cu_padded[:-1], lengths)  # position + 1
    cost = np.full(total, costs.per_row)  # the tail padding rows are projected and see nothing
    inside = cost[:end]
    inside += costs.per_window_key * np.minimum(u, cfg.window)
    if ratio:
        visible = u // ratio
        keys = np.minimum(visible, cfg.index_topk) if layer_kind(ratio) == "C" else visible
        inside += costs.per_visible_entry * visible + costs.per_compressed_key * keys
        if layer_kind(ratio) == "C":
            cost += costs.per_prefix_entry * (np.arange(total) // ratio + 1)
            cost += costs.per_batch_entry * (total // ratio)
    return cost


def scanned_slots(rows: np.ndarray | int, ratio: int) -> np.ndarray:
    """``sum_{t=0}^{n-1} (t // ratio + 1)`` for each ``n`` in ``rows``: the gathered slots that the
    ``prefix`` indexer scan reads for a rank's first ``n`` rows (the bound ``t // r + 1`` of
    ``RankLayout.key_row_limit``), in closed form, exact in int64."""
    n = np.asarray(rows, dtype=np.int64)
    q, rem = n // ratio, n % ratio
    return ratio * q * (q + 1) // 2 + rem * (q + 1)


def slice_costs(prefix: np.ndarray, split: RowSplit) -> np.ndarray:
    """``[cp]`` summed cost of each rank's rows, from ``prefix = [0, cumsum(row costs)]``."""
    b = np.asarray(split.bounds)
    return prefix[b[1:]] - prefix[b[:-1]]


# ---------------------------------------------------------------------------------- balanced split
def balanced_split(prefix: np.ndarray, cp: int, min_rows: int = 1, align: int = 1) -> RowSplit:
    """The split minimising the largest slice cost (``prefix = [0, cumsum(row costs)]``, costs >= 0),
    each slice holding ``>= min_rows`` rows, each inner boundary a multiple of ``align``.

    Bisection on the largest slice cost ``c``; ``c`` is feasible when :func:`_greedy` (each rank takes
    as many rows as ``c`` allows while leaving enough for the ranks after it) reaches ``T``, which is
    exact (any feasible split's boundaries lie at or before the greedy ones) unless a slice would be
    cut below ``min_rows``; only then the exact reachability test :func:`_exact_split` decides.
    """
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
    lo, hi = 0.0, float(prefix[-1])
    best = _split_within(prefix, grid, cp, min_rows, hi)  # the whole cost always fits
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        found = _split_within(prefix, grid, cp, min_rows, mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return RowSplit(tuple(int(b) for b in best))


def _split_within(prefix, grid, cp, min_rows, cap):
    """A split whose every slice costs at most ``cap``, or None when none exists."""
    bounds, clamped = _greedy(prefix, grid, cp, min_rows, cap)
    if bounds is None and clamped:
        return _exact_split(prefix, grid, cp, min_rows, cap)
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


def _greedy(prefix, grid, cp, min_rows, cap):
    """Greedy boundaries under largest cost ``cap``: ``(bounds or None, whether a slice came out
    below min_rows)``; a failure without that is proof that no split fits under ``cap``."""
    total = prefix.size - 1
    bounds, start = [0], 0
    for rank in range(cp - 1):
        after = cp - 1 - rank  # ranks still to come after this one
        # the furthest grid point whose slice costs at most cap (prefix is non-decreasing)
        end = int(grid[np.searchsorted(grid, np.searchsorted(prefix, prefix[start] + cap, side="right") - 1,
                                       side="right") - 1])
        end = min(end, int(grid[np.searchsorted(grid, total - after * min_rows, side="right") - 1]))
        if end < start + min_rows:
            return None, True
        bounds.append(end)
        start = end
    if total - start < min_rows:
        return None, True
    if prefix[total] > prefix[start] + cap:  # the same comparison as every other slice's
        return None, False
    bounds.append(total)
    return bounds, False


def _exact_split(prefix, grid, cp, min_rows, cap):
    """A split with every slice ``>= min_rows`` rows and cost ``<= cap``, or None: forward reachability
    of boundary positions (one boolean per grid point and rank, ``O(cp T / align)``), then a walk back."""
    total = prefix.size - 1
    points = np.unique(np.append(grid, total))
    n = points.size
    pp = prefix[points]
    reach = [np.zeros(n, dtype=bool)]
    reach[0][0] = True
    index = np.arange(n)
    # a slice from point i may end at points j in [first[i], last[i]]: points[j] >= points[i] + min_rows
    # and pp[j] <= pp[i] + cap
    first = np.searchsorted(points, points + min_rows, side="left")
    last = np.searchsorted(pp, pp + cap, side="right") - 1
    for _ in range(cp):
        ok = reach[-1] & (first <= last)
        opened = np.bincount(first[ok], minlength=n + 1) - np.bincount(last[ok] + 1, minlength=n + 1)
        reach.append(np.cumsum(opened[:n]) > 0)
    if not reach[cp][n - 1]:
        return None
    bounds, j = [total], n - 1
    for rank in range(cp, 0, -1):
        starts = index[reach[rank - 1] & (first <= j) & (j <= last)]
        j = int(starts[0])
        bounds.append(int(points[j]))
    return bounds[::-1]


# ---------------------------------------------------------------------------------- entry point
def partition(
    packed: PackedSeqs | Sequence[int], cp: int, cfg: DSv4Config, ratio: int, *, policy: str = "equal",
    machine=None, align: int = 1, min_rows: int | None = None, costs: RowCosts | None = None,
    total: int | None = None, direction: str = "fwd+bwd", calibration: PhaseFactors | None = None,
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
            then equalises measured-like per-rank times (see :meth:`RowCosts.for_layer`).

    Identical inputs give the identical split on every rank (host arithmetic only).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: must be one of {DIRECTIONS}, got {direction!r}")
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
    costs = costs or RowCosts.for_layer(cfg, ratio, machine, direction, calibration)
    prefix = np.concatenate(([0.0], np.cumsum(row_costs(costs, cu, total, cfg, ratio))))
    return balanced_split(prefix, cp, floor, align)
