"""Triton kernels of the lightning indexer's scoring and chunked top-k (docs/design.md §1.5, 3.4 step 4, 4.2).

The indexer score of query t and compressed entry (key row) g is::

    I[t, g] = sum_h w[t, h] * relu(<q[t, h], keys[g]>)      over the entries visible to t only

with q ``[T, Hi, Di]``, w ``[T, Hi]``, keys ``[G, Di]`` (the gathered indexer keys of every CP rank).
Visibility in a CP layout (:meth:`dsv4cp.cp.layout.RankLayout.visible_mask`): key row g is visible to
query t iff ``query_doc[t] >= 0 and key_doc[g] == query_doc[t] and key_j[g] < query_limit[t]`` with
``query_limit = (pos + 1) // 4`` (0 for rows outside every document). Keys of one document need not be
contiguous (rank-major gathered blocks with capacity padding) but are in increasing entry order.

Public API:

* :func:`indexer_topk_triton` (no grad): the ``k`` best visible key rows per query by score buffers and
  a selection (the "chunked" path), same contract and tie rule as :func:`dsv4cp.ops.indexer.indexer_topk`.
  The op (:func:`dsv4cp.ops.indexer.fused_indexer_topk`) chooses between it and the one-pass streaming
  kernel of :mod:`dsv4cp.kernels.indexer_topk_triton`, and the selection, from the kernel options.
* :func:`indexer_score_matrix` (no grad): the masked fp32 scores of a block of key rows (``-inf``
  where invisible), the kernel the top-k wrapper runs per chunk; exposed for tests and benchmarks.
* :func:`iter_score_chunks`: the top-k wrapper's scoring half (chunks of masked scores, no selection).
* :class:`IndexerConfig`: the score kernel's launch configuration.

The chunk planning (which rows score which key-row range under a byte budget) is host code in
:mod:`dsv4cp.kernels.indexer_plan`; the differentiable scores at given key rows are in
:mod:`dsv4cp.kernels.indexer_scores_triton`.

Score kernel design (``_score_kernel``). One program per (block of ``BLOCK_M`` queries, block of
``BLOCK_N`` key rows). The key tile ``[BLOCK_N, Di]`` is loaded once and stays on chip (shared memory,
the matrix unit's B operand) for all heads; the program loops over the ``Hi`` heads and for each one
loads the query tile ``q[:, h, :]`` (``[BLOCK_M, Di]``, rows ``Hi * Di`` elements apart, 256 contiguous
bytes each: a pipelined, coalesced load), computes ``s_h = q_h @ k^T`` on the matrix unit (bf16 in,
fp32 accumulate: wgmma on sm_90) and folds it into
ONE fp32 accumulator ``acc += w[:, h, None] * relu(s_h)``. Per-head score matrices never exist beyond
one ``[BLOCK_M, BLOCK_N]`` register tile. Why this arrangement: the head reduction happens in
registers, element-wise, between products that share the B operand, so nothing is reshaped across rows
(putting ``[T * Hi]`` rows on M would need a cross-row reduction over heads, a shared-memory shuffle per
tile), and the matrix unit's K dimension is ``Di = 128`` (8 x k16 steps per head). Traffic: every
(query block, key block) pair re-reads its ``BLOCK_M x Hi x Di`` queries, ``BLOCK_N`` matrix FLOPs per
byte, so a WIDE key tile matters more than a tall query tile; programs run in query-block-major order
(key block fastest), so the programs in flight share their query tiles through L2. Default tile on
sm_90 (Di <= 128, bf16): ``BLOCK_M = 64, BLOCK_N = 128, 4 warps, 3 stages``, two programs per SM (one's
epilogue runs under the other's products; faster than the previous default, ``BLOCK_M = 64, BLOCK_N =
256, 8 warps, 3 stages``: docs/kernels.md). That one, checked by compiling for
sm_90a with Triton 3.9 without a GPU (``triton.compile`` with the runtime's 16-divisibility
specialisation of pointers and strides, then ptxas -v): two warpgroups, each owning 128 of the 256
columns (``wgmma m64n128k16``, 8 per head), ``acc`` and ``s_h`` 64 fp32 registers per thread each,
201 registers, no spill; 112 KB shared memory (64 KB of keys + 3 x 16 KB of cp.async-pipelined query
tiles); 16-byte vector loads and stores. Per head and tile: 2 x 64 x 256 x 128 matrix FLOPs against
~2 fp32 ops per accumulator element (max, FMA) on the CUDA cores, which Triton does not overlap with the
next head's wgmma (it waits for each product before its epilogue), so expect ~25% epilogue overhead
on top of the matrix time. The ladder (``128 x 128``: 245 registers, 128 KB; ``64 x 128 x 8 warps``:
134 registers, 80 KB; smaller tiles) takes over on ``OutOfResources``; which tile is fastest on the
H200 is what ``bench/test_bench_indexer.py::test_indexer_score_config`` measures.

Head pairs (``HEAD_PAIRS``, kernel option ``triton_indexer_head_pairs``, off by default): the head loop
takes two heads per iteration and keeps the second one's product on the matrix unit while the first
one's epilogue runs (:func:`_head_pair_sum` says how Triton and ptxas are led there), so the program
itself overlaps half of its epilogues instead of relying on the second program of the SM. It holds one
more fp32 tile in registers and two query streams in shared memory, so it has its own ladder, led by the
tile where that fits (``64 x 128 x 8 warps``; ``python -m bench.compile_indexer_score_sm90`` prints both
loops' resources and order of products, waits and epilogues for sm_90a). Same sums in the same order:
the same scores bit for bit.

Skipping: a tile whose queries see none of its keys (other documents, causally invisible, padding
slots) loads no keys, runs zero head iterations and only stores ``-inf``. On top of that the wrapper
narrows every query chunk to a key-row range holding every key its queries can see (two planners,
static and exact: :mod:`dsv4cp.kernels.indexer_plan`). With the ``bounded`` radix select the top-k
also computes each query's exact key-row range ``[lo, hi)`` on the device (:func:`key_ranges`, no host
read): the select scans only those columns of its row and the score kernel (``IN_RANGE_ONLY``) writes
only those (in a batch of many packed documents the static plan's chunks start at key row 0, so most of
a row is other documents' ``-inf``, which is then neither written nor read). Compiled for sm_90a with
Triton 3.9, the range mask leaves the default tile at 197 registers, no spill.

Top-k wrapper (:func:`indexer_topk_triton`): queries are processed in chunks; for each chunk the kernel
fills a ``[rows, width]`` buffer (``width`` = the chunk's visible key-row range, never the full
``[T, G]`` matrix), and a selection picks each row's best ``k``, by one of two selections
(the ``select`` keyword; kernel option ``topk_select``):

* ``radix`` (the default on CUDA): the buffer holds fp32 scores and
  :func:`dsv4cp.kernels.select_top_triton.select_top_triton` selects them in one Triton kernel (radix
  select, one program per row, the output already in column order; with ``key_row_limit`` each row
  reads only the columns its causal bound allows). Planned at :data:`TOPK_RADIX_BYTES_PER_SCORE` = 4
  (the fp32 score; no temporaries).
* ``torch`` (the default under the interpreter): the kernel's epilogue packs each score's
  order-preserving fp32 bits above ``2^32 - 1 - column`` (the tie rule, ties at the cut to the lowest key
  rows, in one comparison) into int64 keys, so ``_select_top_packed`` is one ``torch.topk`` over the
  buffer and a decode (``keys="scores"``: fp32 scores, keys built by ``_select_top``; kernel option
  ``topk_keys``). Planned at ``TOPK_BYTES_PER_SCORE = 16``: the int64 key and ``torch.topk``'s
  outputs and workspace (the fp32 path: :data:`TOPK_SCORES_BYTES_PER_SCORE` = 24).

Chunks are planned (:func:`~dsv4cp.kernels.indexer_plan.plan_chunks`) so ``rows * width *
bytes_per_score`` stays below a byte budget (default :data:`TOPK_BUDGET_BYTES` = 1 GiB). A chunk's
column range is widened to a multiple of 16 key rows (aligned buffer rows, vector stores). Peak memory
beyond inputs and outputs is therefore about the budget plus ``O(T)`` metadata (per-query ranges, the
int32 visibility arrays, the fp32 transposed head weights ``[Hi, T]``).

Kernels are built lazily per execution mode: CUDA tensors use compiled ``triton.jit`` kernels, CPU
tensors Triton's interpreter (tiny sizes only; ``TRITON_INTERPRET=1`` must be set before triton's first
import). Configurations: the ``config`` keyword (an :class:`IndexerConfig` or the integers of the kernel
option ``triton_indexer_config``, ``"block_m,block_n,num_warps,num_stages"``; default: the ladder) pins the
score kernel's launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels._triton_launch import (
    Kernels,
    OutOfResources,  # noqa: F401  (re-exported: callers catch indexer_triton.OutOfResources)
    pinned_config,
)
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels.contracts import check_key_row_limit as _check_key_row_limit
from dsv4cp.kernels.contracts import select_top as _select_top
from dsv4cp.kernels.contracts import select_top_packed as _select_top_packed
from dsv4cp.kernels.indexer_plan import (
    TOPK_BUDGET_BYTES,
    TOPK_BYTES_PER_SCORE,
    TOPK_RADIX_BYTES_PER_SCORE,
    TOPK_SCORES_BYTES_PER_SCORE,
    aligned_columns,
    check_chunking,
    key_ranges,
    plan_chunks,
    plan_static_chunks,
)
from dsv4cp.kernels.select_top_triton import _ordered_bits, select_top_triton

__all__ = [
    "MAX_INDEX_DIM",
    "TOPK_BUDGET_BYTES",
    "TOPK_BYTES_PER_SCORE",
    "TOPK_IMPL_ENV",
    "TOPK_KEYS_ENV",
    "TOPK_RADIX_BYTES_PER_SCORE",
    "TOPK_SCORES_BYTES_PER_SCORE",
    "TOPK_SELECT_ENV",
    "TOPK_SELECTIONS",
    "TOPK_KEY_MODES",
    "IndexerConfig",
    "indexer_score_matrix",
    "indexer_topk_triton",
    "iter_score_chunks",
    "key_ranges",
    "plan_chunks",
    "plan_static_chunks",
]

TOPK_IMPL_ENV = kernel_options.OPTIONS["topk_impl"].env
"""The variable of the kernel option ``topk_impl``: the op's top-k path, ``chunked`` (default: this
module) or ``stream`` (slower: its per-tile sort-and-merge on the CUDA cores costs many times the
scoring; docs/kernels.md)."""

TOPK_SELECT_ENV = kernel_options.OPTIONS["topk_select"].env
"""The variable of the kernel option ``topk_select``, the chunked top-k's selection: ``radix`` (fp32
score buffers selected by the Triton radix select, :mod:`dsv4cp.kernels.select_top_triton`) or
``torch`` (``torch.topk`` over the buffer, as ``topk_keys`` says). ``auto`` (default): ``radix`` on CUDA,
``torch`` under Triton's interpreter (where the radix kernel is slow); setting ``radix`` runs it under
the interpreter too. Both select identically."""

TOPK_KEYS_ENV = kernel_options.OPTIONS["topk_keys"].env
"""The variable of the kernel option ``topk_keys``: on the ``torch`` selection, what the chunked
top-k's score kernel writes: ``packed`` (default: the int64 selection key of each score, built in the
kernel's epilogue; the selection is one ``torch.topk`` over the buffer) or ``scores`` (the fp32 scores;
``_select_top`` then builds the keys in torch, several passes over the buffer). Kept to compare the two
on the GPU (``bench/test_bench_indexer.py::test_indexer_topk``, ``triton-chunked`` vs
``triton-chunked-scores``); both select identically."""

TOPK_SELECTIONS = ("radix", "torch")
TOPK_KEY_MODES = ("packed", "scores")

MAX_INDEX_DIM = 256
"""Largest indexer head dim the kernels accept (one key tile ``[BLOCK_N, Di]`` per program)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class IndexerConfig:
    """Score-kernel launch: queries per program (matrix-unit M), key rows per program (N), warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

# ---------------------------------------------------------------------------------------------------
# Kernel bodies. Plain functions; ``_build`` turns each into a ``triton.jit`` kernel (CUDA) or an
# interpreted one (CPU) on first use. The device helpers they share are ``triton.jit`` functions: inlined
# into compiled kernels, interpreted with interpreted ones.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _head_sum(q_ptrs, q_mask, w_ptrs, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
              HEAD_PAIRS: tl.constexpr = False, COMPILED: tl.constexpr = False):
    """``[BLOCK_M, BLOCK_N]`` fp32 ``sum_h w_h relu(q_h @ kt)`` over heads ``h < n_heads``: ``q_ptrs``
    / ``q_mask`` address head 0's query tile (heads ``stride_qh`` apart), ``w_ptrs`` / ``rmask`` head
    0's weights (``stride_wh`` apart), ``kt [BLOCK_D, BLOCK_N]`` the key tile, on chip for every head.
    The scoring arithmetic of ``_score_kernel`` and the streaming top-k's ``_stream_topk_kernel``.
    HEAD_PAIRS: the heads two at a time (:func:`_head_pair_sum`; ``COMPILED``: built for the GPU, not
    interpreted); the same sums in the same order, so the same bits."""
    if HEAD_PAIRS:
        acc = _head_pair_sum(q_ptrs, q_mask, w_ptrs, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M, BLOCK_N,
                             PRECISION, DOT_F32, COMPILED)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for h in range(n_heads):
            qh = _query_tile(q_ptrs + h * stride_qh, q_mask, DOT_F32)
            wh = tl.load(w_ptrs + h * stride_wh, mask=rmask, other=0.0)
            s = tl.dot(qh, kt, input_precision=PRECISION)
            acc += wh[:, None] * tl.maximum(s, 0.0)
    return acc


@triton.jit
def _query_tile(ptrs, mask, DOT_F32: tl.constexpr):
    """One head's query tile ``[BLOCK_M, BLOCK_D]`` (masked rows and dims 0)."""
    qh = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 products there
        qh = qh.to(tl.float32)
    return qh


@triton.jit
def _head_pair_sum(q_ptrs, q_mask, w_ptrs, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                   COMPILED: tl.constexpr):
    """:func:`_head_sum` with the heads in pairs ``(h, h + 1)``, the product of ``h + 1`` still on the
    matrix unit while the epilogue (``acc += w * relu(s)``) of ``h`` runs; an odd last head alone.

    Why this shape (Triton 3.6 and 3.9 on sm_90, wgmma): Triton waits for a product right after it (``wait 0``)
    unless the product's only use in the loop is the loop's carried value AND every read of the carried
    value from the last iteration comes after such a wait. So per iteration: head ``h``'s product, waited
    (which also completes the carried product of ``h - 1``), the epilogue of ``h - 1``, then the product
    of ``h + 1`` issued and carried to the next iteration, then the epilogue of ``h``, which runs while
    that product is in flight. ptxas serialises every wgmma of the kernel if an instruction reads the
    registers of one in flight, which a copy of the carried product at the loop's end would do: so the
    epilogue of ``h - 1`` must be finished before the product of ``h + 1`` is issued into the same
    registers, and a register move in volatile inline asm over ``acc`` keeps the compiler from sinking
    that epilogue below the product (``COMPILED`` only: the interpreter runs no asm). Costs: one more
    ``[BLOCK_M, BLOCK_N]`` fp32 tile in registers and a second pipelined query stream in shared memory
    (``num_stages`` x 2 query tiles instead of ``num_stages``)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    carried = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the product of head h - 1
    w_carried = tl.zeros([BLOCK_M], dtype=tl.float32)  # its weights (0 before the first pair: adds +0)
    for h in range(0, n_heads - 1, 2):
        q_first = _query_tile(q_ptrs + h * stride_qh, q_mask, DOT_F32)
        q_second = _query_tile(q_ptrs + (h + 1) * stride_qh, q_mask, DOT_F32)
        w_first = tl.load(w_ptrs + h * stride_wh, mask=rmask, other=0.0)
        w_second = tl.load(w_ptrs + (h + 1) * stride_wh, mask=rmask, other=0.0)
        first = tl.dot(q_first, kt, input_precision=PRECISION)
        acc += w_carried[:, None] * tl.maximum(carried, 0.0)
        if COMPILED:  # the epilogue above is done before the product below is issued
            acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False,
                                            pack=1)
        carried = tl.dot(q_second, kt, input_precision=PRECISION)
        w_carried = w_second
        acc += w_first[:, None] * tl.maximum(first, 0.0)
    acc += w_carried[:, None] * tl.maximum(carried, 0.0)
    if n_heads % 2 == 1:
        last = n_heads - 1
        q_last = _query_tile(q_ptrs + last * stride_qh, q_mask, DOT_F32)
        w_last = tl.load(w_ptrs + last * stride_wh, mask=rmask, other=0.0)
        acc += w_last[:, None] * tl.maximum(tl.dot(q_last, kt, input_precision=PRECISION), 0.0)
    return acc


@triton.jit
def _pack_keys(scores, cols, BLOCK_N: tl.constexpr):
    """int64 selection keys of fp32 ``scores [M, BLOCK_N]`` at buffer columns ``cols [BLOCK_N]``: the layout of
    :func:`dsv4cp.kernels.contracts.pack_selection_keys` (high 32 bits: the score's order-preserving
    bits, ``-0.0`` folded into ``+0.0``; low 32 bits: ``2^32 - 1 - column``, so one comparison ranks
    by score, then lower column). Scores are packed as they are: callers map the ones to rank last."""
    low = tl.full([BLOCK_N], 0xFFFFFFFF, tl.int64) - cols.to(tl.int64)
    return (_ordered_bits(scores).to(tl.int64) << 32) | low[None, :]  # .to sign-extends, as in torch


def _score_kernel(
    Q, WT, KEYS, QDOC, QLIM, KDOC, KJ, OUT, RLO, RHI,  # pointers
    M, NCOL, COL0, N_KB, HI,  # query rows, buffer columns, first key row, key blocks per query block, heads
    stride_qt, stride_qh, stride_wh, stride_kn, stride_ot,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PACKED: tl.constexpr, IN_RANGE_ONLY: tl.constexpr,
    HEAD_PAIRS: tl.constexpr, COMPILED: tl.constexpr,
):
    """Masked head-summed scores of one (query block, key block) tile.

    Q ``[M, HI, DI]`` (rows ``stride_qt`` apart, heads ``stride_qh``), WT ``[HI, M]`` fp32 head weights
    (heads ``stride_wh`` apart: transposed so each head's weights are contiguous), KEYS ``[G, DI]``,
    QDOC / QLIM ``[M]`` int32, KDOC / KJ ``[G]`` int32. OUT ``[M, NCOL]`` (rows ``stride_ot`` apart):
    column c holds key row ``COL0 + c``. Not PACKED: fp32 scores, ``-inf`` where the key is invisible to
    the query. PACKED: int64 selection keys of those scores, exactly
    :func:`dsv4cp.kernels.contracts.pack_selection_keys` (high 32 bits: the fp32 score's order-preserving
    bits, ``-0.0`` folded into ``+0.0``, invisible and non-finite scores as ``-inf``; low 32 bits:
    ``2^32 - 1 - c``), so the selection is one ``torch.topk`` with no pass over the scores in torch.
    IN_RANGE_ONLY: RLO / RHI ``[M]`` int64 key rows: row t's scores are written at key rows
    ``[RLO[t], RHI[t])`` only (the rest of the row is left as it was, for a selection that reads no
    further), so tiles of other documents store nothing. HEAD_PAIRS: the head sum two heads at a time, one
    product in flight during the other's epilogue (:func:`_head_pair_sum`; kernel option
    ``triton_indexer_head_pairs``), bit for bit the same scores; COMPILED: built for the GPU (not interpreted).
    """
    pid = tl.program_id(0)
    qb = pid // N_KB
    kb = pid % N_KB
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < NCOL
    rows64 = rows.to(tl.int64)
    keyrow = COL0 + cols.to(tl.int64)

    qdoc = tl.load(QDOC + rows, mask=rmask, other=-1)
    qlim = tl.load(QLIM + rows, mask=rmask, other=0)
    kdoc = tl.load(KDOC + keyrow, mask=cmask, other=-2)
    kj = tl.load(KJ + keyrow, mask=cmask, other=0)
    vis = (qdoc[:, None] >= 0) & (kdoc[None, :] == qdoc[:, None]) & (kj[None, :] < qlim[:, None])
    any_vis = tl.max(vis.to(tl.int32)) > 0
    # An invisible tile loads no keys (predicated off) and runs zero head iterations.
    n_heads = tl.where(any_vis, HI, 0)
    kmask = cols < tl.where(any_vis, NCOL, 0)

    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    k = tl.load(KEYS + keyrow[:, None] * stride_kn + d[None, :], mask=kmask[:, None] & dmask[None, :],
                other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 products there
        k = k.to(tl.float32)
    kt = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    q_ptrs = Q + rows64[:, None] * stride_qt + d[None, :]
    q_mask = rmask[:, None] & dmask[None, :]
    acc = _head_sum(q_ptrs, q_mask, WT + rows64, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M, BLOCK_N,
                    PRECISION, DOT_F32, HEAD_PAIRS, COMPILED)
    out_ptrs = OUT + rows64[:, None] * stride_ot + cols[None, :]
    out_mask = rmask[:, None] & cmask[None, :]
    if IN_RANGE_ONLY:
        rlo = tl.load(RLO + rows, mask=rmask, other=0)
        rhi = tl.load(RHI + rows, mask=rmask, other=0)
        out_mask = out_mask & (keyrow[None, :] >= rlo[:, None]) & (keyrow[None, :] < rhi[:, None])
    if PACKED:
        # |acc| < inf is false for +-inf and NaN: they rank as invisible, as select_top ranks them
        scores = tl.where(vis & (tl.abs(acc) < float("inf")), acc, float("-inf"))
        tl.store(out_ptrs, _pack_keys(scores, cols, BLOCK_N), mask=out_mask)
    else:
        tl.store(out_ptrs, tl.where(vis, acc, float("-inf")), mask=out_mask)




_KERNELS = Kernels("indexer triton", _score_kernel, op="indexer_topk")
_BODIES, _BUILT, _CHOSEN = _KERNELS.bodies, _KERNELS.built, _KERNELS.chosen
_build, _launch = _KERNELS.build, _KERNELS.launch


# ---------------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------------


def _score_ladder(block_d: int, dtype: torch.dtype, interpreted: bool, head_pairs: bool = False) -> list[IndexerConfig]:
    if interpreted:  # numpy runs the tiles: small ones keep the CPU tests fast and still multi-tile
        return [IndexerConfig(16, 32, 4, 1)]
    if dtype == torch.float32:
        ladder = [(64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1), (16, 32, 4, 1)]
    elif block_d <= 128 and head_pairs:  # 64 x 128 with 8 warps first: the pairs' two fp32 tiles and the
        # accumulator fit its registers; 64 x 128 x 4 and 128 x 128 x 8 spill (sm_90a: bench.compile_indexer_score_sm90)
        ladder = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3),
                  (64, 64, 4, 2), (32, 64, 4, 1)]
    elif block_d <= 128:  # 64 x 128 with 4 warps first: two programs per SM, one's epilogue under the other's
        # products (faster than 64 x 256 x 8 at the flash shape: docs/kernels.md)
        ladder = [(64, 128, 4, 3), (64, 256, 8, 3), (64, 256, 8, 2), (128, 128, 8, 3), (64, 128, 8, 3),
                  (64, 64, 4, 2), (32, 64, 4, 1)]
    else:
        ladder = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1)]
    return [IndexerConfig(*c) for c in ladder]


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    # fp32 products stay fp32 ("ieee", not tf32): fp32 inputs, and bf16 upcast by the interpreter.
    return "ieee" if dtype == torch.float32 or _dot_f32(dtype, device) else "tf32"


def _dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    # Triton's interpreter (3.9) feeds bf16 tiles to numpy as raw uint16 in tl.dot: upcast there.
    return _interpreted(device) and dtype in (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------------


def _check_qwk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: must be [T, Hi, Di], got shape {tuple(q.shape)}")
    t, hi, di = q.shape
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q: dtype must be one of bf16, fp16, fp32 for the triton indexer, got {q.dtype}")
    if di == 0 or di % 16 != 0:
        raise ValueError(f"q: indexer dim Di must be a positive multiple of 16 (matrix-unit K), got {di}")
    if di > MAX_INDEX_DIM:
        raise ValueError(f"q: indexer dim Di must be at most {MAX_INDEX_DIM}, got {di}")
    if hi == 0:
        raise ValueError(f"q: needs at least one indexer head, got shape {tuple(q.shape)}")
    if w.dim() != 2 or tuple(w.shape) != (t, hi):
        raise ValueError(f"w: must be [{t}, {hi}] (q's T and Hi), got shape {tuple(w.shape)}")
    if not w.dtype.is_floating_point or w.dtype == torch.float64:
        raise ValueError(f"w: dtype must be fp32, bf16 or fp16, got {w.dtype}")
    if keys.dim() != 2 or keys.shape[1] != di:
        raise ValueError(f"keys: must be [G, {di}] (q's Di), got shape {tuple(keys.shape)}")
    if keys.dtype != q.dtype:
        raise ValueError(f"keys: dtype must match q ({q.dtype}), got {keys.dtype}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q: device must be cuda (or cpu under the Triton interpreter), got {q.device}")
    for name, tensor in (("w", w), ("keys", keys)):
        if tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")


def _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j) -> None:
    t, g = q.shape[0], keys.shape[0]
    for name, tensor, n in (("query_doc", query_doc, t), ("query_limit", query_limit, t),
                            ("key_doc", key_doc, g), ("key_j", key_j, g)):
        shape = tuple(getattr(tensor, "shape", ()))
        if len(shape) != 1 or shape[0] != n:
            raise ValueError(f"{name}: must be a [{n}] tensor, got {shape or type(tensor).__name__}")
        if tensor.dtype not in _INT_DTYPES:
            raise ValueError(f"{name}: dtype must be an integer type (int32 or int64), got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")
    return value


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be a positive int, got {k!r}")
    return k


# ---------------------------------------------------------------------------------------------------
# Score matrix and top-k.
# ---------------------------------------------------------------------------------------------------


def _pinned(config: IndexerConfig | tuple[int, ...] | None) -> IndexerConfig | None:
    """``config`` (an :class:`IndexerConfig` or the kernel option ``triton_indexer_config``'s integers),
    else None (the ladder); checked."""
    return pinned_config(config, IndexerConfig)


def _launch_scores(q, wt, keys, qdoc, qlim, kdoc, kj, out, s, e, col0, width, pinned, row_ranges=None,
                   head_pairs: bool = False) -> None:
    """Fill ``out [e - s, width]`` (row stride ``out.stride(0)``) with the masked scores of query rows
    ``[s, e)`` against key rows ``[col0, col0 + width)``: fp32 scores, or their packed int64 selection
    keys (columns numbered from 0 at ``col0``) when ``out`` is int64. ``row_ranges``: ``(lo, hi)`` int64
    ``[T]`` key rows: only ``[lo[t], hi[t])`` of row t is written. ``head_pairs``: the kernel's
    ``HEAD_PAIRS`` (its own ladder choice: it needs more registers and shared memory)."""
    _, hi, di = q.shape
    block_d = triton.next_power_of_2(di)
    dev = q.device
    ladder = _score_ladder(block_d, q.dtype, _interpreted(dev), head_pairs)
    kernel = _build("_score_kernel", dev)
    m = e - s
    qs, ws = q[s:e], wt[:, s:e]
    packed = out.dtype == torch.int64

    rlo, rhi = (r[s:e] for r in row_ranges) if row_ranges is not None else (qdoc, qdoc)

    def launch(cfg: IndexerConfig) -> None:
        n_kb = triton.cdiv(width, cfg.block_n)
        kernel[(triton.cdiv(m, cfg.block_m) * n_kb,)](
            qs, ws, keys, qdoc[s:e], qlim[s:e], kdoc, kj, out, rlo, rhi,
            m, width, col0, n_kb, hi,
            qs.stride(0), qs.stride(1), ws.stride(0), keys.stride(0), out.stride(0),
            DI=di, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev), PACKED=packed,
            IN_RANGE_ONLY=row_ranges is not None, HEAD_PAIRS=head_pairs, COMPILED=not _interpreted(dev),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("score", (dev.type, di, q.dtype, packed, head_pairs), ladder, pinned, launch)


@torch.no_grad()
def _prepare(q, w, keys, query_doc, query_limit, key_doc, key_j):
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys.contiguous()
    wt = w.to(torch.float32).t().contiguous()  # [Hi, T]: each head's weights contiguous
    ints = [x.to(torch.int32).contiguous() for x in (query_doc, query_limit, key_doc, key_j)]
    return (q, wt, keys, *ints)


@torch.no_grad()
def indexer_score_matrix(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    query_doc: torch.Tensor,
    query_limit: torch.Tensor,
    key_doc: torch.Tensor,
    key_j: torch.Tensor,
    col0: int = 0,
    width: int | None = None,
    *,
    config: IndexerConfig | None = None,
    head_pairs: bool = False,
) -> torch.Tensor:
    """``[T, width]`` fp32 masked indexer scores of all queries against key rows ``[col0, col0 + width)``
    (default: all ``G``): ``sum_h w relu(<q_h, k>)`` where visible, ``-inf`` elsewhere. Materialises the
    whole block: for tests and benchmarks; :func:`indexer_topk_triton` runs it chunk by chunk.
    ``head_pairs``: the score kernel's head-pair loop (kernel option ``triton_indexer_head_pairs``)."""
    _check_qwk(q, w, keys)
    _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j)
    g = keys.shape[0]
    width = g - col0 if width is None else width
    if not 0 <= col0 <= g or width < 0 or col0 + width > g:
        raise ValueError(f"col0, width: key rows [{col0}, {col0 + width}) must lie in [0, {g}]")
    t = q.shape[0]
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    args = _prepare(q, w, keys, query_doc, query_limit, key_doc, key_j)
    _launch_scores(*args, out, 0, t, col0, width, _pinned(config), head_pairs=_check_flag(head_pairs, "head_pairs"))
    return out


@torch.no_grad()
def indexer_topk_triton(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    query_doc: torch.Tensor,
    query_limit: torch.Tensor,
    key_doc: torch.Tensor,
    key_j: torch.Tensor,
    k: int,
    chunk: int | None = None,
    *,
    select: str,
    keys_mode: str = "packed",
    budget_bytes: int | None = None,
    config: IndexerConfig | None = None,
    select_config=None,
    key_row_limit: tuple[int, int] | None = None,
    select_variant: str | None = None,
    return_scores: bool = False,
    head_pairs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``keys`` with the ``k`` highest indexer scores among those visible, per query (Triton,
    score buffers + a selection).

    Args:
        q: ``[T, Hi, Di]`` bf16 / fp16 / fp32 (Di a multiple of 16, at most 256); ``w``: ``[T, Hi]``
            head weights (any float; used in fp32); ``keys``: ``[G, Di]`` in q's dtype.
        query_doc, query_limit: ``[T]`` ints: the query's document (``< 0``: none) and how many of its
            document's entries it sees (``(pos + 1) // 4``, 0 for invalid rows; see
            :func:`~dsv4cp.kernels.indexer_plan.query_limits`).
        key_doc, key_j: ``[G]`` ints: each key row's document (``< 0``: empty slot) and entry number.
        k: entries to keep.
        chunk: at most this many query rows per chunk (default: as many as the budget allows).
        select: ``"radix"`` (fp32 buffers, the Triton radix select) or ``"torch"`` (``torch.topk``).
        keys_mode: on the torch selection, ``"packed"`` (int64 keys from the kernel) or ``"scores"``.
        budget_bytes: per-chunk budget for the score buffer and the selection's temporaries (default
            :data:`TOPK_BUDGET_BYTES`; see :func:`~dsv4cp.kernels.indexer_plan.plan_chunks`).
        config: pin the score kernel's launch (the kernel option ``triton_indexer_config``'s integers or
            a config; default: the ladder); ``select_config``: the radix select's (a
            :class:`~dsv4cp.kernels.select_top_triton.SelectConfig` or ``triton_select_config``'s integers).
        key_row_limit: ``(base, ratio)``: the caller guarantees that query row ``t`` sees no key row at
            or past ``base + t // ratio + 1`` (a CP layout's :attr:`~dsv4cp.cp.layout.RankLayout.key_row_limit`).
            Given, the chunks are planned from sizes alone (:func:`plan_static_chunks`): no device
            read, CUDA-graph safe. Without it they are planned from the exact visible ranges
            (:func:`key_ranges`, :func:`plan_chunks`), which reads the device once per call.

        select_variant: the radix select's kernel (``"bounded"`` or ``"plain"``; default: the kernel
            option ``topk_select_variant``'s).
        return_scores: also return the chosen key rows' scores, as the score kernel wrote them.
        head_pairs: the score kernel takes the heads in pairs (kernel option ``triton_indexer_head_pairs``;
            the same scores bit for bit).

    Returns: ``[T, k]`` int64 key rows in increasing order, ``-1`` where fewer than ``k`` are visible;
    the same contract and tie rule as :func:`dsv4cp.ops.indexer.indexer_topk` with
    ``visible = (key_doc == query_doc) & (key_j < query_limit) & (query_doc >= 0)``: among equal scores
    at the cut the lower key rows win. With ``return_scores``, ``(rows, scores)``: ``scores [T, k]``
    fp32, the buffer's value at each chosen key row bit for bit (on the ``packed`` torch selection
    decoded from the key's high half, the score's order-preserving bits: exact, the score kernel never
    writes ``-0.0``), 0.0 where the row is ``-1``.
    """
    k = _check_k(k)
    if not isinstance(return_scores, bool):
        raise ValueError(f"return_scores: must be a bool, got {return_scores!r}")
    check_chunking(chunk, budget_bytes)
    if select not in TOPK_SELECTIONS:
        raise ValueError(f"select: must be one of {', '.join(map(repr, TOPK_SELECTIONS))}, got {select!r}")
    if keys_mode not in TOPK_KEY_MODES:
        raise ValueError(f"keys_mode: must be one of {', '.join(map(repr, TOPK_KEY_MODES))}, got {keys_mode!r}")
    radix = select == "radix"
    packed = keys_mode == "packed" and not radix
    per_score = TOPK_RADIX_BYTES_PER_SCORE if radix else None  # None: by `packed`
    _check_qwk(q, w, keys)
    _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j)
    # Each query's visible key rows lie in [lo, hi) (on the device, no host read): the radix select scans
    # only those columns (in a packed batch, the row's own document), and for the bounded kernel, which
    # reads nothing else, the score kernel writes nothing else either.
    ranges = key_ranges(query_doc, query_limit, key_doc, key_j) if radix else None
    in_range_only = radix and _resolved_variant(select_variant) == "bounded"
    chunks = iter_score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk,
                               budget_bytes=budget_bytes, config=config, key_row_limit=key_row_limit,
                               packed=packed, bytes_per_score=per_score,
                               row_ranges=ranges if in_range_only else None, head_pairs=head_pairs)  # validates
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    out_scores = torch.zeros((q.shape[0], k) if return_scores else (0, 0), dtype=torch.float32, device=q.device)
    for s, e, col0, block in chunks:
        keep = min(k, block.shape[1])
        if radix:
            # chunk row r is query row s + r, column c key row col0 + c: the causal bound in columns
            row_limit = None if key_row_limit is None else (key_row_limit[0] - col0, key_row_limit[1], s)
            row_range = (ranges[0][s:e] - col0, ranges[1][s:e] - col0)
            chosen = select_top_triton(block, keep, row_limit=row_limit, config=select_config,
                                       variant=select_variant, return_values=return_scores, row_range=row_range)
            if return_scores:
                chosen, out_scores[s:e, :keep] = chosen
        else:
            chosen = _select_top_packed(block, keep) if packed else _select_top(block, keep)
            if return_scores:
                picked = block.gather(1, chosen.clamp_min(0))
                picked = _unpack_scores(picked) if packed else picked
                out_scores[s:e, :keep] = torch.where(chosen >= 0, picked, 0.0)
        out[s:e, :keep] = torch.where(chosen >= 0, chosen + col0, -1)
    return (out, out_scores) if return_scores else out


def _resolved_variant(select_variant: str | None) -> str:
    """The radix select's kernel: ``select_variant``, else the kernel option ``topk_select_variant``'s default."""
    return kernel_options.OPTIONS["topk_select_variant"].default if select_variant is None else select_variant


def _unpack_scores(keys: torch.Tensor) -> torch.Tensor:
    """fp32 scores of int64 selection keys (:func:`dsv4cp.kernels.contracts.pack_selection_keys`): the
    high half holds the score's order-preserving bits (negative floats with their magnitude bits
    flipped), which the same flip undoes."""
    ordered = (keys >> 32).to(torch.int32)
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)


def iter_score_chunks(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    query_doc: torch.Tensor,
    query_limit: torch.Tensor,
    key_doc: torch.Tensor,
    key_j: torch.Tensor,
    chunk: int | None = None,
    *,
    budget_bytes: int | None = None,
    config: IndexerConfig | None = None,
    key_row_limit: tuple[int, int] | None = None,
    packed: bool = False,
    bytes_per_score: int | None = None,
    row_ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_pairs: bool = False,
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """The scoring half of :func:`indexer_topk_triton`: yields ``(start, stop, col0, scores)`` per
    chunk of queries, ``scores [stop - start, width]`` fp32 holding the masked scores of query rows
    ``[start, stop)`` against key rows ``[col0, col0 + width)`` (``-inf`` where invisible); with
    ``packed``, int64 selection keys of those scores instead
    (:func:`dsv4cp.kernels.contracts.pack_selection_keys`, columns numbered from 0 at ``col0``), planned
    at :data:`TOPK_BYTES_PER_SCORE` (fp32 scores: :data:`TOPK_SCORES_BYTES_PER_SCORE`; ``bytes_per_score``
    overrides it, e.g. :data:`TOPK_RADIX_BYTES_PER_SCORE` for the radix selection). With the exact
    plan (no ``key_row_limit``) chunks whose queries see no key are skipped. ``scores`` is a view of ONE
    buffer reused by every chunk: consume it before advancing the iterator. ``row_ranges``: ``(lo, hi)``
    (:func:`key_ranges`): row t is written at key rows ``[lo[t], hi[t])`` only, the rest of the buffer
    row holds stale values (for a selection that reads only there). ``head_pairs``: the score kernel's
    head-pair loop. Arguments as in :func:`indexer_topk_triton`."""
    _check_qwk(q, w, keys)
    _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j)
    budget = check_chunking(chunk, budget_bytes)
    _check_key_row_limit(key_row_limit)
    if bytes_per_score is None:
        bytes_per_score = TOPK_BYTES_PER_SCORE if packed else TOPK_SCORES_BYTES_PER_SCORE
    elif isinstance(bytes_per_score, bool) or not isinstance(bytes_per_score, int) or bytes_per_score < 1:
        raise ValueError(f"bytes_per_score: must be a positive int, got {bytes_per_score!r}")
    if row_ranges is not None:
        t = q.shape[0]
        ok = isinstance(row_ranges, tuple) and len(row_ranges) == 2 and all(
            isinstance(r, torch.Tensor) and tuple(r.shape) == (t,) and r.dtype == torch.int64 and r.device == q.device
            for r in row_ranges)
        if not ok:
            raise ValueError(f"row_ranges: must be (lo, hi), int64 [{t}] tensors on {q.device} (key_ranges)")
    return _score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk, budget, _pinned(config),
                         key_row_limit, packed, bytes_per_score, row_ranges, _check_flag(head_pairs, "head_pairs"))



def _score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk, budget, pinned, key_row_limit,
                  packed, per_score, row_ranges=None, head_pairs=False):
    # Nothing here records autograd history (the kernels write raw buffers; key_ranges and _prepare run
    # under no_grad), so the generator leaves the caller's grad mode alone between chunks.
    t, g = q.shape[0], keys.shape[0]
    if t == 0 or g == 0:
        return
    if key_row_limit is not None:
        plan = plan_static_chunks(t, g, key_row_limit, budget, chunk, per_score)
    else:
        ranges = key_ranges(query_doc, query_limit, key_doc, key_j)
        plan = [c for c in plan_chunks(*ranges, budget, chunk, per_score) if c[3] > 0]
    if not plan:
        return
    plan = [(s, e, *aligned_columns(col0, width, g)) for s, e, col0, width in plan]
    args = _prepare(q, w, keys, query_doc, query_limit, key_doc, key_j)
    flat = torch.empty(max((e - s) * width for s, e, _, width in plan),
                       dtype=torch.int64 if packed else torch.float32, device=q.device)
    for s, e, col0, width in plan:
        scores = flat[: (e - s) * width].view(e - s, width)
        _launch_scores(*args, scores, s, e, col0, width, pinned, row_ranges, head_pairs)
        yield s, e, col0, scores

