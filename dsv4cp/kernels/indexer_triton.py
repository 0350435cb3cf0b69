"""Triton kernels for the lightning indexer (docs/design.md §1.5, 3.4 step 4, 4.2).

The indexer score of query t and compressed entry (key row) g is::

    I[t, g] = sum_h w[t, h] * relu(<q[t, h], keys[g]>)      over the entries visible to t only

with q ``[T, Hi, Di]``, w ``[T, Hi]``, keys ``[G, Di]`` (the gathered indexer keys of every CP rank).
Visibility in a CP layout (:meth:`dsv4cp.cp.layout.RankLayout.visible_mask`): key row g is visible to
query t iff ``query_doc[t] >= 0 and key_doc[g] == query_doc[t] and key_j[g] < query_limit[t]`` with
``query_limit = (pos + 1) // 4`` (0 for rows outside every document). Keys of one document need not be
contiguous (rank-major gathered blocks with capacity padding) but are in increasing entry order.

Public API:

* :func:`indexer_topk_triton` (no grad): the ``k`` best visible key rows per query, same contract and
  tie rule as :func:`dsv4cp.ops.indexer.indexer_topk`. By default (``DSV4CP_TOPK_IMPL=chunked``) it
  runs the path described below (score buffers + a selection); ``stream`` selects the one-pass
  streaming kernel of :mod:`dsv4cp.kernels.indexer_topk_triton` (no score buffer, but several times
  slower on an H200: see :data:`TOPK_IMPL_ENV`).
* :func:`indexer_score_matrix` (no grad): the masked fp32 scores of a block of key rows (``-inf``
  where invisible), the kernel the top-k wrapper runs per chunk; exposed for tests and benchmarks.
* :func:`iter_score_chunks`: the top-k wrapper's scoring half (chunks of masked scores, no selection).
* :func:`key_ranges`: per query, the half-open range of key rows holding its visible keys.
* :func:`plan_chunks`: the wrapper's chunking of queries under a byte budget, from those ranges.
* :func:`plan_static_chunks`: the same chunking from sizes and a static causal bound (no device read).
* :func:`indexer_scores_triton` (autograd): the scores at given key rows ``idx [T, K]`` (the indexer
  loss's prediction), Triton forward and backward; same contract as
  :func:`dsv4cp.ops.indexer.indexer_scores`.
* :class:`IndexerConfig`, :class:`GatherConfig`, :class:`GatherBwdConfig`: launch configurations.

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
sm_90 (Di <= 128, bf16): ``BLOCK_M = 64, BLOCK_N = 256, 8 warps, 3 stages``. Checked by compiling for
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

Skipping: a tile whose queries see none of its keys (other documents, causally invisible, padding
slots) loads no keys, runs zero head iterations and only stores ``-inf``. On top of that the wrapper
narrows every query chunk to a key-row range holding every key its queries can see. Two planners:

* static (:func:`plan_static_chunks`, what the layer uses): the caller passes ``key_row_limit``, the
  causal bound of a CP layout (query row t sees no key row past ``base + t // 4``), and the chunks and
  their column ranges follow from sizes alone. No device->host copy (it would stall the CPU behind the
  index-key all-gather on every C-layer forward) and one plan for every batch of the same sizes, so a
  CUDA graph of the layer replays correctly on new data. Early causal rows get narrow chunks; in a
  multi-document batch a chunk's columns still start at key row 0 (the other documents' tiles are
  skipped by the kernel, but the selection scans their ``-inf`` columns).
* exact (:func:`key_ranges` + :func:`plan_chunks`, the default without ``key_row_limit``): the precise
  visible range per query, read to the host once per call; a chunk's columns then cover only its own
  documents' keys.

Top-k wrapper (:func:`indexer_topk_triton`): queries are processed in chunks; for each chunk the kernel
fills a ``[rows, width]`` buffer (``width`` = the chunk's visible key-row range, never the full
``[T, G]`` matrix), and a selection picks each row's best ``k``, by one of two selections
(:data:`TOPK_SELECT_ENV`):

* ``radix`` (the default on CUDA): the buffer holds fp32 scores and
  :func:`dsv4cp.kernels.select_top_triton.select_top_triton` selects them in one Triton kernel (radix
  select, one program per row, the output already in column order; with ``key_row_limit`` each row
  reads only the columns its causal bound allows). Planned at :data:`TOPK_RADIX_BYTES_PER_SCORE` = 4
  (the fp32 score; no temporaries).
* ``torch`` (the default under the interpreter): the kernel's epilogue packs each score's
  order-preserving fp32 bits above ``2^32 - 1 - column`` (the tie rule, ties at the cut to the lowest key
  rows, in one comparison) into int64 keys, so ``_select_top_packed`` is one ``torch.topk`` over the
  buffer and a decode (``DSV4CP_TOPK_KEYS=scores``: fp32 scores, keys built by ``_select_top``; see
  :data:`TOPK_KEYS_ENV`). Planned at ``TOPK_BYTES_PER_SCORE = 16``: the int64 key and ``torch.topk``'s
  outputs and workspace (the fp32 path: :data:`TOPK_SCORES_BYTES_PER_SCORE` = 24).

Chunks are planned (:func:`plan_chunks`) so ``rows * width * bytes_per_score`` stays below a byte
budget (default :data:`TOPK_BUDGET_BYTES` = 1 GiB). A chunk's column range is widened to
a multiple of 16 key rows (aligned buffer rows, vector stores). Peak memory beyond inputs and outputs
is therefore about the budget plus ``O(T)`` metadata (per-query ranges, the int32 visibility arrays,
the fp32 transposed head weights ``[Hi, T]``).

``indexer_scores`` kernels (``_gather_fwd_kernel``, ``_gather_bwd_kernel``): one program per query;
its heads sit on the matrix-unit M dimension (``Hi = 64`` = one wgmma M), the selected key rows are
gathered ``BLOCK_K`` at a time (``[BLOCK_K, Di]``, loaded once per block and used in every product of
the block). Backward recomputes ``s = q k^T``, accumulates ``dw`` and ``dq = ds k`` per query in
registers (no atomics) and adds ``dk = ds^T q`` into the fp32 key gradient with ``tl.atomic_add``
(``ds = [s > 0] w g`` is rounded to q's dtype for the two products, as the attention kernels do). The
atomics are relaxed: with Triton's default order (acq_rel) every 16-byte vector atomic compiles, on
sm_90, to a returning ``ATOMG`` wrapped in ``MEMBAR.ALL.GPU`` and an L1 invalidation (``CCTL.IVALL``),
8 of them per thread and step, each fence waiting for all of the program's outstanding memory traffic;
relaxed ones are fire-and-forget ``REDG.E.ADD.F32x4`` (read off the SASS of both builds). The sum only
needs atomicity, and the kernel's end orders it before any reader. The acq_rel build stays selectable
(:class:`GatherBwdConfig` ``relaxed_atomics=False``, :data:`BWD_CONFIG_ENV`) to measure against. In
deterministic mode (:func:`dsv4cp.kernels.is_deterministic`) it stores per-(query, slot) contributions
instead, which ``_contrib_reduce_kernel`` sums per key row in the fixed order of a stable sort
(bitwise reproducible).

Kernels are built lazily per execution mode: CUDA tensors use compiled ``triton.jit`` kernels, CPU
tensors Triton's interpreter (tiny sizes only; ``TRITON_INTERPRET=1`` must be set before triton's first
import). Configurations: keyword arguments or ``DSV4CP_TRITON_INDEXER_CONFIG``
(``"block_m,block_n,num_warps,num_stages"``) pin the score kernel's launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp.kernels import is_deterministic
from dsv4cp.kernels._triton_launch import (
    Kernels,
    OutOfResources,  # noqa: F401  (re-exported: callers catch indexer_triton.OutOfResources)
    env_choice,
    pinned_config,
)
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels.contracts import check_key_row_limit as _check_key_row_limit
from dsv4cp.kernels.contracts import select_top as _select_top
from dsv4cp.kernels.contracts import select_top_packed as _select_top_packed
from dsv4cp.kernels.select_top_triton import _ordered_bits, select_top_triton

__all__ = [
    "BWD_CONFIG_ENV",
    "BWD_SCRATCH_BYTES",
    "GATHER_BWD_CONFIGS",
    "MAX_INDEX_DIM",
    "TOPK_BUDGET_BYTES",
    "TOPK_BYTES_PER_SCORE",
    "TOPK_IMPL_ENV",
    "TOPK_KEYS_ENV",
    "TOPK_RADIX_BYTES_PER_SCORE",
    "TOPK_SCORES_BYTES_PER_SCORE",
    "TOPK_SELECT_ENV",
    "GatherBwdConfig",
    "GatherConfig",
    "IndexerConfig",
    "indexer_score_matrix",
    "indexer_scores_triton",
    "indexer_topk_triton",
    "iter_score_chunks",
    "key_ranges",
    "plan_chunks",
    "plan_static_chunks",
    "query_limits",
]

TOPK_BUDGET_BYTES = 2**30
"""Default byte budget of one top-k chunk: the ``[rows, width]`` score buffer and the selection's
temporaries (``rows * width * bytes_per_score``)."""

TOPK_IMPL_ENV = "DSV4CP_TOPK_IMPL"
"""Selects :func:`indexer_topk_triton`'s path: ``chunked`` (default) or ``stream``. Measured on an H200
(flash shapes, 64K tokens, ``results/2026-12-01-h200-speed``): chunked 73.9 ms (its selection then
``select_top`` in torch; with the radix select, exact plan: 34.6 ms, ``results/2026-12-01-h200-speed4``), stream
236.9 ms (its per-tile sort-and-merge on the CUDA cores costs 12x the scoring), scoring alone 18.9 ms."""

TOPK_SELECT_ENV = "DSV4CP_TOPK_SELECT"
"""The chunked top-k's selection: ``radix`` (fp32 score buffers selected by the Triton radix select,
:mod:`dsv4cp.kernels.select_top_triton`) or ``torch`` (``torch.topk`` over the buffer, as
:data:`TOPK_KEYS_ENV` says). Default: ``radix`` on CUDA, ``torch`` under Triton's interpreter (where the
radix kernel is slow); setting ``radix`` runs it under the interpreter too. Both select identically."""

TOPK_KEYS_ENV = "DSV4CP_TOPK_KEYS"
"""On the ``torch`` selection (:data:`TOPK_SELECT_ENV`), what the chunked top-k's score kernel writes:
``packed`` (default: the int64 selection key of each score, built in the kernel's epilogue; the
selection is one ``torch.topk`` over the buffer) or ``scores`` (the fp32 scores; ``_select_top`` then
builds the keys in torch, several passes over the buffer). Kept to compare the two on the GPU
(``bench/test_bench_indexer.py::test_indexer_topk``, ``triton-chunked`` vs ``triton-chunked-scores``);
both select identically."""

TOPK_BYTES_PER_SCORE = 16
"""Bytes per ``[rows, width]`` element held while a chunk is selected on the default (``packed``) path:
8 (the kernel's int64 key buffer) + 8 for ``torch.topk`` (its ``[rows, keep]`` int64 values and indices
and its workspace: well under 8 per element while ``keep`` is below half the width, the rule in the
layer, where chunks span thousands of key rows for ``k = 512``). The planners' default."""

TOPK_SCORES_BYTES_PER_SCORE = 24
"""The same on the ``scores`` path (:data:`TOPK_KEYS_ENV`): 4 (fp32 score) + 8 (the int64 key that
``_select_top`` builds) + 8 (one int64 temporary while the key is built) + topk's workspace."""

TOPK_RADIX_BYTES_PER_SCORE = 4
"""The same on the ``radix`` selection (:data:`TOPK_SELECT_ENV`): the fp32 score alone (the radix
kernel keeps its histograms on chip and writes only the ``[rows, k]`` result), so a chunk holds 4x the
rows of the packed path's."""

BWD_CONFIG_ENV = "DSV4CP_TRITON_GATHER_BWD_CONFIG"
"""Pins the ``indexer_scores`` backward's launch: ``"block_k,num_warps,num_stages,relaxed_atomics"``
(:class:`GatherBwdConfig`; ``relaxed_atomics`` 0 or 1)."""

BWD_SCRATCH_BYTES = 2**30
"""Budget of the deterministic backward's per-chunk ``[rows, K, Di]`` fp32 key-gradient contributions."""

MAX_INDEX_DIM = 256
"""Largest indexer head dim the kernels accept (one key tile ``[BLOCK_N, Di]`` per program)."""

_PLAN_ROWS = 64
"""Row granularity of the chunk planner (query-block aligned for every ladder's BLOCK_M <= 64)."""

_NO_KEY = 2**62
"""Lower key-row bound of a group of queries that sees no key (above every key row)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class IndexerConfig:
    """Score-kernel launch: queries per program (matrix-unit M), key rows per program (N), warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GatherConfig:
    """``indexer_scores`` kernels' launch: selected slots per step, warps, stages."""

    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GatherBwdConfig:
    """``indexer_scores`` backward's launch: selected slots per step, warps, stages, and the memory order
    of the key-gradient atomics (``relaxed_atomics``; False: Triton's default acq_rel, the original
    kernel, kept to measure against)."""

    block_k: int
    num_warps: int
    num_stages: int
    relaxed_atomics: bool = True


# ---------------------------------------------------------------------------------------------------
# Kernel bodies. Plain functions; ``_build`` turns each into a ``triton.jit`` kernel (CUDA) or an
# interpreted one (CPU) on first use. The device helpers they share are ``triton.jit`` functions: inlined
# into compiled kernels, interpreted with interpreted ones.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _head_sum(q_ptrs, q_mask, w_ptrs, rmask, kt, n_heads, stride_qh, stride_wh, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` fp32 ``sum_h w_h relu(q_h @ kt)`` over heads ``h < n_heads``: ``q_ptrs``
    / ``q_mask`` address head 0's query tile (heads ``stride_qh`` apart), ``w_ptrs`` / ``rmask`` head
    0's weights (``stride_wh`` apart), ``kt [BLOCK_D, BLOCK_N]`` the key tile, on chip for every head.
    The scoring arithmetic of ``_score_kernel`` and the streaming top-k's ``_stream_topk_kernel``."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(n_heads):
        qh = tl.load(q_ptrs + h * stride_qh, mask=q_mask, other=0.0)
        if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 products there
            qh = qh.to(tl.float32)
        wh = tl.load(w_ptrs + h * stride_wh, mask=rmask, other=0.0)
        s = tl.dot(qh, kt, input_precision=PRECISION)
        acc += wh[:, None] * tl.maximum(s, 0.0)
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
    Q, WT, KEYS, QDOC, QLIM, KDOC, KJ, OUT,  # pointers
    M, NCOL, COL0, N_KB, HI,  # query rows, buffer columns, first key row, key blocks per query block, heads
    stride_qt, stride_qh, stride_wh, stride_kn, stride_ot,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PACKED: tl.constexpr,
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
                    PRECISION, DOT_F32)
    out_ptrs = OUT + rows64[:, None] * stride_ot + cols[None, :]
    out_mask = rmask[:, None] & cmask[None, :]
    if PACKED:
        # |acc| < inf is false for +-inf and NaN: they rank as invisible, as select_top ranks them
        scores = tl.where(vis & (tl.abs(acc) < float("inf")), acc, float("-inf"))
        tl.store(out_ptrs, _pack_keys(scores, cols, BLOCK_N), mask=out_mask)
    else:
        tl.store(out_ptrs, tl.where(vis, acc, float("-inf")), mask=out_mask)


def _gather_fwd_kernel(
    Q, W, KEYS, IDX, OUT,
    HI, G, KSEL,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Scores of one query t at its selected key rows: OUT[t, j] = sum_h W[t, h] relu(<Q[t, h], KEYS[IDX[t, j]]>).

    Q ``[T, HI, DI]``, W ``[T, HI]`` (any float), KEYS ``[G, DI]``, IDX ``[T, KSEL]`` int32/int64,
    OUT ``[T, KSEL]`` fp32 (0 at empty slots: ``IDX < 0`` or ``>= G``).
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < HI
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    w = tl.load(W + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    for k0 in range(0, KSEL, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        smask = slots < KSEL
        rows = tl.load(IDX + t * stride_it + slots, mask=smask, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < G)
        kg = tl.load(KEYS + rows[:, None] * stride_kn + d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0)
        if DOT_F32:
            kg = kg.to(tl.float32)
        s = tl.dot(q, tl.trans(kg), input_precision=PRECISION)  # [BLOCK_H, BLOCK_K]
        out = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)
        tl.store(OUT + t * stride_ot + slots, out, mask=smask)


def _gather_bwd_kernel(
    Q, W, KEYS, IDX, GRAD, DQ, DW, DKEYS, CONTRIB,
    HI, G, KSEL, T0,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_gt, stride_dqt, stride_dqh, stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    DETERMINISTIC: tl.constexpr, RELAXED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Backward of ``_gather_fwd_kernel`` for query t = T0 + program id.

    GRAD ``[T, KSEL]`` fp32 (ignored at empty slots). Writes DQ ``[T, HI, DI]`` (Q's dtype) and DW
    ``[T, HI]`` fp32 for t; key gradients ``ds^T q`` either ``tl.atomic_add``-ed into DKEYS ``[G, DI]``
    fp32 (RELAXED: relaxed memory order; else Triton's default acq_rel), or (DETERMINISTIC) stored to
    CONTRIB ``[chunk, KSEL, BLOCK_D]`` fp32 at ``(t - T0, slot)`` (zero rows for empty slots).
    """
    t_local = tl.program_id(0).to(tl.int64)
    t = T0 + t_local
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < HI
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    qd_mask = hmask[:, None] & dmask[None, :]
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    w = tl.load(W + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, KSEL, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        smask = slots < KSEL
        rows = tl.load(IDX + t * stride_it + slots, mask=smask, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < G)
        kg = tl.load(KEYS + rows[:, None] * stride_kn + d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0)
        if DOT_F32:
            kg = kg.to(tl.float32)
        g = tl.load(GRAD + t * stride_gt + slots, mask=valid, other=0.0)
        s = tl.dot(q, tl.trans(kg), input_precision=PRECISION)  # [BLOCK_H, BLOCK_K]
        dw += tl.sum(tl.maximum(s, 0.0) * g[None, :], 1)
        ds = tl.where(s > 0.0, w[:, None] * g[None, :], 0.0)
        dq = tl.dot(ds.to(kg.dtype), kg, dq, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # [BLOCK_K, BLOCK_D] fp32
        if DETERMINISTIC:
            tl.store(CONTRIB + (t_local * KSEL + slots)[:, None] * BLOCK_D + d[None, :],
                     tl.where(valid[:, None], dk, 0.0), mask=smask[:, None])
        elif RELAXED:  # atomicity is all the sum needs; the kernel's end orders it before any reader
            tl.atomic_add(DKEYS + rows[:, None] * stride_dkn + d[None, :], dk,
                          mask=valid[:, None] & dmask[None, :], sem="relaxed")
        else:  # acq_rel: a GPU-scope fence and an L1 invalidation around every vector atomic
            tl.atomic_add(DKEYS + rows[:, None] * stride_dkn + d[None, :], dk,
                          mask=valid[:, None] & dmask[None, :])
    tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qd_mask)
    tl.store(DW + t * HI + heads, dw, mask=hmask)


def _contrib_reduce_kernel(
    CONTRIB, PERM, SEG, DKEYS,
    stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """DKEYS[g] += sum of CONTRIB rows ``PERM[SEG[g] : SEG[g + 1]]`` (``[*, BLOCK_D]`` fp32 rows), in that
    order (a stable sort of the slots' key rows: fixed, so the sums are bitwise reproducible)."""
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(SEG + g)
    end = tl.load(SEG + g + 1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    acc = tl.load(DKEYS + g * stride_dkn + d, mask=dmask, other=0.0)
    for c0 in range(start, end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < end
        src = tl.load(PERM + c, mask=cmask, other=0).to(tl.int64)
        part = tl.load(CONTRIB + src[:, None] * BLOCK_D + d[None, :], mask=cmask[:, None] & dmask[None, :],
                       other=0.0)
        acc += tl.sum(part, 0)
    tl.store(DKEYS + g * stride_dkn + d, acc, mask=dmask)


_KERNELS = Kernels("indexer triton", _score_kernel, _gather_fwd_kernel, _gather_bwd_kernel, _contrib_reduce_kernel)
_BODIES, _BUILT, _CHOSEN = _KERNELS.bodies, _KERNELS.built, _KERNELS.chosen
_build, _launch = _KERNELS.build, _KERNELS.launch


# ---------------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------------


def _score_ladder(block_d: int, dtype: torch.dtype, interpreted: bool) -> list[IndexerConfig]:
    if interpreted:  # numpy runs the tiles: small ones keep the CPU tests fast and still multi-tile
        return [IndexerConfig(16, 32, 4, 1)]
    if dtype == torch.float32:
        ladder = [(64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1), (16, 32, 4, 1)]
    elif block_d <= 128:
        ladder = [(64, 256, 8, 3), (64, 256, 8, 2), (128, 128, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3),
                  (64, 64, 4, 2), (32, 64, 4, 1)]
    else:
        ladder = [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1)]
    return [IndexerConfig(*c) for c in ladder]


def _gather_fwd_ladder(block_d: int, dtype: torch.dtype, interpreted: bool) -> list[GatherConfig]:
    if interpreted:
        return [GatherConfig(16, 4, 1)]
    if dtype == torch.float32 or block_d > 128:
        return [GatherConfig(*c) for c in ((32, 4, 2), (16, 4, 1))]
    return [GatherConfig(*c) for c in ((64, 4, 3), (64, 4, 2), (32, 4, 1), (16, 4, 1))]


GATHER_BWD_CONFIGS = [(32, 4, 2), (16, 4, 2), (16, 4, 1), (64, 8, 1), (64, 8, 2), (64, 8, 3), (32, 8, 1),
                      (32, 8, 2)]
"""bf16 / fp16 backward tiles (``block_k, num_warps, num_stages``), first = default, fastest first as
measured on an H200 (``bench/test_bench_indexer.py::test_indexer_scores_fwd_bwd``, 64K flash shapes,
forward + backward, ``results/2026-12-01-h200-speed3``): 14.29 / 14.60 / 15.61 / 17.50 / 17.76 / 18.07 /
21.33 / 26.29 ms, against 34.26 ms for the acq_rel-atomics kernel it replaced. Compiled for sm_90a with
Triton 3.6 (ptxas, Di = 128, Hi = 64): ``(32, 4, 2)`` uses 240 registers per thread without spilling,
2 resident programs per SM (``(64, 8, 2)``: 202 registers, 1 program)."""


def _gather_bwd_ladder(block_d: int, dtype: torch.dtype, interpreted: bool) -> list[GatherBwdConfig]:
    if interpreted:
        return [GatherBwdConfig(16, 4, 1)]
    if dtype == torch.float32 or block_d > 128:
        return [GatherBwdConfig(*c) for c in ((32, 8, 1), (16, 4, 1))]
    return [GatherBwdConfig(*c) for c in GATHER_BWD_CONFIGS]


def _gather_bwd_pinned(config: GatherBwdConfig | None) -> GatherBwdConfig | None:
    """``config``, else the one in :data:`BWD_CONFIG_ENV`, else None (the ladder); checked."""
    cfg = pinned_config(config, BWD_CONFIG_ENV, GatherBwdConfig, name="bwd_config")
    if cfg is None:
        return None
    source = "bwd_config" if config is not None else BWD_CONFIG_ENV
    if cfg.relaxed_atomics not in (0, 1):  # the env gives ints; True / False compare equal to 1 / 0
        raise ValueError(f"{source}: relaxed_atomics must be 0 or 1, got {cfg.relaxed_atomics!r}")
    return dataclasses.replace(cfg, relaxed_atomics=bool(cfg.relaxed_atomics))


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


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be a positive int, got {k!r}")
    return k


# ---------------------------------------------------------------------------------------------------
# Visibility ranges and chunk planning.
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Score matrix and top-k.
# ---------------------------------------------------------------------------------------------------


def _pinned(config: IndexerConfig | None) -> IndexerConfig | None:
    """``config``, else the one in ``DSV4CP_TRITON_INDEXER_CONFIG``, else None (the ladder); checked."""
    return pinned_config(config, "DSV4CP_TRITON_INDEXER_CONFIG", IndexerConfig)


def _launch_scores(q, wt, keys, qdoc, qlim, kdoc, kj, out, s, e, col0, width, pinned) -> None:
    """Fill ``out [e - s, width]`` (row stride ``out.stride(0)``) with the masked scores of query rows
    ``[s, e)`` against key rows ``[col0, col0 + width)``: fp32 scores, or their packed int64 selection
    keys (columns numbered from 0 at ``col0``) when ``out`` is int64."""
    _, hi, di = q.shape
    block_d = triton.next_power_of_2(di)
    dev = q.device
    ladder = _score_ladder(block_d, q.dtype, _interpreted(dev))
    kernel = _build("_score_kernel", dev)
    m = e - s
    qs, ws = q[s:e], wt[:, s:e]
    packed = out.dtype == torch.int64

    def launch(cfg: IndexerConfig) -> None:
        n_kb = triton.cdiv(width, cfg.block_n)
        kernel[(triton.cdiv(m, cfg.block_m) * n_kb,)](
            qs, ws, keys, qdoc[s:e], qlim[s:e], kdoc, kj, out,
            m, width, col0, n_kb, hi,
            qs.stride(0), qs.stride(1), ws.stride(0), keys.stride(0), out.stride(0),
            DI=di, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev), PACKED=packed,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("score", (dev.type, di, q.dtype, packed), ladder, pinned, launch)


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
) -> torch.Tensor:
    """``[T, width]`` fp32 masked indexer scores of all queries against key rows ``[col0, col0 + width)``
    (default: all ``G``): ``sum_h w relu(<q_h, k>)`` where visible, ``-inf`` elsewhere. Materialises the
    whole block: for tests and benchmarks; :func:`indexer_topk_triton` runs it chunk by chunk."""
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
    _launch_scores(*args, out, 0, t, col0, width, _pinned(config))
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
    budget_bytes: int | None = None,
    config: IndexerConfig | None = None,
    key_row_limit: tuple[int, int] | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Rows of ``keys`` with the ``k`` highest indexer scores among those visible, per query (Triton).

    Args:
        q: ``[T, Hi, Di]`` bf16 / fp16 / fp32 (Di a multiple of 16, at most 256); ``w``: ``[T, Hi]``
            head weights (any float; used in fp32); ``keys``: ``[G, Di]`` in q's dtype.
        query_doc, query_limit: ``[T]`` ints: the query's document (``< 0``: none) and how many of its
            document's entries it sees (``(pos + 1) // 4``, 0 for invalid rows; see :func:`query_limits`).
        key_doc, key_j: ``[G]`` ints: each key row's document (``< 0``: empty slot) and entry number.
        k: entries to keep.
        chunk: at most this many query rows per chunk (default: as many as the budget allows).
        budget_bytes: per-chunk budget for the score buffer and the selection's temporaries (default
            :data:`TOPK_BUDGET_BYTES`; see :func:`plan_chunks`).
        config: pin the score kernel's launch (default: ``DSV4CP_TRITON_INDEXER_CONFIG`` or the ladder).
        key_row_limit: ``(base, ratio)``: the caller guarantees that query row ``t`` sees no key row at
            or past ``base + t // ratio + 1`` (a CP layout's :attr:`~dsv4cp.cp.layout.RankLayout.key_row_limit`).
            Given, the chunks are planned from sizes alone (:func:`plan_static_chunks`): no device
            read, CUDA-graph safe. Without it they are planned from the exact visible ranges
            (:func:`key_ranges`, :func:`plan_chunks`), which reads the device once per call.
        impl: ``"stream"`` (one pass, no score buffer:
            :func:`dsv4cp.kernels.indexer_topk_triton.indexer_topk_stream`; ``chunk`` and
            ``budget_bytes`` do not apply, ``config`` pins its tiles; ``k`` above its
            ``MAX_STREAM_K`` runs chunked) or ``"chunked"`` (score buffers + a selection,
            :data:`TOPK_SELECT_ENV`, described above); default ``DSV4CP_TOPK_IMPL``, else ``"chunked"``
            (the faster on an H200).

    Returns: ``[T, k]`` int64 key rows in increasing order, ``-1`` where fewer than ``k`` are visible;
    the same contract and tie rule as :func:`dsv4cp.ops.indexer.indexer_topk` with
    ``visible = (key_doc == query_doc) & (key_j < query_limit) & (query_doc >= 0)``: among equal scores
    at the cut the lower key rows win.
    """
    k = _check_k(k)
    _check_chunking(chunk, budget_bytes)
    if _topk_impl(impl) == "stream":
        from dsv4cp.kernels import indexer_topk_triton as stream  # lazy: it imports this module

        if k <= stream.MAX_STREAM_K:  # larger running lists do not fit on chip
            return stream.indexer_topk_stream(q, w, keys, query_doc, query_limit, key_doc, key_j, k,
                                              config=config, key_row_limit=key_row_limit)
    radix = _topk_select(q.device) == "radix"
    packed = _topk_keys() == "packed" and not radix  # both envs checked, whichever path runs
    per_score = TOPK_RADIX_BYTES_PER_SCORE if radix else None  # None: by `packed`
    chunks = iter_score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk,
                               budget_bytes=budget_bytes, config=config, key_row_limit=key_row_limit,
                               packed=packed, bytes_per_score=per_score)  # validates the inputs
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for s, e, col0, block in chunks:
        keep = min(k, block.shape[1])
        if radix:
            # chunk row r is query row s + r, column c key row col0 + c: the causal bound in columns
            row_limit = None if key_row_limit is None else (key_row_limit[0] - col0, key_row_limit[1], s)
            chosen = select_top_triton(block, keep, row_limit=row_limit)
        else:
            chosen = _select_top_packed(block, keep) if packed else _select_top(block, keep)
        out[s:e, :keep] = torch.where(chosen >= 0, chosen + col0, -1)
    return out


def _topk_select(device: torch.device) -> str:
    """The chunked path's selection, from ``DSV4CP_TOPK_SELECT`` (default: ``"radix"`` for compiled
    kernels, ``"torch"`` under the interpreter); checked."""
    return env_choice(TOPK_SELECT_ENV, ("radix", "torch"), "torch" if _interpreted(device) else "radix")


def _topk_keys() -> str:
    """The chunked path's buffer, from ``DSV4CP_TOPK_KEYS`` (default ``"packed"``); checked."""
    return env_choice(TOPK_KEYS_ENV, ("packed", "scores"), "packed")


def _topk_impl(impl: str | None) -> str:
    """The requested top-k path: ``impl``, else ``DSV4CP_TOPK_IMPL``, else ``"chunked"``; checked."""
    if impl is None:
        return env_choice(TOPK_IMPL_ENV, ("stream", "chunked"), "chunked")
    if impl not in ("stream", "chunked"):
        raise ValueError(f"impl: must be 'stream' or 'chunked', got {impl!r}")
    return impl


def _check_chunking(chunk: int | None, budget_bytes: int | None) -> int:
    """Validate the chunked path's row cap and byte budget; return the budget in bytes."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: must be a positive int (query rows per chunk), got {chunk!r}")
    budget = TOPK_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if budget <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    return budget


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
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """The scoring half of :func:`indexer_topk_triton`: yields ``(start, stop, col0, scores)`` per
    chunk of queries, ``scores [stop - start, width]`` fp32 holding the masked scores of query rows
    ``[start, stop)`` against key rows ``[col0, col0 + width)`` (``-inf`` where invisible); with
    ``packed``, int64 selection keys of those scores instead
    (:func:`dsv4cp.kernels.contracts.pack_selection_keys`, columns numbered from 0 at ``col0``), planned
    at :data:`TOPK_BYTES_PER_SCORE` (fp32 scores: :data:`TOPK_SCORES_BYTES_PER_SCORE`; ``bytes_per_score``
    overrides it, e.g. :data:`TOPK_RADIX_BYTES_PER_SCORE` for the radix selection). With the exact
    plan (no ``key_row_limit``) chunks whose queries see no key are skipped. ``scores`` is a view of ONE
    buffer reused by every chunk: consume it before advancing the iterator. Arguments as in
    :func:`indexer_topk_triton`."""
    _check_qwk(q, w, keys)
    _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j)
    budget = _check_chunking(chunk, budget_bytes)
    _check_key_row_limit(key_row_limit)
    if bytes_per_score is None:
        bytes_per_score = TOPK_BYTES_PER_SCORE if packed else TOPK_SCORES_BYTES_PER_SCORE
    elif isinstance(bytes_per_score, bool) or not isinstance(bytes_per_score, int) or bytes_per_score < 1:
        raise ValueError(f"bytes_per_score: must be a positive int, got {bytes_per_score!r}")
    return _score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk, budget, _pinned(config),
                         key_row_limit, packed, bytes_per_score)


def _aligned_columns(col0: int, width: int, g: int) -> tuple[int, int]:
    """Widen ``[col0, col0 + width)`` to a multiple of 16 columns inside ``[0, g)`` (a superset: the
    kernel masks what is invisible), so buffer rows start 64-byte aligned and stores vectorise."""
    padded = min(g, -(-width // 16) * 16)
    return min(col0, g - padded), padded


def _score_chunks(q, w, keys, query_doc, query_limit, key_doc, key_j, chunk, budget, pinned, key_row_limit,
                  packed, per_score):
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
    plan = [(s, e, *_aligned_columns(col0, width, g)) for s, e, col0, width in plan]
    args = _prepare(q, w, keys, query_doc, query_limit, key_doc, key_j)
    flat = torch.empty(max((e - s) * width for s, e, _, width in plan),
                       dtype=torch.int64 if packed else torch.float32, device=q.device)
    for s, e, col0, width in plan:
        scores = flat[: (e - s) * width].view(e - s, width)
        _launch_scores(*args, scores, s, e, col0, width, pinned)
        yield s, e, col0, scores


# ---------------------------------------------------------------------------------------------------
# Differentiable scores at given key rows.
# ---------------------------------------------------------------------------------------------------


def _check_idx(q, idx) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"idx: must be [{q.shape[0]}, K], got {shape}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: dtype must be int32 or int64, got {idx.dtype}")
    if idx.device != q.device:
        raise ValueError(f"idx: must be on q's device {q.device}, got {idx.device}")


def _gather_forward(q, w, keys, idx, config: GatherConfig | None = None) -> torch.Tensor:
    t, hi, di = q.shape
    ksel = idx.shape[1]
    out = torch.empty(t, ksel, dtype=torch.float32, device=q.device)
    if t == 0 or ksel == 0:
        return out
    dev = q.device
    block_d = triton.next_power_of_2(di)
    block_h = max(16, triton.next_power_of_2(hi))
    kernel = _build("_gather_fwd_kernel", dev)

    def launch(cfg: GatherConfig) -> None:
        kernel[(t,)](
            q, w, keys, idx, out, hi, keys.shape[0], ksel,
            q.stride(0), q.stride(1), w.stride(0), keys.stride(0), idx.stride(0), out.stride(0),
            DI=di, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_K=cfg.block_k,
            PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("gather_fwd", (dev.type, di, block_h, q.dtype), _gather_fwd_ladder(block_d, q.dtype, _interpreted(dev)),
            config, launch)
    return out


def _reduce_contributions(contrib, idx, dkeys) -> None:
    """dkeys[g] += the chunk's contributions to key row g, summed in the order of a stable sort of the
    flattened slot rows (query-major, then slot): bitwise reproducible."""
    g, di = dkeys.shape
    rows = idx.to(torch.int64).reshape(-1)
    rows = torch.where((rows >= 0) & (rows < g), rows, g)  # empty slots sort last and are never read
    sorted_rows, perm = torch.sort(rows, stable=True)
    seg = torch.searchsorted(sorted_rows, torch.arange(g + 1, device=idx.device))
    _build("_contrib_reduce_kernel", dkeys.device)[(g,)](
        contrib, perm, seg, dkeys, dkeys.stride(0),
        DI=di, BLOCK_D=contrib.shape[-1], BLOCK_C=16, num_warps=4,
    )


def _gather_backward(q, w, keys, idx, grad, deterministic: bool, config: GatherBwdConfig | None = None,
                     scratch_bytes: int | None = None):
    """``(dq, dw fp32, dkeys fp32)`` of :func:`indexer_scores_triton` for the upstream fp32 ``grad
    [T, K]``; ``config``: a checked pin (:func:`_gather_bwd_pinned`) or None (the ladder)."""
    t, hi, di = q.shape
    g, ksel = keys.shape[0], idx.shape[1]
    dev = q.device
    dq = torch.zeros_like(q)
    dw = torch.zeros(t, hi, dtype=torch.float32, device=dev)
    dkeys = torch.zeros(g, di, dtype=torch.float32, device=dev)
    if t == 0 or ksel == 0 or g == 0:
        return dq, dw, dkeys
    block_d = triton.next_power_of_2(di)
    block_h = max(16, triton.next_power_of_2(hi))
    kernel = _build("_gather_bwd_kernel", dev)
    budget = BWD_SCRATCH_BYTES if scratch_bytes is None else int(scratch_bytes)
    chunk = max(1, min(t, budget // (ksel * block_d * 4))) if deterministic else t
    contrib = torch.empty(chunk, ksel, block_d, dtype=torch.float32, device=dev) if deterministic else dkeys
    ladder = _gather_bwd_ladder(block_d, q.dtype, _interpreted(dev))
    for t0 in range(0, t, chunk):
        rows = min(chunk, t - t0)

        def launch(cfg: GatherBwdConfig, rows: int = rows, t0: int = t0) -> None:
            kernel[(rows,)](
                q, w, keys, idx, grad, dq, dw, dkeys, contrib, hi, g, ksel, t0,
                q.stride(0), q.stride(1), w.stride(0), keys.stride(0), idx.stride(0), grad.stride(0),
                dq.stride(0), dq.stride(1), dkeys.stride(0),
                DI=di, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_K=cfg.block_k, DETERMINISTIC=deterministic,
                RELAXED=cfg.relaxed_atomics, PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        _launch("gather_bwd", (dev.type, di, block_h, q.dtype, deterministic), ladder, config, launch)
        if deterministic:
            _reduce_contributions(contrib[:rows], idx[t0:t0 + rows], dkeys)
    return dq, dw, dkeys


class _TritonIndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, keys, idx, bwd_config):
        q_c, w_c, keys_c, idx_c = q.contiguous(), w.contiguous(), keys.contiguous(), idx.contiguous()
        out = _gather_forward(q_c, w_c, keys_c, idx_c)
        ctx.save_for_backward(q_c, w_c, keys_c, idx_c)
        ctx.bwd_config = bwd_config
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, w, keys, idx = ctx.saved_tensors
        grad = grad.to(torch.float32).contiguous()
        dq, dw, dkeys = _gather_backward(q, w, keys, idx, grad, is_deterministic(), ctx.bwd_config)
        return dq, dw.to(w.dtype), dkeys.to(keys.dtype), None, None


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, *,
                          bwd_config: GatherBwdConfig | None = None) -> torch.Tensor:
    """Differentiable scores ``[T, K]`` fp32 of queries at key rows ``idx [T, K]`` (Triton forward and
    backward); the contract of :func:`dsv4cp.ops.indexer.indexer_scores` for bf16 / fp16 / fp32 inputs.

    ``q [T, Hi, Di]``, ``w [T, Hi]``, ``keys [G, Di]`` (q's dtype), ``idx`` int32/int64 (``-1`` =
    empty slot: score 0 there, no gradient). Backward: ``dq`` and ``dw`` per query (no atomics), ``dkeys``
    by fp32 atomics, or, when :func:`dsv4cp.kernels.is_deterministic`, by a fixed-order reduction.
    Gradients are returned in the inputs' dtypes. ``bwd_config`` pins the backward's launch (default:
    :data:`BWD_CONFIG_ENV`, else the ladder); it is checked here, before any work.
    """
    _check_qwk(q, w, keys)
    _check_idx(q, idx)
    return _TritonIndexerScores.apply(q, w, keys, idx, _gather_bwd_pinned(bwd_config))
