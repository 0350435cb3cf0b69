"""Closed-form per-rank work counts of one layer under the contiguous CP layout (docs/design.md §3).

Everything here is EXACT integer arithmetic over DOCUMENTS, never over tokens: for every rank the documents
overlapping its slice are found by binary search, and the sums over the rank's rows of per-query key
counts come from prefix-sum formulas evaluated at the two ends of each document segment. Cost is
``O(n_docs + cp)`` per layer, so 1M tokens at cp 64 take milliseconds. The sums grow as ``T^2 / r``
and leave int64 from ``T = 2^33`` rows, so they are Python ints (numpy object arrays): exact at any
size (tested to ``2^40`` rows against the triangular-number closed form). The results equal, row for
row, what :func:`dsv4cp.cp.layout.build_layout` produces (the tests count brute force on it).

Per query at document position ``t`` (padded documents; rows of the tail padding segment see nothing):

* window keys ``min(t + 1, W)`` (docs/design.md §1.1);
* visible compressed entries ``(t + 1) // r`` (docs/design.md §1.4 causality);
* compressed keys used by the attention: all visible entries for H layers, ``min(K, visible)`` for C
  layers (the indexer's top-K, padded with -1 when fewer are visible).

Prefix sums used (``n`` = number of leading positions of a document, ``u = t + 1``):

* ``sum_{u=1..n} min(u, W)`` = ``n (n + 1) / 2`` if ``n <= W`` else ``W (W + 1) / 2 + (n - W) W``;
* ``sum_{u=1..n} floor(u / r)`` = ``r q (q - 1) / 2 + q (m + 1)`` with ``q, m = divmod(n, r)``;
* ``sum_{u=1..n} min(K, floor(u / r))``: the previous sum up to ``u = K r - 1``, then ``K`` per term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.layout import RankSizes, entry_capacity, halo_rows, split_rows
from dsv4cp.cp.partition import RowSplit, as_split
from dsv4cp.packing import PackedSeqs

DocsLike = PackedSeqs | Sequence[int] | np.ndarray
"""A packed batch: a :class:`PackedSeqs` (its PADDED extents are used) or a list of document lengths
(concatenated without padding)."""


def document_extents(docs: DocsLike, total: int | None = None) -> tuple[np.ndarray, int]:
    """``(cu_padded int64 [n_docs + 1], total)`` of a packed batch.

    ``total`` defaults to ``packed.total`` (PackedSeqs) or to the sum of the lengths; a larger value
    adds a tail padding segment, a smaller one is an error.
    """
    if isinstance(docs, PackedSeqs):
        cu = np.asarray(docs.cu_seqlens_padded.cpu().tolist(), dtype=np.int64)
        if total is None:
            total = docs.total
    else:
        lengths = np.asarray(list(docs) if not isinstance(docs, np.ndarray) else docs)
        if lengths.ndim != 1:
            raise ValueError(f"lengths: must be a flat sequence of ints, got shape {lengths.shape}")
        if lengths.size and (not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any()):
            bad = lengths[(lengths < 0)] if np.issubdtype(lengths.dtype, np.number) else lengths
            raise ValueError(f"lengths: must be non-negative ints, got {bad[:5].tolist()!r}")
        cu = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
    end = int(cu[-1])
    if total is None:
        total = end
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)):
        raise ValueError(f"total: must be an int, got {total!r}")
    total = int(total)
    if total < end:
        raise ValueError(f"total: must be >= the padded end {end} of the documents, got {total}")
    if total <= 0:
        raise ValueError(f"total: the batch must hold at least one row, got {total}")
    return cu, total


# ---------------------------------------------------------------------------------- prefix sums
def _exact(n) -> np.ndarray:
    """``n`` as an array of Python ints (object dtype): products of positions overflow int64."""
    return np.asarray(n).astype(object)


def window_prefix(n: np.ndarray, window: int) -> np.ndarray:
    """``sum_{t < n} min(t + 1, W)``: window keys of a document's first ``n`` positions."""
    n = _exact(n)
    w = int(window)
    return np.where(n <= w, n * (n + 1) // 2, w * (w + 1) // 2 + (n - w) * w)


def floor_prefix(n: np.ndarray, r: int) -> np.ndarray:
    """``sum_{t < n} (t + 1) // r``: visible entries summed over a document's first ``n`` positions."""
    n = _exact(n)
    q, m = n // r, n % r
    return r * q * (q - 1) // 2 + q * (m + 1)


def clamped_floor_prefix(n: np.ndarray, r: int, k: int) -> np.ndarray:
    """``sum_{t < n} min(K, (t + 1) // r)``: top-K-limited compressed keys of the first ``n`` positions."""
    n = _exact(n)
    knee = int(k) * r  # first u with floor(u / r) == K
    return np.where(n < knee, floor_prefix(n, r), floor_prefix(knee - 1, r) + k * (n - knee + 1))


# ---------------------------------------------------------------------------------- counts
@dataclass(frozen=True)
class RankCounts(RankSizes):
    """Integer work counts of one layer on every rank (arrays are ``[cp]``, rank-indexed; the halo
    arrays int64, the work sums exact Python ints in object arrays: they exceed int64 past 2^33 rows).

    Attributes:
        kind, ratio, cp, total: the layer and the batch.
        rows: own rows of the largest rank (``L = total / cp`` with equal slices).
        rank_rows: ``[cp]`` int64 own rows of each rank (the split's slice sizes).
        halo: ``Hw`` borrowed rows per rank (0 at cp = 1); every rank projects ``halo + rows`` rows
            (rank 0 projects zero rows in place of a halo, exactly as the layer does).
        capacity: gathered slots per rank, ``ceil(rows / r)`` of the largest rank (0 for W layers).
        n_docs: documents with at least one row.
        max_entries_per_doc: ``max padded length // r`` (sets the H layers' static key width).
        halo_recv_rows / halo_send_rows: rows received from rank - 1 / sent to rank + 1 (forward).
        query_rows: own rows inside a document (the rest is tail padding and sees no key).
        window_keys: sum over own rows of ``min(pos + 1, W)``.
        visible_entries: sum over own rows of ``(pos + 1) // r`` (indexer scoring work; 0 for W).
        compressed_keys: compressed keys of the attention: ``visible_entries`` (H) or
            ``sum min(K, (pos + 1) // r)`` (C); 0 for W.
        owned_entries: compressed entries whose LAST row the rank holds (it computes exactly these).
    """

    kind: str
    ratio: int
    cp: int
    total: int
    rows: int
    halo: int
    capacity: int
    n_docs: int
    max_entries_per_doc: int
    rank_rows: np.ndarray
    halo_recv_rows: np.ndarray
    halo_send_rows: np.ndarray
    query_rows: np.ndarray
    window_keys: np.ndarray
    visible_entries: np.ndarray
    compressed_keys: np.ndarray
    owned_entries: np.ndarray

    @property
    def attention_keys(self) -> np.ndarray:
        """``[cp]`` valid (query, key) pairs of the sparse attention per rank (per head)."""
        return self.window_keys + self.compressed_keys


def rank_counts(
    cfg: DSv4Config, ratio: int, docs: DocsLike, cp: int, total: int | None = None,
    split: RowSplit | None = None,
) -> RankCounts:
    """Closed-form :class:`RankCounts` of a ``ratio`` layer on ``docs`` split over ``cp`` ranks
    (``split``: the ranks' row ranges; None: equal slices).

    Raises ``ValueError`` (naming the field) for the inputs :func:`build_layout` rejects: a bad ratio,
    ``cp < 1``, ``total`` not divisible by ``cp`` (equal slices), fewer rows on a rank than the halo.
    """
    cfg.check_ratio(ratio)
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"cp: must be a positive int, got {cp!r}")
    cp = int(cp)
    cu, total = document_extents(docs, total)
    if split is None:
        rows, halo = split_rows(total, cp, cfg, ratio, field="total")
        split = RowSplit.equal(total, cp)
    else:
        halo = halo_rows(cfg, ratio, cp)
        split = as_split(split, total, cp, max(halo, 1))
    kind = layer_kind(ratio)
    starts_all, ends_all = cu[:-1], cu[1:]
    nonempty = ends_all > starts_all
    starts, ends = starts_all[nonempty], ends_all[nonempty]
    lengths = ends - starts

    fields = ("query_rows", "window_keys", "visible_entries", "compressed_keys", "owned_entries")
    out = {name: np.zeros(cp, dtype=object) for name in fields}
    for rho in range(cp):
        s, e = split.bounds[rho], split.bounds[rho + 1]
        lo = int(np.searchsorted(ends, s, side="right"))  # first document ending after s
        hi = int(np.searchsorted(starts, e, side="left"))  # documents starting before e
        if hi <= lo:
            continue
        a, b, n = starts[lo:hi], ends[lo:hi], lengths[lo:hi]
        t0 = np.maximum(a, s) - a  # positions [t0, t1) of each document lie on this rank
        t1 = np.minimum(b, e) - a
        out["query_rows"][rho] = int((t1 - t0).sum())
        out["window_keys"][rho] = int((window_prefix(t1, cfg.window) - window_prefix(t0, cfg.window)).sum())
        if ratio == 0:
            continue
        visible = floor_prefix(t1, ratio) - floor_prefix(t0, ratio)
        out["visible_entries"][rho] = int(visible.sum())
        if kind == "C":
            k = cfg.index_topk
            used = clamped_floor_prefix(t1, ratio, k) - clamped_floor_prefix(t0, ratio, k)
            out["compressed_keys"][rho] = int(used.sum())
        else:
            out["compressed_keys"][rho] = out["visible_entries"][rho]
        # entry j of a document ends at row a + (j + 1) r - 1: those ending before x number
        # clip((x - a) // r, 0, n // r); the rank owns the ones ending in [s, e).
        full = n // ratio
        ending_before_e, ending_before_s = (np.clip((x - a) // ratio, 0, full) for x in (e, s))
        out["owned_entries"][rho] = int((ending_before_e - ending_before_s).sum())

    ranks = np.arange(cp, dtype=np.int64)
    recv = np.where(ranks > 0, halo, 0).astype(np.int64)
    send = np.where(ranks < cp - 1, halo, 0).astype(np.int64)
    max_len = int(lengths.max()) if lengths.size else 0
    return RankCounts(
        kind=kind, ratio=ratio, cp=cp, total=total, rows=split.max_rows, halo=halo,
        capacity=entry_capacity(split.max_rows, ratio), n_docs=int(nonempty.sum()),
        max_entries_per_doc=max_len // ratio if ratio else 0, rank_rows=np.asarray(split.rank_rows, dtype=np.int64),
        halo_recv_rows=recv, halo_send_rows=send, **out,
    )
