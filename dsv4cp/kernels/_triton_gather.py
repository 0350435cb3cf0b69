"""The gather of selected rows shared by the Triton kernels that read keys through an index: the sparse
attention's forward and dq kernels, the attention probabilities' two kernels and the indexer scores'
forward and backward (:mod:`.sparse_attention_triton`, :mod:`.attention_probs_triton`,
:mod:`.indexer_scores_triton`); and the count of a query's selected slots that every sparse-attention
kernel loops over (:func:`selected_length`).

Imports triton: only the kernel modules, themselves imported lazily, import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def selected_length(TOPK, t, KT, HAS_TOPK: tl.constexpr):
    """How many of query ``t``'s ``KT`` selected slots count: ``TOPK[t]`` (its ``topk_length``) clamped to
    ``0..KT`` when ``HAS_TOPK``, else all ``KT``."""
    kt_len = KT
    if HAS_TOPK:
        kt_len = tl.minimum(tl.maximum(tl.load(TOPK + t).to(tl.int32), 0), KT)
    return kt_len


@triton.jit
def gather_rows(TABLE, IDX_ROW, slots, slot_mask, n_rows, stride_n, d, dmask, D: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    """``(rows, valid, tile)`` of one step over a query's selected slots: ``rows [BLOCK_K]`` int64 read
    from ``IDX_ROW + slots`` (``-1`` where ``slot_mask`` is off), ``valid`` = ``0 <= rows < n_rows`` (an
    out-of-range row reads nothing: no memory fault), and ``tile [BLOCK_K, BLOCK_D]`` = ``TABLE[rows, d]``
    (rows ``stride_n`` apart, zero at invalid rows and at columns ``d >= D``), upcast to fp32 when
    ``DOT_F32`` (Triton's CPU interpreter multiplies bf16 tiles wrongly). Without head-dim padding
    (``D == BLOCK_D``) the load is masked by row only: fewer predicate registers."""
    rows = tl.load(IDX_ROW + slots, mask=slot_mask, other=-1)
    return gather_loaded_rows(TABLE, rows, n_rows, stride_n, d, dmask, D, BLOCK_D, DOT_F32)


@triton.jit
def gather_loaded_rows(TABLE, rows, n_rows, stride_n, d, dmask, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_F32: tl.constexpr):
    """:func:`gather_rows` for row indices already loaded (``rows [BLOCK_K]`` int32 or int64, ``-1`` for
    an empty slot): a kernel that loads a step's indices one step ahead keeps their latency off the path
    to the gather."""
    rows = rows.to(tl.int64)
    valid = (rows >= 0) & (rows < n_rows)
    if D == BLOCK_D:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & dmask[None, :]
    tile = tl.load(TABLE + rows[:, None] * stride_n + d[None, :], mask=mask, other=0.0)
    if DOT_F32:
        tile = tile.to(tl.float32)
    return rows, valid, tile
