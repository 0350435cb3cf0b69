"""Triton kernels of the indexer's differentiable scores at given key rows (docs/design.md §1.5):
:func:`indexer_scores_triton`, the autograd function behind :func:`dsv4cp.ops.indexer.indexer_scores`
(the indexer loss's prediction), ``out[t, j] = sum_h w[t, h] relu(<q[t, h], keys[idx[t, j]]>)``.

Kernels (``_gather_fwd_kernel``, and two backward kernels): one program per query, the selected key
rows gathered ``BLOCK_K`` at a time (``[BLOCK_K, Di]``, loaded once per block and used in every product
of the block). The forward has the heads on the matrix-unit M dimension (``Hi = 64`` = one wgmma M).
Backward recomputes the logits, accumulates ``dw`` and ``dq = ds k`` per query in registers (no atomics)
and produces ``dk = ds^T q`` per (query, slot) (``ds = [s > 0] w g`` is rounded to q's dtype for the two
products, as the attention kernels do), in one of two layouts (:data:`LAYOUTS`, the kernel option
``triton_scores_bwd_layout``): ``keys_on_m`` (default, ``_gather_bwd_keys_on_m_kernel``: ``s^T = k q^T``
with the keys on M, ``ds^T`` reused from the accumulator's registers as ``dk``'s operand, the head
dimension in halves) or ``heads_on_m`` (``_gather_bwd_kernel``, the kernel before it: ``s = q k^T``,
``ds`` transposed through shared memory for ``dk``, which runs on mma.sync at 32 keys per step). What
each measured and what bounds them: docs/kernels.md. The key gradient ``dkeys [G, Di]``
sums those per key row; how is the *reduction* (:data:`REDUCTIONS`, the kernel option
``triton_scores_bwd_reduce``):

* ``atomic`` (default): ``tl.atomic_add`` of each ``dk`` row into fp32 ``dkeys``, relaxed. With
  Triton's default order (acq_rel) every 16-byte vector atomic compiles, on sm_90, to a returning
  ``ATOMG`` wrapped in ``MEMBAR.ALL.GPU`` and an L1 invalidation (``CCTL.IVALL``), each fence waiting for
  all of the program's outstanding memory traffic; relaxed ones are fire-and-forget
  ``REDG.E.ADD.F32x4`` (read off the SASS of both builds). The acq_rel build stays selectable
  (:class:`GatherBwdConfig` ``relaxed_atomics=False``, the kernel option ``triton_gather_bwd_config``).
  The order of the adds is the hardware's: not deterministic.
* ``sorted`` / ``sorted-bf16``: a sorted-destination reduction, bitwise deterministic by construction.
  Per chunk of queries, the chunk's valid slots are sorted by key row (``torch.sort``, stable: by key
  row, then query, then slot, a function of ``idx`` alone) and ``_invert_permutation_kernel`` gives every
  slot its position in that order (``dest``, int32); the backward kernel stores each ``dk`` row there
  (plain 16-byte vector row stores, no atomics) in fp32 or, ``sorted-bf16``, rounded to bf16; then
  ``_segment_reduce_kernel`` (one program per key row) streams the row's contiguous segment, 32 rows
  a step, accumulating in fp32 in an order fixed by the segment's length, and adds the sum to ``dkeys``;
  the chunks add in order. Replays give identical bits; the chunk count changes the rounding only (with
  exact sums, nothing: tested). Deterministic mode (:func:`dsv4cp.kernels.is_deterministic`:
  ``torch.use_deterministic_algorithms(True)`` or :func:`dsv4cp.kernels.set_deterministic`) turns
  ``atomic`` into ``sorted`` (:func:`resolve_reduction`).

Error of ``sorted-bf16``: each fp32 contribution ``c_i`` is stored as ``c_i (1 + d_i)`` with ``|d_i| <=
u = 2^-8`` (round to nearest: the sm_90 build converts with ``cvt.rn.bf16x2.f32``), so a key row's
fp32 sum differs from the fp32 contributions' by at most ``u * sum_i |c_i|`` (plus fp32 summation
error); the errors are unbiased, typically ``~ u sqrt(sum_i c_i^2) / sqrt(3)``. That is the bound of an
error every bf16 path already has: ``ds`` is rounded to bf16 before the same products, and the returned
``dkeys`` is rounded to the keys' dtype. Tested against the fp32 reduction elementwise with that bound
(``tests/kernels/test_indexer_scores_reduce.py``; Triton 3.9's interpreter truncates: 2^-7 there).

Traffic and time model at the 64K flash shapes (T = 65536, Hi = 64, Di = 128, K = 512, G = 16384, bf16;
n ~ 33.0 M valid slots in the benchmark's causal selection, n Di = 4.2 G key-gradient values):

* ``atomic``: 4.2 G fp32 additions (17 GB of ``REDG.F32x4`` payload) into the 8 MB ``dkeys``, which
  stays in L2 (the forward kernel gathers the same key rows, 8.6 GB from L2, for one of the three
  products): the reductions' payload crosses the SMs-to-L2 crossbar, whose throughput it bounds the
  backward by, whatever its products cost (measured: docs/kernels.md).
* ``sorted``: the contributions are written once and read once, 2 x 16.9 GB of HBM traffic (a chunk's
  2 GiB does not fit L2): ~8.5 ms at 4 TB/s; the sort (int16 keys while G < 2^15, int64 values: two
  radix passes), the inverse permutation and the destinations' reads add ~60 B per slot, ~2 GB
  (~0.5-1 ms) expected.
* ``sorted-bf16``: 2 x 8.5 GB (~4.2 ms) plus the same sorting: ~5 ms of reduction traffic expected.

Measured with the heads-on-M kernel, the atomics were not what bound it: replacing them by plain stores of
the same bytes left it about as slow, so the sorted reductions add their sort and segment sums on top
(``bench/test_bench_indexer.py::test_indexer_scores_reduce`` and ``test_indexer_scores_reduce_parts``;
the figures: docs/kernels.md). The sorted reductions are the deterministic path; ``atomic`` stays the
default.

Memory: the sorted reductions' scratch per chunk is the ``[chunk * K, Di]`` contributions plus an
estimated :data:`INDEX_BYTES_PER_SLOT` per slot of sort buffers, at most :data:`BWD_SCRATCH_BYTES`
(2 GiB; the kernel option ``triton_scores_bwd_scratch`` in MiB, the keyword ``scratch_bytes``),
equal chunks: at 64K, 9 chunks of 7282 queries (fp32, 1.94 GiB) or 5 of 13108 (bf16, 1.90 GiB). In
deterministic mode torch fills every ``torch.empty`` (``fill_uninitialized_memory``): one extra write of
the contributions buffer per backward.

Resources (``triton.compile`` for sm_90 with Triton 3.6, the JIT's 16-byte alignment, Di = 128, Hi = 64,
bf16, atomic; registers per thread / shared memory / spill): keys-on-M with the indices ahead ``(64, 4, 3)``
255 / 81 KB / 96 B, ``(64, 4, 2)`` 255 / 64 KB / 104 B, ``(64, 4, 1)`` 255 / 40 KB / 32 B, ``(128, 8, 2)``
255 / 113 KB / 48 B; in-step indices ``(64, 4, 1)`` no spill, ``(64, 4, 3)`` 64 B (with the head dimension
whole: ``(64, 4, 2)`` 255 / 80 KB / 56 B). Heads-on-M
(Triton 3.9, no spill anywhere): backward ``(32, 4, 2)``
atomic 224 / 56 KB, sorted fp32 200 / 56 KB, sorted bf16 188 / 52 KB; ``(64, 8, 2)`` 175 / 80 KB,
190 / 80 KB, 183 / 64 KB. ``_segment_reduce_kernel`` (32 rows, 4 warps): 56 registers, 16-byte
vector loads (``ld.global.v4.b32``); ``_invert_permutation_kernel``: 32 registers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels import is_deterministic
from dsv4cp.kernels._triton_gather import gather_loaded_rows, gather_rows
from dsv4cp.kernels._triton_launch import Kernels, pinned_config
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels.indexer_triton import _check_qwk, _dot_f32, _precision

__all__ = ["BWD_CONFIG_ENV", "BWD_SCRATCH_BYTES", "GATHER_BWD_CONFIGS", "INDEX_BYTES_PER_SLOT", "KEYS_ON_M_BWD_CONFIGS",
           "LAYOUTS", "REDUCTIONS",
           "BackwardPlan", "GatherBwdConfig", "GatherConfig", "check_settings", "indexer_scores_triton",
           "resolve_reduction", "sorted_chunk_rows"]

BWD_CONFIG_ENV = kernel_options.OPTIONS["triton_gather_bwd_config"].env
"""The variable of the kernel option ``triton_gather_bwd_config``: pins the ``indexer_scores``
backward's launch: ``"block_k,num_warps,num_stages,relaxed_atomics"``
(:class:`GatherBwdConfig`; ``relaxed_atomics`` 0 or 1)."""

LAYOUTS = ("keys_on_m", "heads_on_m")
"""The backward kernel's product layouts (the kernel option ``triton_scores_bwd_layout``):
``_gather_bwd_keys_on_m_kernel`` and ``_gather_bwd_kernel``."""

REDUCTIONS = ("atomic", "sorted", "sorted-bf16")
"""The backward's key-gradient reductions (the kernel option ``triton_scores_bwd_reduce``): fp32 atomics
into ``dkeys``; per-slot contributions in fp32 or bf16 stored in key-row order and summed per key row."""

BWD_SCRATCH_BYTES = 2 * 2**30
"""Default budget of the sorted reductions' scratch per chunk of queries: the ``[chunk * K, Di]``
contributions and the sort's index tensors (:data:`INDEX_BYTES_PER_SLOT`)."""

INDEX_BYTES_PER_SLOT = 48
"""Bytes per slot the sort of one chunk holds at its peak (an upper estimate): the int64 rows and their
int16 / int32 keys, the sorted keys and permutation (int64), the destinations (int32) and the radix
sort's double buffers."""

REDUCE_BLOCK_ROWS = 32
"""Contribution rows ``_segment_reduce_kernel`` reads per step (``[32, Di]``: 16 KB of fp32 at Di = 128)."""


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
# Kernel bodies (plain functions, built per execution mode by ``_KERNELS``).
# ---------------------------------------------------------------------------------------------------


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
        rows, valid, kg = gather_rows(KEYS, IDX + t * stride_it, slots, smask, G, stride_kn, d, dmask,
                                      DI, BLOCK_D, DOT_F32)
        s = tl.dot(q, tl.trans(kg), input_precision=PRECISION)  # [BLOCK_H, BLOCK_K]
        out = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)
        tl.store(OUT + t * stride_ot + slots, out, mask=smask)


def _gather_bwd_kernel(
    Q, W, KEYS, IDX, GRAD, DQ, DW, DKEYS, DEST, CONTRIB,
    HI, G, KSEL, T0,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_gt, stride_dqt, stride_dqh, stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    SORTED: tl.constexpr, RELAXED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Backward of ``_gather_fwd_kernel`` for query t = T0 + program id.

    GRAD ``[T, KSEL]`` fp32 (ignored at empty slots). Writes DQ ``[T, HI, DI]`` (Q's dtype) and DW
    ``[T, HI]`` fp32 for t; key gradients ``ds^T q`` either ``tl.atomic_add``-ed into DKEYS ``[G, DI]``
    fp32 (RELAXED: relaxed memory order; else Triton's default acq_rel), or (SORTED) stored as rows of
    CONTRIB ``[chunk * KSEL, DI]`` (fp32 or bf16) at the sorted position ``DEST[(t - T0) * KSEL + slot]``
    int32 (valid slots only: an empty slot's position lies past every key row's segment).
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
        rows, valid, kg = gather_rows(KEYS, IDX + t * stride_it, slots, smask, G, stride_kn, d, dmask,
                                      DI, BLOCK_D, DOT_F32)
        g = tl.load(GRAD + t * stride_gt + slots, mask=valid, other=0.0)
        s = tl.dot(q, tl.trans(kg), input_precision=PRECISION)  # [BLOCK_H, BLOCK_K]
        dw += tl.sum(tl.maximum(s, 0.0) * g[None, :], 1)
        ds = tl.where(s > 0.0, w[:, None] * g[None, :], 0.0)
        dq = tl.dot(ds.to(kg.dtype), kg, dq, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # [BLOCK_K, BLOCK_D] fp32
        _store_key_grads(dk, rows, valid, d, dmask, DKEYS, DEST, CONTRIB, t_local, slots, KSEL, stride_dkn, DI,
                         SORTED, RELAXED)
    tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qd_mask)
    tl.store(DW + t * HI + heads, dw, mask=hmask)


def _gather_bwd_keys_on_m_kernel(
    Q, W, KEYS, IDX, GRAD, DQ, DW, DKEYS, DEST, CONTRIB,
    HI, G, KSEL, T0,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_gt, stride_dqt, stride_dqh, stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    SORTED: tl.constexpr, RELAXED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    INDEX_AHEAD: tl.constexpr = False,
):
    """``_gather_bwd_kernel`` (same arguments, same results) with the selected keys on the matrix unit's M
    dimension and the head dimension in two halves.

    Keys on M: the logits are computed transposed, ``s^T = k q^T`` (``[BLOCK_K, BLOCK_H]``), so the key
    gradient ``dk = ds^T q`` takes ``ds^T`` straight from the logits' accumulator registers as its wgmma A
    operand (``BLOCK_K = 64`` keys per warpgroup is a whole wgmma M; the heads-on-M kernel transposes ``ds``
    through shared memory and, at 32 keys per step, forms ``dk`` on mma.sync with q reloaded from shared
    memory every step), and ``dq += ds k`` reads ``ds`` from one shared-memory copy of ``ds^T``. ``dw`` is
    accumulated elementwise in a ``[BLOCK_K, BLOCK_H]`` register tile (``relu(s^T) g``) and reduced over
    the keys once, after the loop.

    Halves of the head dimension (``BLOCK_D / 2`` columns each): q, each gathered key tile and dq are
    held as two tiles, ``s^T`` sums two products, and the key gradient of each half (``[BLOCK_K,
    BLOCK_D / 2]``) is formed and added into the reduction before the other's, so only half of it, of
    its layout conversion for the atomics and of their addresses is live at a time: at ``64, 4, 1`` no
    spill, where the whole-width kernel spilled ~6 GB of local memory traffic at 64K (docs/kernels.md).

    INDEX_AHEAD: each step's key-row indices are loaded one step ahead, into registers, so a step's gather
    waits for the L2 alone, not for an index load from memory first (with one stage nothing else loads
    them ahead).
    """
    HALF: tl.constexpr = BLOCK_D // 2
    t_local = tl.program_id(0).to(tl.int64)
    t = T0 + t_local
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < HI
    d0 = tl.arange(0, HALF)
    d1 = HALF + d0
    m0 = d0 < DI
    m1 = d1 < DI
    q_row = Q + t * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_row + d0[None, :], mask=hmask[:, None] & m0[None, :], other=0.0)
    q1 = tl.load(q_row + d1[None, :], mask=hmask[:, None] & m1[None, :], other=0.0)
    if DOT_F32:
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
    w = tl.load(W + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    dq0 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    dq1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    dw_parts = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
    first = tl.arange(0, BLOCK_K)
    next_rows = tl.load(IDX + t * stride_it + first, mask=INDEX_AHEAD & (first < KSEL), other=-1)
    for k0 in range(0, KSEL, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        smask = slots < KSEL
        if INDEX_AHEAD:
            rows = next_rows
            next_rows = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < KSEL, other=-1)
        else:
            rows = tl.load(IDX + t * stride_it + slots, mask=smask, other=-1)
        rows, valid, k_0 = gather_loaded_rows(KEYS, rows, G, stride_kn, d0, m0, DI, HALF, DOT_F32)
        _, _, k_1 = gather_loaded_rows(KEYS + HALF, rows, G, stride_kn, d0, m1, DI, HALF, DOT_F32)
        g = tl.load(GRAD + t * stride_gt + slots, mask=valid, other=0.0)
        st = tl.dot(k_0, tl.trans(q0), input_precision=PRECISION)  # [BLOCK_K, BLOCK_H]
        st = tl.dot(k_1, tl.trans(q1), st, input_precision=PRECISION)
        dw_parts += tl.maximum(st, 0.0) * g[:, None]
        dst = tl.where(st > 0.0, g[:, None] * w[None, :], 0.0).to(q0.dtype)
        dq0 = tl.dot(tl.trans(dst), k_0, dq0, input_precision=PRECISION)
        dq1 = tl.dot(tl.trans(dst), k_1, dq1, input_precision=PRECISION)
        dk = tl.dot(dst, q0, input_precision=PRECISION)  # [BLOCK_K, HALF] fp32
        _store_key_grads(dk, rows, valid, d0, m0, DKEYS, DEST, CONTRIB, t_local, slots, KSEL, stride_dkn, DI,
                         SORTED, RELAXED)
        dk = tl.dot(dst, q1, input_precision=PRECISION)
        _store_key_grads(dk, rows, valid, d1, m1, DKEYS, DEST, CONTRIB, t_local, slots, KSEL, stride_dkn, DI,
                         SORTED, RELAXED)
    dq_row = DQ + t * stride_dqt + heads[:, None] * stride_dqh
    tl.store(dq_row + d0[None, :], dq0.to(DQ.dtype.element_ty), mask=hmask[:, None] & m0[None, :])
    tl.store(dq_row + d1[None, :], dq1.to(DQ.dtype.element_ty), mask=hmask[:, None] & m1[None, :])
    tl.store(DW + t * HI + heads, tl.sum(dw_parts, 0), mask=hmask)


@triton.jit
def _store_key_grads(dk, rows, valid, d, dmask, DKEYS, DEST, CONTRIB, t_local, slots, KSEL, stride_dkn,
                     DI: tl.constexpr, SORTED: tl.constexpr, RELAXED: tl.constexpr):
    """One step's key gradients ``dk [BLOCK_K, BLOCK_D]`` (fp32) into the reduction: a plain row store at
    each valid slot's sorted position (SORTED), else a relaxed or acq_rel fp32 ``atomic_add`` into DKEYS."""
    if SORTED:  # one plain row store per valid slot, to its place in its key row's segment
        dest = tl.load(DEST + t_local * KSEL + slots, mask=valid, other=0).to(tl.int64)
        tl.store(CONTRIB + dest[:, None] * DI + d[None, :], dk.to(CONTRIB.dtype.element_ty),
                 mask=valid[:, None] & dmask[None, :])
    elif RELAXED:  # atomicity is all the sum needs; the kernel's end orders it before any reader
        tl.atomic_add(DKEYS + rows[:, None] * stride_dkn + d[None, :], dk, mask=valid[:, None] & dmask[None, :],
                      sem="relaxed")
    else:  # acq_rel: a GPU-scope fence and an L1 invalidation around every vector atomic
        tl.atomic_add(DKEYS + rows[:, None] * stride_dkn + d[None, :], dk, mask=valid[:, None] & dmask[None, :])


def _invert_permutation_kernel(PERM, DEST, N, BLOCK: tl.constexpr):
    """DEST[PERM[p]] = p for p < N: each slot's position in the sorted order (PERM int64, DEST int32;
    a permutation, so every element is written once and no two programs meet)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = p < N
    src = tl.load(PERM + p, mask=mask, other=0)
    tl.store(DEST + src, p.to(tl.int32), mask=mask)


def _segment_reduce_kernel(
    CONTRIB, SEG, DKEYS,
    stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """DKEYS[g] += the sum of CONTRIB rows ``SEG[g] : SEG[g + 1]`` (``[*, DI]``, fp32 or bf16) for key row
    g = program id, accumulated in fp32 in a fixed order: ``BLOCK_C`` rows at a time into a
    ``[BLOCK_C, BLOCK_D]`` accumulator (row r of the segment into lane ``r % BLOCK_C``), whose lanes are
    summed once at the end. The order depends on the segment's length alone: bitwise reproducible."""
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(SEG + g).to(tl.int64)
    end = tl.load(SEG + g + 1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    lanes = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for c0 in range(start, end, BLOCK_C):
        c = c0 + lanes
        part = tl.load(CONTRIB + c[:, None] * DI + d[None, :], mask=(c < end)[:, None] & dmask[None, :],
                       other=0.0)
        acc += part.to(tl.float32)
    total = tl.load(DKEYS + g * stride_dkn + d, mask=dmask, other=0.0) + tl.sum(acc, 0)
    tl.store(DKEYS + g * stride_dkn + d, total, mask=dmask)


_KERNELS = Kernels("indexer triton scores", _gather_fwd_kernel, _gather_bwd_kernel,
                   _gather_bwd_keys_on_m_kernel, _invert_permutation_kernel,
                   _segment_reduce_kernel, op="indexer_scores")
_build, _launch = _KERNELS.build, _KERNELS.launch


def _gather_fwd_ladder(block_d: int, dtype: torch.dtype, interpreted: bool) -> list[GatherConfig]:
    if interpreted:
        return [GatherConfig(16, 4, 1)]
    if dtype == torch.float32 or block_d > 128:
        return [GatherConfig(*c) for c in ((32, 4, 2), (16, 4, 1))]
    return [GatherConfig(*c) for c in ((64, 4, 3), (64, 4, 2), (32, 4, 1), (16, 4, 1))]


GATHER_BWD_CONFIGS = [(32, 4, 2), (16, 4, 2), (16, 4, 1), (64, 8, 1), (64, 8, 2), (64, 8, 3), (32, 8, 1),
                      (32, 8, 2)]
"""bf16 / fp16 backward tiles (``block_k, num_warps, num_stages``), first = default, fastest first as
``bench/test_bench_indexer.py::test_indexer_scores_fwd_bwd`` measured them at the 64K flash shapes
(the figures: docs/kernels.md). ``(32, 4, 2)`` fits two resident programs per SM without spilling."""


KEYS_ON_M_BWD_CONFIGS = [(64, 4, 3), (64, 4, 2), (64, 4, 1), (128, 8, 2)]
"""The keys-on-M backward's bf16 / fp16 tiles (``block_k, num_warps, num_stages``), first = default,
fastest first at the 64K flash shapes with the indices a step ahead (docs/kernels.md): ``block_k`` a whole
wgmma M (64 keys per warpgroup), two programs per SM at each 4-warp tile."""


def _gather_bwd_ladder(block_d: int, dtype: torch.dtype, interpreted: bool, layout: str) -> list[GatherBwdConfig]:
    if interpreted:
        return [GatherBwdConfig(16, 4, 1)]
    if dtype == torch.float32 or block_d > 128:
        return [GatherBwdConfig(*c) for c in ((32, 8, 1), (16, 4, 1))]
    return [GatherBwdConfig(*c) for c in (KEYS_ON_M_BWD_CONFIGS if layout == "keys_on_m" else GATHER_BWD_CONFIGS)]


def _gather_bwd_pinned(config: GatherBwdConfig | tuple[int, ...] | None) -> GatherBwdConfig | None:
    """``config`` (a :class:`GatherBwdConfig` or the kernel option ``triton_gather_bwd_config``'s integers),
    else None (the ladder); checked."""
    cfg = pinned_config(config, GatherBwdConfig, name="bwd_config")
    if cfg is None:
        return None
    if cfg.relaxed_atomics not in (0, 1):  # the option gives ints; True / False compare equal to 1 / 0
        raise ValueError(f"bwd_config: relaxed_atomics must be 0 or 1, got {cfg.relaxed_atomics!r}")
    return dataclasses.replace(cfg, relaxed_atomics=bool(cfg.relaxed_atomics))



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


def sorted_chunk_rows(t: int, ksel: int, di: int, contrib_bytes: int, scratch_bytes: int) -> int:
    """Queries per chunk of the sorted reductions: at most as many as fit ``scratch_bytes`` at ``ksel *
    (di * contrib_bytes + INDEX_BYTES_PER_SLOT)`` bytes each (at least one), and few enough that a chunk's
    slot positions fit int32; the fewest chunks those allow, of equal size (the last one shorter)."""
    per_query = ksel * (di * contrib_bytes + INDEX_BYTES_PER_SLOT)
    most = max(1, min(t, scratch_bytes // per_query, (2**31 - 1) // max(ksel, 1)))
    return -(-t // -(-t // most)) if t > 0 else 1


def _sorted_destinations(idx: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dest, seg)`` of one chunk's slots ``idx [rows, K]``: ``dest [rows * K]`` int32, the position of
    slot ``(t, j)`` (flattened query-major) in the stable sort of the slots by key row, and ``seg [G + 1]``
    int64, key row g's segment ``seg[g] : seg[g + 1]`` of that order. Empty slots sort last, past
    ``seg[G]``. The order (by key row, then query, then slot) is a function of ``idx`` alone."""
    flat = idx.reshape(-1)
    # the narrowest key that holds G: a radix sort's passes (and key bytes) follow the key's width
    key_dtype = torch.int16 if g < 2**15 else torch.int32
    key = torch.where((flat >= 0) & (flat < g), flat, g).to(key_dtype)
    sorted_key, perm = torch.sort(key, stable=True)
    seg = torch.searchsorted(sorted_key, torch.arange(g + 1, dtype=key_dtype, device=idx.device))
    dest = torch.empty(flat.numel(), dtype=torch.int32, device=idx.device)
    block = 1024
    _build("_invert_permutation_kernel", idx.device)[(triton.cdiv(flat.numel(), block),)](
        perm, dest, flat.numel(), BLOCK=block, num_warps=4)
    return dest, seg


@dataclass
class BackwardPlan:
    """One backward's tensors and its chunks of queries (``chunk`` each, the last one shorter): the
    inputs, the outputs ``dq`` (q's dtype), ``dw`` and ``dkeys`` (fp32), and for the sorted reductions
    the contributions buffer ``[chunk * K, Di]`` (fp32 or bf16; None for ``atomic``, one chunk).
    :func:`_gather_backward` runs, per chunk, :meth:`destinations`, :meth:`run_kernel` and
    :meth:`reduce`; the benchmarks time each of them alone."""

    q: torch.Tensor
    w: torch.Tensor
    keys: torch.Tensor
    idx: torch.Tensor
    grad: torch.Tensor
    dq: torch.Tensor
    dw: torch.Tensor
    dkeys: torch.Tensor
    contrib: torch.Tensor | None
    chunk: int
    reduction: str
    config: GatherBwdConfig | None
    layout: str
    index_ahead: bool = True

    @classmethod
    def new(cls, q, w, keys, idx, grad, reduction: str, config: GatherBwdConfig | None = None,
            scratch_bytes: int = BWD_SCRATCH_BYTES, layout: str | None = None,
            index_ahead: bool | None = None) -> BackwardPlan:
        """The plan of a non-empty backward (``T, K, G > 0``): ``reduction`` one of :data:`REDUCTIONS`
        (resolved), ``config`` a checked pin or None (the ladder), ``scratch_bytes`` the sorted
        reductions' per-chunk budget (:func:`sorted_chunk_rows`), ``layout`` the kernel (one of
        :data:`LAYOUTS`; None: the kernel option ``triton_scores_bwd_layout``'s default), ``index_ahead`` the
        keys-on-M kernel's indices a step ahead (None: the option ``triton_scores_bwd_index_ahead``'s default)."""
        t, _, di = q.shape
        ksel = idx.shape[1]
        contrib, chunk = None, t
        if reduction != "atomic":
            contrib_dtype = torch.bfloat16 if reduction == "sorted-bf16" else torch.float32
            chunk = sorted_chunk_rows(t, ksel, di, contrib_dtype.itemsize, scratch_bytes)
            contrib = torch.empty(chunk * ksel, di, dtype=contrib_dtype, device=q.device)
        # every query's program writes its whole dq and dw rows: no fill (a fill of dq would be a pass over it)
        return cls(q, w, keys, idx, grad, torch.empty_like(q), torch.empty(t, q.shape[1], dtype=torch.float32,
                   device=q.device), torch.zeros(keys.shape[0], di, dtype=torch.float32, device=q.device),
                   contrib, chunk, reduction, config, _layout_of(layout), _index_ahead_of(index_ahead))

    def starts(self) -> range:
        """The first query of every chunk."""
        return range(0, self.q.shape[0], self.chunk)

    def destinations(self, t0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dest, seg)`` of the chunk starting at ``t0`` (:func:`_sorted_destinations`)."""
        return _sorted_destinations(self.idx[t0:t0 + self.chunk], self.keys.shape[0])

    def run_kernel(self, t0: int, dest: torch.Tensor | None = None) -> None:
        """The backward kernel of :attr:`layout` over the chunk starting at ``t0``: dq and dw of its queries,
        and their key gradients added into ``dkeys`` (``atomic``) or stored to ``contrib`` at ``dest``."""
        q, dev = self.q, self.q.device
        t, hi, di = q.shape
        rows = min(self.chunk, t - t0)
        block_d = triton.next_power_of_2(di)
        block_h = max(16, triton.next_power_of_2(hi))
        is_sorted = self.contrib is not None
        kernel = _build("_gather_bwd_keys_on_m_kernel" if self.layout == "keys_on_m" else "_gather_bwd_kernel", dev)
        dest = dest if is_sorted else self.dkeys  # the atomic build never reads DEST nor CONTRIB
        contrib = self.contrib if is_sorted else self.dkeys

        def launch(cfg: GatherBwdConfig) -> None:
            kernel[(rows,)](
                q, self.w, self.keys, self.idx, self.grad, self.dq, self.dw, self.dkeys, dest, contrib, hi,
                self.keys.shape[0], self.idx.shape[1], t0,
                q.stride(0), q.stride(1), self.w.stride(0), self.keys.stride(0), self.idx.stride(0),
                self.grad.stride(0), self.dq.stride(0), self.dq.stride(1), self.dkeys.stride(0),
                DI=di, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_K=cfg.block_k, SORTED=is_sorted,
                RELAXED=cfg.relaxed_atomics, PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **ahead,
            )

        ahead = {"INDEX_AHEAD": self.index_ahead} if self.layout == "keys_on_m" else {}
        _launch("gather_bwd", (dev.type, di, block_h, q.dtype, self.reduction, self.layout, self.index_ahead),
                _gather_bwd_ladder(block_d, q.dtype, _interpreted(dev), self.layout), self.config, launch)

    def reduce(self, seg: torch.Tensor) -> None:
        """``_segment_reduce_kernel``: add the chunk's contributions, segment ``seg`` by segment, to
        ``dkeys`` (chunk after chunk: the same order of additions on every replay)."""
        g, di = self.dkeys.shape
        _build("_segment_reduce_kernel", self.q.device)[(g,)](
            self.contrib, seg, self.dkeys, self.dkeys.stride(0), DI=di, BLOCK_D=triton.next_power_of_2(di),
            BLOCK_C=REDUCE_BLOCK_ROWS, num_warps=4)


def _gather_backward(q, w, keys, idx, grad, reduction: str, config: GatherBwdConfig | None = None,
                     scratch_bytes: int = BWD_SCRATCH_BYTES, layout: str | None = None,
                     index_ahead: bool | None = None):
    """``(dq, dw fp32, dkeys fp32)`` of :func:`indexer_scores_triton` for the upstream fp32 ``grad
    [T, K]``; ``reduction``: one of :data:`REDUCTIONS` (resolved: deterministic mode already applied);
    ``config``: a checked pin (:func:`_gather_bwd_pinned`) or None (the ladder); ``scratch_bytes``: the
    sorted reductions' per-chunk budget (:func:`sorted_chunk_rows`); ``layout``: the kernel (one of
    :data:`LAYOUTS`; None: the option's default); ``index_ahead``: the keys-on-M kernel's indices a step
    ahead (None: the option's default)."""
    t, hi, di = q.shape
    g, ksel = keys.shape[0], idx.shape[1]
    if t == 0 or ksel == 0 or g == 0:
        return (torch.zeros_like(q), torch.zeros(t, hi, dtype=torch.float32, device=q.device),
                torch.zeros(g, di, dtype=torch.float32, device=q.device))
    plan = BackwardPlan.new(q, w, keys, idx, grad, reduction, config, scratch_bytes, layout, index_ahead)
    for t0 in plan.starts():
        if reduction == "atomic":
            plan.run_kernel(t0)
        else:
            dest, seg = plan.destinations(t0)
            plan.run_kernel(t0, dest)
            plan.reduce(seg)
    return plan.dq, plan.dw, plan.dkeys


def resolve_reduction(reduction: str, deterministic: bool) -> str:
    """The key-gradient reduction that runs: ``reduction``, except that deterministic mode turns
    ``atomic`` into ``sorted`` (the sorted ones are deterministic already)."""
    return "sorted" if deterministic and reduction == "atomic" else reduction


class _TritonIndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, keys, idx, bwd_config, reduction, scratch_bytes, layout, index_ahead):
        q_c, w_c, keys_c, idx_c = q.contiguous(), w.contiguous(), keys.contiguous(), idx.contiguous()
        out = _gather_forward(q_c, w_c, keys_c, idx_c)
        ctx.save_for_backward(q_c, w_c, keys_c, idx_c)
        ctx.bwd_config, ctx.reduction, ctx.scratch_bytes = bwd_config, reduction, scratch_bytes
        ctx.layout, ctx.index_ahead = layout, index_ahead
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, w, keys, idx = ctx.saved_tensors
        reduction = resolve_reduction(ctx.reduction, is_deterministic())
        kernel_options.note_backend("indexer_scores.bwd", f"triton/{reduction}")
        grad = grad.to(torch.float32).contiguous()
        dq, dw, dkeys = _gather_backward(q, w, keys, idx, grad, reduction, ctx.bwd_config, ctx.scratch_bytes,
                                         ctx.layout, ctx.index_ahead)
        return dq, dw.to(w.dtype), dkeys.to(keys.dtype), None, None, None, None, None, None


def _reduction_of(reduce: str | None) -> str:
    """``reduce`` (checked), else the kernel option ``triton_scores_bwd_reduce``'s default."""
    if reduce is None:
        return kernel_options.OPTIONS["triton_scores_bwd_reduce"].default  # type: ignore[return-value]
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce: must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduce!r}")
    return reduce


def _layout_of(layout: str | None) -> str:
    """``layout`` (checked), else the kernel option ``triton_scores_bwd_layout``'s default."""
    if layout is None:
        return kernel_options.OPTIONS["triton_scores_bwd_layout"].default  # type: ignore[return-value]
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def _index_ahead_of(index_ahead: bool | None) -> bool:
    """``index_ahead`` (checked), else the kernel option ``triton_scores_bwd_index_ahead``'s default."""
    if index_ahead is None:
        return bool(kernel_options.OPTIONS["triton_scores_bwd_index_ahead"].default)
    if not isinstance(index_ahead, bool):
        raise ValueError(f"index_ahead: must be a bool, got {index_ahead!r}")
    return index_ahead


def _scratch_of(scratch_bytes: int | None) -> int:
    """``scratch_bytes`` (checked), else :data:`BWD_SCRATCH_BYTES`."""
    if scratch_bytes is None:
        return BWD_SCRATCH_BYTES
    if isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int) or scratch_bytes < 1:
        raise ValueError(f"scratch_bytes: must be a positive int, got {scratch_bytes!r}")
    return scratch_bytes


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, *,
                          bwd_config: GatherBwdConfig | None = None, reduce: str | None = None,
                          scratch_bytes: int | None = None, layout: str | None = None,
                          index_ahead: bool | None = None) -> torch.Tensor:
    """Differentiable scores ``[T, K]`` fp32 of queries at key rows ``idx [T, K]`` (Triton forward and
    backward); the contract of :func:`dsv4cp.ops.indexer.indexer_scores` for bf16 / fp16 / fp32 inputs.

    ``q [T, Hi, Di]``, ``w [T, Hi]``, ``keys [G, Di]`` (q's dtype), ``idx`` int32/int64 (``-1`` =
    empty slot: score 0 there, no gradient). Backward: ``dq`` and ``dw`` per query (no atomics), ``dkeys``
    by the reduction ``reduce`` (one of :data:`REDUCTIONS`; default: the kernel option
    ``triton_scores_bwd_reduce``'s): fp32 atomics (``atomic``; ``sorted`` instead when
    :func:`dsv4cp.kernels.is_deterministic` at backward time), or per-slot contributions in fp32
    (``sorted``) or bf16 (``sorted-bf16``) summed per key row in a fixed order, bitwise reproducible, in
    chunks of queries whose scratch stays within ``scratch_bytes`` (default: :data:`BWD_SCRATCH_BYTES`;
    the op hands the kernel option ``triton_scores_bwd_scratch`` in MiB). Gradients are returned in the
    inputs' dtypes. ``bwd_config`` pins the backward's launch (a :class:`GatherBwdConfig` or the kernel
    option ``triton_gather_bwd_config``'s integers; default: the ladder of the layout); ``layout`` picks the
    backward kernel (one of :data:`LAYOUTS`; default: the kernel option ``triton_scores_bwd_layout``'s) and
    ``index_ahead`` whether the keys-on-M kernel loads its indices a step ahead (default: the option
    ``triton_scores_bwd_index_ahead``'s). Every argument is checked here, before any work.
    """
    pinned, reduction, scratch, layout, ahead = check_settings(q, w, keys, idx, bwd_config=bwd_config,
                                                               reduce=reduce, scratch_bytes=scratch_bytes,
                                                               layout=layout, index_ahead=index_ahead)
    return _TritonIndexerScores.apply(q, w, keys, idx, pinned, reduction, scratch, layout, ahead)


def check_settings(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, *,
                   bwd_config: GatherBwdConfig | None = None, reduce: str | None = None,
                   scratch_bytes: int | None = None, layout: str | None = None,
                   index_ahead: bool | None = None) -> tuple[GatherBwdConfig | None, str, int, str, bool]:
    """The checks :func:`indexer_scores_triton` makes before any work (the inputs, then the backward's
    launch pin, reduction, scratch, layout and index order, each from its argument or else its default):
    ``ValueError`` naming the first bad one, else ``(pinned launch or None, reduction, scratch bytes,
    layout, index_ahead)``."""
    _check_qwk(q, w, keys)
    _check_idx(q, idx)
    return (_gather_bwd_pinned(bwd_config), _reduction_of(reduce), _scratch_of(scratch_bytes), _layout_of(layout),
            _index_ahead_of(index_ahead))
