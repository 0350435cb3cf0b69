"""Host planning of the Triton indexer top-k (docs/design.md §4.2): which query rows each chunk
scores against which key-row range, under a byte budget. Plain Python and torch, no triton import:
tested on CPU without the interpreter.

* :func:`query_limits`: per query, how many entries of its document it sees.
* :func:`key_ranges`: per query, the half-open range of key rows holding its visible keys (on the device).
* :func:`plan_chunks` (exact): chunks from those ranges, read to the host once per call; a chunk's
  columns then cover only its own documents' keys.
* :func:`plan_static_chunks` (static, what the layer uses): the same chunking from sizes and the causal
  bound of a CP layout (``key_row_limit``: query row t sees no key row past ``base + t // ratio``). No
  device->host copy (it would stall the CPU behind the index-key all-gather on every C-layer forward)
  and one plan for every batch of the same sizes, so a CUDA graph of the layer replays correctly on new
  data. Early causal rows get narrow chunks; in a multi-document batch a chunk's columns still start at
  key row 0 (the other documents' tiles are skipped by the kernel, but the selection scans their
  ``-inf`` columns).
* :func:`aligned_columns`, :func:`check_chunking`: a chunk's buffer columns, the planner's limits.

Chunks keep ``rows * width * bytes_per_score`` below a byte budget (default :data:`TOPK_BUDGET_BYTES`
= 1 GiB); ``bytes_per_score`` depends on the selection (:data:`TOPK_BYTES_PER_SCORE`,
:data:`TOPK_SCORES_BYTES_PER_SCORE`, :data:`TOPK_RADIX_BYTES_PER_SCORE`).
"""

from __future__ import annotations

import torch

from dsv4cp.kernels.contracts import check_key_row_limit as _check_key_row_limit

__all__ = [
    "TOPK_BUDGET_BYTES",
    "TOPK_BYTES_PER_SCORE",
    "TOPK_RADIX_BYTES_PER_SCORE",
    "TOPK_SCORES_BYTES_PER_SCORE",
    "aligned_columns",
    "check_chunking",
    "key_ranges",
    "plan_chunks",
    "plan_static_chunks",
    "query_limits",
]

TOPK_BUDGET_BYTES = 2**30
"""Default byte budget of one top-k chunk: the ``[rows, width]`` score buffer and the selection's
temporaries (``rows * width * bytes_per_score``)."""

TOPK_BYTES_PER_SCORE = 16
"""Bytes per ``[rows, width]`` element held while a chunk is selected on the default (``packed``) path:
8 (the kernel's int64 key buffer) + 8 for ``torch.topk`` (its ``[rows, keep]`` int64 values and indices
and its workspace: well under 8 per element while ``keep`` is below half the width, the rule in the
layer, where chunks span thousands of key rows for ``k = 512``). The planners' default."""

TOPK_SCORES_BYTES_PER_SCORE = 24
"""The same on the ``scores`` path (kernel option ``topk_keys``): 4 (fp32 score) + 8 (the int64 key that
``_select_top`` builds) + 8 (one int64 temporary while the key is built) + topk's workspace."""

TOPK_RADIX_BYTES_PER_SCORE = 4
"""The same on the ``radix`` selection (kernel option ``topk_select``): the fp32 score alone (the radix
kernel keeps its histograms on chip and writes only the ``[rows, k]`` result), so a chunk holds 4x the
rows of the packed path's."""

_PLAN_ROWS = 64
"""Row granularity of the chunk planner (query-block aligned for every ladder's BLOCK_M <= 64)."""

_NO_KEY = 2**62
"""Lower key-row bound of a group of queries that sees no key (above every key row)."""


def query_limits(doc: torch.Tensor, pos: torch.Tensor, ratio: int = 4) -> torch.Tensor:
    """``[T]`` int64 visible-entry counts ``(pos + 1) // ratio``, 0 for rows outside every document
    (``doc < 0``): the ``query_limit`` argument for a layout's ``(local_doc, local_pos)``."""
    return torch.where(doc >= 0, torch.div(pos + 1, ratio, rounding_mode="floor"), 0).to(torch.int64)


@torch.no_grad()
def key_ranges(
    query_doc: torch.Tensor, query_limit: torch.Tensor, key_doc: torch.Tensor, key_j: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the half-open range ``[lo, hi)`` of key rows that holds every key visible to it
    (``lo = hi = 0`` when none is). Exact bounds of the visible rows, also when a document's rows are
    not monotone in ``key_j``. All on the device (no host synchronisation); ``O((T + G) log G)``.

    How: valid keys (``key_doc >= 0``) are sorted by ``(doc, j)``; query (doc, limit) sees the sorted
    segment ``[p0, p1)`` found by binary search; segmented prefix max / min of the key rows over the
    sorted order (a running max of ``doc * (G + 1) + row`` resets at each new document) give hi / lo.
    """
    dev = key_doc.device
    g = key_doc.numel()
    t = query_doc.numel()
    lo = torch.zeros(t, dtype=torch.int64, device=dev)
    hi = torch.zeros(t, dtype=torch.int64, device=dev)
    if g == 0 or t == 0:
        return lo, hi
    kdoc, kj = key_doc.to(torch.int64), key_j.to(torch.int64)
    qdoc, qlim = query_doc.to(torch.int64), query_limit.to(torch.int64)
    valid = kdoc >= 0
    # composite sort key doc * big + j, with big above every j and every limit (all on the device)
    big = torch.maximum(kj.clamp_min(0).max(), qlim.clamp_min(0).max()) + 1
    comp = torch.where(valid & (kj >= 0), kdoc * big + kj, torch.full_like(kdoc, -1))
    sorted_comp, order = torch.sort(comp, stable=True)
    sdoc = torch.where(sorted_comp >= 0, kdoc[order], -1)
    span = g + 1
    base = sdoc * span
    run_max = torch.cummax(torch.where(sdoc >= 0, base + order, -1), 0).values - base  # prefix max row
    run_min = g - (torch.cummax(torch.where(sdoc >= 0, base + (g - order), -1), 0).values - base)
    live = (qdoc >= 0) & (qlim > 0)
    start = torch.searchsorted(sorted_comp, torch.where(live, qdoc * big, -2))
    stop = torch.searchsorted(sorted_comp, torch.where(live, qdoc * big + qlim, -2))
    has = live & (stop > start)
    last = (stop - 1).clamp(0, g - 1)
    lo = torch.where(has, run_min[last], 0)
    hi = torch.where(has, run_max[last] + 1, 0)
    return lo, hi


def plan_chunks(
    lo: torch.Tensor, hi: torch.Tensor, budget_bytes: int = TOPK_BUDGET_BYTES, max_rows: int | None = None,
    bytes_per_score: int = TOPK_BYTES_PER_SCORE,
) -> list[tuple[int, int, int, int]]:
    """Chunks ``(start, stop, col0, width)`` of queries covering ``[0, T)`` in order, each with the key
    columns ``[col0, col0 + width)`` that hold every key visible to its rows (``width = 0``: none), such
    that ``rows * width * bytes_per_score <= budget_bytes`` (a single row may exceed it: a chunk never
    has fewer than one row) and ``rows <= max_rows`` when given.

    Planned from the exact per-query ranges ``lo, hi`` (:func:`key_ranges`), which live on the device:
    this reads them to the host (the per-group bounds once, and the rows of any group that alone
    exceeds the budget), so it synchronises with the device. :func:`plan_static_chunks` does not.
    """
    t = lo.numel()
    gran = _check_plan(budget_bytes, max_rows)
    if t == 0:
        return []
    n_groups = -(-t // gran)
    empty = hi <= lo
    glo = torch.full((n_groups * gran,), _NO_KEY, dtype=torch.int64, device=lo.device)
    ghi = torch.zeros(n_groups * gran, dtype=torch.int64, device=lo.device)
    glo[:t] = torch.where(empty, _NO_KEY, lo.to(torch.int64))
    ghi[:t] = torch.where(empty, 0, hi.to(torch.int64))
    glo, ghi = glo.view(n_groups, gran).amin(1), ghi.view(n_groups, gran).amax(1)

    def split(start: int, stop: int, per: int) -> list[tuple[int, int, int, int]]:
        row_lo, row_hi = lo[start:stop].tolist(), hi[start:stop].tolist()
        pieces = []
        for a in range(0, stop - start, per):
            live = [(x, y) for x, y in zip(row_lo[a:a + per], row_hi[a:a + per]) if y > x]
            p_lo = min((x for x, _ in live), default=0)
            p_hi = max((y for _, y in live), default=0)
            pieces.append((start + a, min(start + a + per, stop), p_lo, p_hi - p_lo))
        return pieces

    return _greedy_chunks(t, gran, list(zip(glo.tolist(), ghi.tolist())), split, budget_bytes, max_rows,
                          bytes_per_score)


def plan_static_chunks(
    t: int, g: int, key_row_limit: tuple[int, int] | None = None, budget_bytes: int = TOPK_BUDGET_BYTES,
    max_rows: int | None = None, bytes_per_score: int = TOPK_BYTES_PER_SCORE,
) -> list[tuple[int, int, int, int]]:
    """The chunks of :func:`plan_chunks` for ``t`` queries and ``g`` key rows, planned from sizes alone:
    no device read, and the same plan for every batch of these sizes (so a CUDA graph captured with it
    stays correct when replayed on other data).

    Every chunk's columns start at key row 0. Without ``key_row_limit`` they span all ``g`` key rows;
    with ``key_row_limit = (base, ratio)``, a guarantee from the caller that query row ``t`` sees no key
    row at or past ``base + t // ratio + 1`` (:attr:`dsv4cp.cp.layout.RankLayout.key_row_limit`: the
    causal bound of a CP layout's gathered buffer), a chunk of rows ``[start, stop)`` spans key rows
    ``[0, min(g, base + (stop - 1) // ratio + 1))``, so early query rows get narrow chunks as with the
    exact planner. The windows contain the exact planner's and the selection ignores invisible columns
    (their scores are ``-inf``), so from the same scores both plans select the same keys. The price: in
    a multi-document batch the selection also scans the other documents' (``-inf``) columns.
    """
    gran = _check_plan(budget_bytes, max_rows)
    base, ratio = _check_key_row_limit(key_row_limit)
    if t == 0 or g == 0:
        return []

    def width(stop: int) -> int:  # key rows [0, width) hold every key visible to the rows before stop
        return g if ratio == 0 else min(g, base + (stop - 1) // ratio + 1)

    n_groups = -(-t // gran)
    bounds = [(0, width(min((i + 1) * gran, t))) for i in range(n_groups)]

    def split(start: int, stop: int, per: int) -> list[tuple[int, int, int, int]]:
        return [(a, min(a + per, stop), 0, width(min(a + per, stop))) for a in range(start, stop, per)]

    return _greedy_chunks(t, gran, bounds, split, budget_bytes, max_rows, bytes_per_score)


def _check_plan(budget_bytes: int, max_rows: int | None) -> int:
    """Validate the planner's limits; return its row granularity (query-block aligned)."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"chunk: must be a positive number of query rows, got {max_rows}")
    return _PLAN_ROWS if max_rows is None else max(1, min(_PLAN_ROWS, max_rows))


def _greedy_chunks(t, gran, bounds, split, budget, max_rows, bytes_per_score) -> list[tuple[int, int, int, int]]:
    """Greedy chunking shared by both planners. ``bounds``: host ``(lo, hi)`` key-row bounds of each group
    of ``gran`` query rows (``lo = _NO_KEY, hi = 0``: no key); ``split(start, stop, per)``: the pieces of
    ``per`` rows of a group that alone exceeds the budget, each with its own bounds. A chunk grows by
    whole groups while it fits, so short documents and early causal rows give wide-row, narrow-column
    chunks."""
    cap = t if max_rows is None else max_rows
    chunks: list[tuple[int, int, int, int]] = []
    i, n_groups = 0, len(bounds)
    while i < n_groups:
        c_lo, c_hi = bounds[i]
        j = i + 1
        while j < n_groups:
            n_lo, n_hi = min(c_lo, bounds[j][0]), max(c_hi, bounds[j][1])
            rows = min((j + 1) * gran, t) - i * gran
            width = max(n_hi - n_lo, 0)
            if rows > cap or rows * width * bytes_per_score > budget:
                break
            c_lo, c_hi = n_lo, n_hi
            j += 1
        start, stop = i * gran, min(j * gran, t)
        width = max(c_hi - c_lo, 0)
        if width == 0 or (stop - start) * width * bytes_per_score <= budget:
            chunks.append((start, stop, c_lo if width > 0 else 0, width))
        else:
            chunks.extend(split(start, stop, max(1, budget // (width * bytes_per_score))))
        i = j
    return chunks


def check_chunking(chunk: int | None, budget_bytes: int | None) -> int:
    """Validate the chunked path's row cap and byte budget; return the budget in bytes."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: must be a positive int (query rows per chunk), got {chunk!r}")
    budget = TOPK_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if budget <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    return budget



def aligned_columns(col0: int, width: int, g: int) -> tuple[int, int]:
    """Widen ``[col0, col0 + width)`` to a multiple of 16 columns inside ``[0, g)`` (a superset: the
    kernel masks what is invisible), so buffer rows start 64-byte aligned and stores vectorise."""
    padded = min(g, -(-width // 16) * 16)
    return min(col0, g - padded), padded

