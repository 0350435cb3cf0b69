"""Triton kernels for the indexer loss's attention target (docs/design.md §1.5): no-grad head-summed probabilities.

With the attention's logits ``l[t, h, k] = scale * <q[t, h], keys[idx[t, k]]>`` over the slots ``k`` of
query ``t`` (a slot is valid when ``0 <= idx < N``; ``-1`` marks an empty one):

* :func:`logsumexp_over_triton`: ``lse[t, h] = log sum_k e^{l[t, h, k]}`` over the valid slots
  (natural log, fp32, ``-inf`` for a query with no valid slot);
* :func:`head_summed_probs_triton`: ``out[t, k] = sum_h e^{l[t, h, k] - log_denominator[t, h]}`` (fp32,
  0 at empty slots).

They replace the torch reference in :mod:`dsv4cp.ops.attention_probs` (chunked ``[chunk, K, D]`` fp32
gathers) on CUDA: the gathered key rows are read ONCE per query, in q's dtype, and the logits never
leave the chip. Same conventions as the sparse-attention forward (:mod:`.sparse_attention_triton`),
whose helpers this module imports (its kernel set, built per execution mode and launched over
configuration ladders with the ``OutOfResources`` fallback; matrix-unit precision, the interpreter's
bf16 work around) rather than repeats; pinned configurations come from :mod:`._triton_launch`.

Kernels:

* ``_head_probs_kernel``: one program per query token. The query's slots are visited in blocks of
  ``BLOCK_K``: the gathered key rows ``[BLOCK_K, D]`` are loaded once per block, the logits formed in
  fp32 accumulation with ``scale * log2 e`` folded in (``p = 2^(s - log_denominator * log2 e)``) and ``p``
  summed over heads. With ``H <= BLOCK_H`` (one head block: H = 64 in the flash preset) q and the
  denominators are loaded once, before the slot loop, and by default the logits are ``keys @ q^T``:
  slots on the matrix unit's M, heads on N, so the head sum runs along each thread's registers and a
  lane quad (``DSV4CP_TRITON_PROBS_SLOTS_ON_M=0``: ``q @ keys^T``, heads on M, whose sum crosses the
  warps through shared memory, which is slower). Otherwise the program loops over the head blocks inside each
  slot block (the keys stay loaded, q re-read from L2, heads on M), accumulating the head sum in a fixed
  order: no atomics, deterministic.
* ``_head_probs_chunked_kernel`` (kernel option ``triton_probs_kernel=d_chunks``, the default): the
  head dim is the matrix product's reduction loop. A work item is (query, block of ``BLOCK_K`` slots); each step
  gathers ``[BLOCK_K, BLOCK_DC]`` key columns and the matching ``[BLOCK_H, BLOCK_DC]`` q columns into
  shared memory and accumulates the ``[BLOCK_K, BLOCK_H]`` (or, ``slots_on_m=0``, ``[BLOCK_H, BLOCK_K]``)
  logits in registers; the last chunk of a head block adds its probabilities' head sum, the last head
  block stores the item. The steps of all the program's items form ONE flat loop (persistent grid:
  ``programs_per_sm`` programs per multiprocessor; 0: one program per item), so the cp.async pipeline
  keeps several small gathers in flight and never drains between items or queries.
* ``_lse_kernel``: one program per (query token, block of ``BLOCK_H`` heads), the sparse-attention
  forward without the value product: online max / sum over slot blocks in fp32 with ``exp2``.
* ``_lse_chunked_kernel`` (kernel option ``triton_lse_kernel=d_chunks``): the same online max / sum with
  the head dim as the reduction loop, over one flat loop of (item = (query, head block), slot block,
  chunk) steps like ``_head_probs_chunked_kernel``; heads on M, so the max and the sum over slots stay in
  a thread's row and its lane quad.

Traffic at the flash shape (T = 32768, H = 64, D = 512, K = 512, bf16): each query reads its 512
gathered rows once (512 KB) and its q once (64 KB), ~19 GB in all (the torch path moves ~34 GB through
fp32 gathers, einsum and exp temporaries); the matrix work, 2 T H K D = 1.1 PFLOP, is ~2 ms of
wgmma, so the kernels are bound by the gathers: ~4 ms at H200 bandwidth if every row came from HBM,
less as the key buffer (a few MB of compressed rows) stays largely in the 50 MB L2.

Why ``d_chunks``: the ``whole_d`` kernel's loop waits for its gathered block, multiplies, forms the
probabilities and only then issues the next block's gather, one program per multiprocessor, so nothing
hides the gather's latency. ``d_chunks`` keeps several steps of gathers in flight (Triton pipelines the
index load and the gather in separate stages: ``num_stages`` s keeps ``(s - 1) // 2 + 1`` gathered tiles)
and reads q from L2 in ``[BLOCK_H, BLOCK_DC]`` chunks instead of holding it; with every slot of a query in
one item q is read once per query. The kernels are bound by the gathers from L2, not by the matrix unit.
The probabilities ladder's first entry measured fastest at the flash shape; every first entry fits
sm_90's shared memory and registers without spilling, and the next entries take over on
``OutOfResources``. The resources
and timings of every entry, and the results folders that hold them: docs/kernels.md.

``DSV4CP_TRITON_PROBS_CONFIG`` / ``DSV4CP_TRITON_LSE_CONFIG`` (``"block_h,block_k,num_warps,num_stages"``)
or the wrappers' keyword arguments pin a configuration; otherwise the first of the ladder that compiles
(``OutOfResources`` moves on) is used and cached per shape class; ``DSV4CP_TRITON_PROBS_CHUNK_CONFIG``
/ ``DSV4CP_TRITON_LSE_CHUNK_CONFIG`` or ``chunk_config`` pins a ``d_chunks`` launch. The kernels are
built by this module's own kernel set (listed by :func:`dsv4cp.kernels.report.compiled_resources`).

CPU tensors run on Triton's interpreter (``TRITON_INTERPRET=1`` before triton's first import; tiny
sizes only), as for the attention kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels._triton_gather import gather_rows
from dsv4cp.kernels._triton_launch import Kernels
from dsv4cp.kernels._triton_launch import pinned as _pinned
from dsv4cp.kernels._triton_launch import pinned_config as _pinned_config
from dsv4cp.kernels.sparse_attention_launch import (
    _SUPPORTED_DTYPES,
    LOG2E,
    MAX_HEAD_DIM,
    KernelConfig,
    _block_h,
    _config_key,
    _dot_f32,
    _precision,
)

__all__ = [
    "KERNEL_CHOICES",
    "MAX_HEAD_DIM",
    "SLOTS_ON_M_ENV",
    "ChunkConfig",
    "KernelConfig",
    "LseChunkConfig",
    "head_summed_probs_triton",
    "logsumexp_over_triton",
]

SLOTS_ON_M_ENV = kernel_options.OPTIONS["triton_probs_slots_on_m"].env
"""Which operand order the probabilities kernel's logits use with one head block (see :func:`_slots_on_m`)."""

KERNEL_CHOICES = kernel_options.OPTIONS["triton_probs_kernel"].choices
"""Each op's kernels: ``whole_d`` (``_head_probs_kernel``, ``_lse_kernel``) and ``d_chunks``
(``_head_probs_chunked_kernel``, ``_lse_chunked_kernel``)."""


@dataclass(frozen=True)
class ChunkConfig:
    """``d_chunks`` probabilities launch: heads per head block (``block_h``), slots per work item
    (``block_k``), head-dim columns per step (``block_d``, capped at D's power of two), warps, stages, the
    logits' layout (``slots_on_m`` 1: ``[block_k, block_h]``, 0: ``[block_h, block_k]``) and the grid
    (``programs_per_sm`` 0: one program per (query, slot block); n > 0: a persistent grid of n programs
    per multiprocessor)."""

    block_h: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    slots_on_m: int
    programs_per_sm: int


@dataclass(frozen=True)
class LseChunkConfig:
    """``d_chunks`` log-sum-exp launch: heads per work item (``block_h``, matrix-unit M), slots per step
    (``block_k``), head-dim columns per step (``block_d``, capped at D's power of two), warps, stages and
    the grid (``programs_per_sm`` 0: one program per (query, head block); n > 0: n per multiprocessor)."""

    block_h: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    programs_per_sm: int


# ---------------------------------------------------------------------------------------------------
# Kernel bodies (plain functions, registered with the attention module's builder below).
# ---------------------------------------------------------------------------------------------------


def _head_probs_kernel(
    Q, KEYS, IDX, LDEN, OUT,  # pointers
    qk_scale2,  # fp32: scale * log2(e)
    H, N, KT,  # heads, key rows, slots per query
    stride_qt, stride_qh, stride_kn, stride_it, stride_lt, stride_lh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_HEAD_BLOCK: tl.constexpr, SLOTS_ON_M: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Head-summed probabilities of query token t = program_id(0).

    Q ``[T, H, D]``, KEYS ``[N, D]`` (same float dtype, unit stride along D), IDX ``[T, KT]`` int32 /
    int64, LDEN ``[T, H]`` fp32 (natural log), OUT ``[T, KT]`` fp32.
    """
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    h_off = tl.arange(0, BLOCK_H)
    if ONE_HEAD_BLOCK:  # every head in one tile: q and the denominators stay loaded for all slots
        hmask = h_off < H
        q = tl.load(Q + t * stride_qt + h_off[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: fp32 products there
            q = q.to(tl.float32)
        # padding heads: denominator +inf -> 2^(s - inf) = 0
        lden2 = tl.load(LDEN + t * stride_lt + h_off * stride_lh, mask=hmask, other=float("inf")) * 1.4426950408889634

    for k0 in range(0, KT, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_row = slots < KT
        rows, valid, keys = gather_rows(KEYS, IDX + t * stride_it, slots, in_row, N, stride_kn, d, dmask,
                                        D, BLOCK_D, DOT_F32)
        if ONE_HEAD_BLOCK and SLOTS_ON_M:  # logits transposed: the head sum runs along each thread's row
            s = tl.dot(keys, tl.trans(q), input_precision=PRECISION) * qk_scale2
            acc = tl.sum(tl.math.exp2(s - lden2[None, :]), 1)
        elif ONE_HEAD_BLOCK:
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale2
            acc = tl.sum(tl.math.exp2(s - lden2[:, None]), 0)
        else:
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):  # fixed order over head blocks: deterministic sum
                heads = h0 + h_off
                hmask = heads < H
                qb = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                             mask=hmask[:, None] & dmask[None, :], other=0.0)
                if DOT_F32:
                    qb = qb.to(tl.float32)
                lden2 = tl.load(LDEN + t * stride_lt + heads * stride_lh, mask=hmask,
                                other=float("inf")) * 1.4426950408889634
                s = tl.dot(qb, tl.trans(keys), input_precision=PRECISION) * qk_scale2
                acc += tl.sum(tl.math.exp2(s - lden2[:, None]), 0)
        tl.store(OUT + t * stride_ot + slots, tl.where(valid, acc, 0.0), mask=in_row)


@triton.jit
def _chunk_tiles(KEYS, Q, rows, valid, t, heads, hmask, d, stride_kn, stride_qt, stride_qh, D: tl.constexpr,
                 EVEN_D: tl.constexpr, DOT_F32: tl.constexpr):
    """One head-dim chunk ``d`` of a step of the ``d_chunks`` kernels: the gathered key columns
    ``[BLOCK_K, BLOCK_DC]`` (zero at invalid rows) and the query's head columns ``[BLOCK_H, BLOCK_DC]``
    (zero at padding heads); masked by row only when the chunks tile the head dim (``EVEN_D``: fewer
    predicates on the gather); fp32 when ``DOT_F32`` (Triton's CPU interpreter multiplies bf16 tiles
    wrongly)."""
    if EVEN_D:
        kmask = valid[:, None]
        qmask = hmask[:, None]
    else:
        kmask = valid[:, None] & (d < D)[None, :]
        qmask = hmask[:, None] & (d < D)[None, :]
    keys = tl.load(KEYS + rows[:, None] * stride_kn + d[None, :], mask=kmask, other=0.0)
    qc = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        keys = keys.to(tl.float32)
        qc = qc.to(tl.float32)
    return keys, qc


def _head_probs_chunked_kernel(
    Q, KEYS, IDX, LDEN, OUT,  # pointers
    qk_scale2,  # fp32: scale * log2(e)
    H, N, KT, N_ITEMS, N_SB, N_HB,  # heads, key rows, slots per query, (query, slot block) items, slot / head blocks
    stride_qt, stride_qh, stride_kn, stride_it, stride_lt, stride_lh, stride_ot,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    SLOTS_ON_M: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Head-summed probabilities with the head dim as the matrix product's reduction loop.

    Same tensors as ``_head_probs_kernel``. Work item = (query t, block of ``BLOCK_K`` slots); program p
    takes items p, p + P, p + 2P, ... (P = the grid: one item per program, or a persistent grid). One flat
    loop runs over the program's (item, head block, head-dim chunk) steps, so the software pipeline never
    drains between items: each step gathers the ``[BLOCK_K, BLOCK_DC]`` key columns and the matching
    ``[BLOCK_H, BLOCK_DC]`` q columns (q re-read from L2 per slot block) and accumulates the logits; the
    last chunk of a head block turns them into probabilities and adds their head sum, the last head
    block stores it. The head blocks are summed in a fixed order: deterministic.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    N_DC: tl.constexpr = (D + BLOCK_DC - 1) // BLOCK_DC
    EVEN_D: tl.constexpr = D % BLOCK_DC == 0
    steps = tl.cdiv(N_ITEMS - pid, n_prog) * N_HB * N_DC
    dcol = tl.arange(0, BLOCK_DC)
    h_off = tl.arange(0, BLOCK_H)
    k_off = tl.arange(0, BLOCK_K)
    if SLOTS_ON_M:
        acc = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for step in range(0, steps):
        dc = step % N_DC
        hb = (step // N_DC) % N_HB
        item = pid + (step // (N_DC * N_HB)) * n_prog
        t = (item // N_SB).to(tl.int64)
        slots = (item % N_SB) * BLOCK_K + k_off
        in_row = slots < KT
        d = dc * BLOCK_DC + dcol
        rows = tl.load(IDX + t * stride_it + slots, mask=in_row, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < N)
        heads = hb * BLOCK_H + h_off
        hmask = heads < H
        keys, qc = _chunk_tiles(KEYS, Q, rows, valid, t, heads, hmask, d, stride_kn, stride_qt, stride_qh,
                                D, EVEN_D, DOT_F32)
        if SLOTS_ON_M:  # [BLOCK_K, BLOCK_H]: the head sum runs along each thread's registers
            acc = tl.dot(keys, tl.trans(qc), acc, input_precision=PRECISION)
        else:  # [BLOCK_H, BLOCK_K]: slots on the matrix unit's N (m64nBLOCK_K), the head sum crosses warps
            acc = tl.dot(qc, tl.trans(keys), acc, input_precision=PRECISION)
        if dc == N_DC - 1:
            # padding heads: denominator +inf -> 2^(s - inf) = 0
            lden2 = tl.load(LDEN + t * stride_lt + heads * stride_lh, mask=hmask,
                            other=float("inf")) * 1.4426950408889634
            if SLOTS_ON_M:
                total += tl.sum(tl.math.exp2(acc * qk_scale2 - lden2[None, :]), 1)
            else:
                total += tl.sum(tl.math.exp2(acc * qk_scale2 - lden2[:, None]), 0)
            if hb == N_HB - 1:  # the rows again, in the sum's layout (here, not in every step's)
                rows_out = tl.load(IDX + t * stride_it + slots, mask=in_row, other=-1)
                filled = (rows_out >= 0) & (rows_out < N)
                tl.store(OUT + t * stride_ot + slots, tl.where(filled, total, 0.0), mask=in_row)
                total = tl.zeros([BLOCK_K], dtype=tl.float32)
            acc = tl.zeros_like(acc)


def _lse_kernel(
    Q, KEYS, IDX, LSE,  # pointers
    qk_scale2,  # fp32: scale * log2(e)
    H, N, KT, N_HB,  # heads, key rows, slots per query, head blocks per query
    stride_qt, stride_qh, stride_kn, stride_it,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Log-sum-exp of one (query token t, head block): LSE ``[T, H]`` fp32, natural log, ``-inf`` for no
    valid slot. Q ``[T, H, D]``, KEYS ``[N, D]``, IDX ``[T, KT]`` as in ``_head_probs_kernel``."""
    pid = tl.program_id(0)
    t = (pid // N_HB).to(tl.int64)
    heads = (pid % N_HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of 2^(s - m_i)
    for k0 in range(0, KT, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        rows, valid, keys = gather_rows(KEYS, IDX + t * stride_it, slots, slots < KT, N, stride_kn, d, dmask,
                                        D, BLOCK_D, DOT_F32)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: avoid -inf - -inf
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
        m_i = m_new

    has_key = l_i > 0.0
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has_key, (m_use + tl.math.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(LSE + t * H + heads, lse, mask=hmask)


def _lse_chunked_kernel(
    Q, KEYS, IDX, LSE,  # pointers
    qk_scale2,  # fp32: scale * log2(e)
    H, N, KT, N_ITEMS, N_SB, N_HB,  # heads, key rows, slots per query, (query, head block) items, slot / head blocks
    stride_qt, stride_qh, stride_kn, stride_it,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Log-sum-exp with the head dim as the matrix product's reduction loop (tensors as ``_lse_kernel``).

    Work item = (query t, block of ``BLOCK_H`` heads); program p takes items p, p + P, ... One flat loop
    runs over the program's (item, slot block, head-dim chunk) steps, as in ``_head_probs_chunked_kernel``:
    each step gathers ``[BLOCK_K, BLOCK_DC]`` key columns and the ``[BLOCK_H, BLOCK_DC]`` q columns and
    accumulates the ``[BLOCK_H, BLOCK_K]`` logits (heads on M: the max and sum over slots stay in a
    thread's row and its lane quad); the last chunk of a slot block updates the online max / sum, the
    last slot block stores the item.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    N_DC: tl.constexpr = (D + BLOCK_DC - 1) // BLOCK_DC
    EVEN_D: tl.constexpr = D % BLOCK_DC == 0
    steps = tl.cdiv(N_ITEMS - pid, n_prog) * N_SB * N_DC
    dcol = tl.arange(0, BLOCK_DC)
    h_off = tl.arange(0, BLOCK_H)
    k_off = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of 2^(s - m_i)
    for step in range(0, steps):
        dc = step % N_DC
        sb = (step // N_DC) % N_SB
        item = pid + (step // (N_DC * N_SB)) * n_prog
        t = (item // N_HB).to(tl.int64)
        heads = (item % N_HB) * BLOCK_H + h_off
        hmask = heads < H
        slots = sb * BLOCK_K + k_off
        d = dc * BLOCK_DC + dcol
        rows = tl.load(IDX + t * stride_it + slots, mask=slots < KT, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < N)
        keys, qc = _chunk_tiles(KEYS, Q, rows, valid, t, heads, hmask, d, stride_kn, stride_qt, stride_qh,
                                D, EVEN_D, DOT_F32)
        acc = tl.dot(qc, tl.trans(keys), acc, input_precision=PRECISION)
        if dc == N_DC - 1:  # the slots' validity again, in the logits' layout (here, not in every step's)
            rows_s = tl.load(IDX + t * stride_it + slots, mask=slots < KT, other=-1)
            s = tl.where(((rows_s >= 0) & (rows_s < N))[None, :], acc * qk_scale2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: avoid -inf - -inf
            l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
            m_i = m_new
            if sb == N_SB - 1:
                has_key = l_i > 0.0
                m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
                lse = tl.where(has_key, (m_fin + tl.math.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                               float("-inf"))
                tl.store(LSE + t * H + heads, lse, mask=hmask)
                m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros_like(acc)


_KERNELS = Kernels("attention_probs triton", _head_probs_kernel, _head_probs_chunked_kernel, _lse_kernel,
                   _lse_chunked_kernel, op="attention_probs")
_build, _launch = _KERNELS.build, _KERNELS.launch


# ---------------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------------


def _ladder(block_d: int, heads: int, dtype: torch.dtype, head_loop: bool = False) -> list[KernelConfig]:
    """Configurations to try in order. ``head_loop``: the probabilities kernel with ``H > BLOCK_H`` (q
    re-loaded, and pipelined, per head block inside the slot loop)."""
    bh = _block_h(heads)
    if block_d >= 256 and dtype == torch.float32:  # fp32 products on the CUDA cores ("ieee")
        ladder = [(min(bh, 32), 32, 8, 1), (16, 32, 4, 1), (16, 16, 4, 1)]
    elif block_d >= 256 and head_loop:
        ladder = [(bh, 64, 8, 2), (bh, 32, 8, 2), (bh, 64, 4, 1), (min(bh, 32), 16, 4, 1)]
    elif block_d >= 256:
        ladder = [(bh, 64, 4, 2), (bh, 32, 4, 3), (bh, 16, 4, 3), (bh, 64, 4, 1), (min(bh, 32), 16, 4, 1)]
    else:
        ladder = [(bh, 64, 4, 2), (bh, 32, 4, 2), (bh, 32, 4, 1), (bh, 16, 4, 1)]
    return [KernelConfig(*c) for c in ladder]


def _chunk_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[ChunkConfig]:
    """``d_chunks`` configurations to try in order (resources at the flash shape: the module docstring).
    Triton pipelines the index load and the gather in separate stages: ``num_stages`` s keeps
    ``(s - 1) // 2 + 1`` gathered tiles in shared memory."""
    bh = _block_h(heads)
    if dtype == torch.float32:  # fp32 products on the CUDA cores ("ieee"): small tiles
        ladder = [(min(bh, 32), 32, 32, 8, 3, 1, 0), (16, 16, 32, 4, 1, 1, 0)]
    elif block_d >= 256 and heads > 64:
        # 128 heads a step: the rows are gathered once per query (64: once per head block), q twice;
        # 149 KB, 235 registers with 8 warps (16 warps spill)
        ladder = [(128, 256, 64, 8, 5, 1, 1), (bh, 512, 64, 16, 5, 1, 1), (bh, 512, 32, 8, 7, 1, 1),
                  (bh, 64, 64, 4, 5, 1, 4), (min(bh, 32), 32, 64, 4, 3, 1, 0)]
    elif block_d >= 256:
        # fastest first as bench/test_bench_attention_probs.py measured them on an H200 (docs/kernels.md);
        # the 226 KB tiles first, smaller ones next
        ladder = [(bh, 512, 64, 16, 5, 1, 1), (bh, 512, 64, 8, 5, 1, 1), (bh, 512, 32, 8, 7, 1, 1),
                  (bh, 128, 64, 4, 7, 1, 2), (bh, 64, 64, 4, 5, 1, 4), (min(bh, 32), 32, 64, 4, 3, 1, 0)]
    else:
        ladder = [(bh, 64, 32, 4, 3, 1, 2), (bh, 32, 32, 4, 1, 1, 0)]
    return [ChunkConfig(*c) for c in ladder]


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the interpreter (its programs run one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _grid_programs(items: int, programs_per_sm: int, device: torch.device) -> int:
    """Programs of a ``d_chunks`` launch: one per work item (``programs_per_sm == 0``), else a persistent
    grid of ``programs_per_sm`` per multiprocessor, never more than the items."""
    return items if programs_per_sm == 0 else min(items, programs_per_sm * _multiprocessors(device))


def _kernel_choice(explicit: str | None, option: str) -> str:
    """``explicit``, else the kernel option ``option``'s default (``triton_probs_kernel``: ``d_chunks``;
    ``triton_lse_kernel``: ``whole_d``)."""
    name = kernel_options.OPTIONS[option].default if explicit is None else explicit
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernel: must be one of {', '.join(KERNEL_CHOICES)}, got {name!r}")
    return name


def _lse_chunk_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[LseChunkConfig]:
    """``d_chunks`` log-sum-exp configurations to try in order (heads on M; resources: the module
    docstring)."""
    bh = _block_h(heads)
    if dtype == torch.float32:
        ladder = [(min(bh, 32), 32, 32, 8, 3, 0), (16, 16, 32, 4, 1, 0)]
    elif block_d >= 256:
        # the probabilities kernel's trend on an H200: 128-byte row pieces and 16 warps; 256 slots per step
        # (q re-read once per slot block; 512 wastes matrix work on short slot lists such as the dense
        # variant's window)
        ladder = [(bh, 256, 64, 16, 7, 1), (bh, 256, 32, 8, 7, 1), (bh, 128, 64, 4, 7, 2), (bh, 64, 64, 4, 5, 2),
                  (min(bh, 32), 32, 64, 4, 3, 0)]
    else:
        ladder = [(bh, 64, 32, 4, 3, 2), (bh, 32, 32, 4, 1, 0)]
    return [LseChunkConfig(*c) for c in ladder]


def _pinned_chunks(chunk_config: object, config_type: type[ChunkConfig] | type[LseChunkConfig],
                   **whole_d_pins: int | None) -> ChunkConfig | LseChunkConfig | None:
    """The ``d_chunks`` launch's pin read from ``chunk_config`` (a config, the kernel option's integers or
    None: the ladder) and checked, after refusing the ``whole_d`` launch's pins (:func:`_refuse_whole_d_pins`)."""
    _refuse_whole_d_pins(**whole_d_pins)
    pinned = _pinned_config(chunk_config, config_type, "chunk_config")
    _check_chunk_config(pinned, "chunk_config")
    return pinned


def _refuse_whole_d_pins(**pins: int | None) -> None:
    """The ``whole_d`` launch's keyword arguments do not apply to ``d_chunks``: refuse them rather than
    ignore them (``chunk_config`` pins that kernel)."""
    given = [name for name, value in pins.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]}: pins the whole_d kernel, but the kernel is d_chunks (pin that one with "
                         f"chunk_config, or choose kernel='whole_d')")


def _check_chunk_config(cfg: ChunkConfig | LseChunkConfig | None, source: str) -> None:
    """The fields :func:`dsv4cp.kernels._triton_launch.pinned_config` does not check; errors start with
    ``source`` (where the pin came from)."""
    if cfg is None:
        return
    if getattr(cfg, "slots_on_m", 0) not in (0, 1):
        raise ValueError(f"{source}.slots_on_m: must be 0 or 1, got {cfg.slots_on_m}")
    if cfg.programs_per_sm < 0:
        raise ValueError(f"{source}.programs_per_sm: must be >= 0, got {cfg.programs_per_sm}")


def _slots_on_m(explicit: bool | None) -> bool:
    """``explicit``, else the kernel option ``triton_probs_slots_on_m``'s default (``1``): with one head
    block, compute the logits as ``keys @ q^T`` (slots on the matrix unit's M, heads on N) so the head sum
    reduces along each thread's registers and a lane quad instead of across the warps through shared
    memory."""
    return bool(kernel_options.OPTIONS["triton_probs_slots_on_m"].default if explicit is None else explicit)


# ---------------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: must be a [T, H, D] tensor, got shape {tuple(getattr(q, 'shape', ()))}")
    t, _, d = q.shape
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype must be one of bf16, fp16, fp32 for the triton kernels, got {q.dtype}")
    if d % 16 != 0 or d == 0:
        raise ValueError(f"q: head dim D must be a positive multiple of 16 (matrix-unit K), got {d}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D must be at most {MAX_HEAD_DIM} for the triton kernels, got {d}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q: device must be cuda (or cpu under the Triton interpreter), got {q.device}")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[1] != d:
        raise ValueError(f"keys: must be [N, {d}], got shape {tuple(getattr(keys, 'shape', ()))}")
    if keys.dtype != q.dtype:
        raise ValueError(f"keys: dtype must match q ({q.dtype}), got {keys.dtype}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != t:
        raise ValueError(f"idx: must be [{t}, K], got shape {tuple(getattr(idx, 'shape', ()))}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: dtype must be int32 or int64, got {idx.dtype}")
    for name, tensor in (("keys", keys), ("idx", idx)):
        if tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (other strides go to the kernel), else a copy."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def logsumexp_over_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    *,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kernel: str | None = None,
    chunk_config: LseChunkConfig | None = None,
) -> torch.Tensor:
    """``[T, H]`` fp32 log-sum-exp of ``scale * <q[t, h], keys[idx[t, k]]>`` over the valid slots.

    Args:
        q: ``[T, H, D]`` bf16, fp16 or fp32 (D a multiple of 16, at most 512).
        keys: ``[N, D]``, q's dtype.
        idx: ``[T, K]`` int32 / int64 rows of ``keys``; negative entries (``-1``) are empty slots, rows
            ``>= N`` are treated as empty too (no memory fault).
        scale: logit scale.
        block_h, block_k, num_warps, num_stages: pin the ``whole_d`` launch (default: the ladder).
        kernel: ``whole_d`` (``_lse_kernel``) or ``d_chunks`` (``_lse_chunked_kernel``, launched by
            ``chunk_config``); default: the kernel option ``triton_lse_kernel``'s.
        chunk_config: pins the ``d_chunks`` launch (a config or the kernel option
            ``triton_lse_chunk_config``'s integers; default: its ladder).

    Returns: natural-log lse, ``-inf`` where a query has no valid slot (same contract as
    :func:`dsv4cp.ops.attention_probs.logsumexp_over`).
    """
    _check(q, keys, idx)
    q, keys, idx = _unit_last(q), _unit_last(keys), _unit_last(idx)
    t, h, d = q.shape
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0 or h == 0:
        return lse
    if idx.shape[1] == 0:
        return lse.fill_(float("-inf"))
    block_d = triton.next_power_of_2(d)
    if _kernel_choice(kernel, "triton_lse_kernel") == "d_chunks":
        pinned_chunks = _pinned_chunks(chunk_config, LseChunkConfig, block_h=block_h, block_k=block_k,
                                       num_warps=num_warps, num_stages=num_stages)
        _launch_lse_chunked(q, keys, idx, scale, lse, block_d, pinned_chunks)
        return lse
    ladder = _ladder(block_d, h, q.dtype)
    pinned = _pinned(KernelConfig, ladder[0], block_h=block_h, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages)
    kernel = _build("_lse_kernel", q.device)

    def launch(cfg: KernelConfig) -> None:
        n_hb = triton.cdiv(h, cfg.block_h)
        kernel[(t * n_hb,)](
            q, keys, idx, lse,
            float(scale) * LOG2E, h, keys.shape[0], idx.shape[1], n_hb,
            q.stride(0), q.stride(1), keys.stride(0), idx.stride(0),
            D=d, BLOCK_D=block_d, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
            PRECISION=_precision(q), DOT_F32=_dot_f32(q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("probs_lse", _config_key(q), ladder, pinned, launch)
    return lse


@torch.no_grad()
def head_summed_probs_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    log_denominator: torch.Tensor,
    *,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    slots_on_m: bool | None = None,
    kernel: str | None = None,
    chunk_config: ChunkConfig | None = None,
) -> torch.Tensor:
    """``[T, K]`` fp32: ``sum_h exp(scale * <q[t, h], keys[idx[t, k]]> - log_denominator[t, h])``.

    Args:
        q, keys, idx, scale: as in :func:`logsumexp_over_triton`.
        log_denominator: ``[T, H]`` floating (read as fp32), natural log.
        block_h, block_k, num_warps, num_stages: pin a launch configuration (default: the ladder);
            ``H > block_h`` loops over head blocks inside each program.
        slots_on_m: the ``whole_d`` kernel's logits operand order with one head block (default: the
            kernel option ``triton_probs_slots_on_m``; see :func:`_slots_on_m`).
        kernel: ``whole_d`` (``_head_probs_kernel``, launched by ``block_h`` ... ``slots_on_m``) or
            ``d_chunks`` (``_head_probs_chunked_kernel``, launched by ``chunk_config``); default: the
            kernel option ``triton_probs_kernel``'s.
        chunk_config: pins the ``d_chunks`` launch (a config or the kernel option
            ``triton_probs_chunk_config``'s integers; default: its ladder).

    Returns: 0 at empty slots (same contract as :func:`dsv4cp.ops.attention_probs.head_summed_probs`).
    """
    _check(q, keys, idx)
    t, h, d = q.shape
    if not isinstance(log_denominator, torch.Tensor) or log_denominator.shape != (t, h):
        raise ValueError(f"log_denominator: must be [{t}, {h}], got shape "
                         f"{tuple(getattr(log_denominator, 'shape', ()))}")
    if not log_denominator.dtype.is_floating_point:
        raise ValueError(f"log_denominator: dtype must be floating (fp32), got {log_denominator.dtype}")
    if log_denominator.device != q.device:
        raise ValueError(f"log_denominator: must be on q's device {q.device}, got {log_denominator.device}")
    q, keys, idx = _unit_last(q), _unit_last(keys), _unit_last(idx)
    lden = log_denominator.to(torch.float32)
    kt = idx.shape[1]
    out = torch.empty(t, kt, dtype=torch.float32, device=q.device)
    if t == 0 or kt == 0:
        return out
    if h == 0:
        return out.zero_()
    block_d = triton.next_power_of_2(d)
    if _kernel_choice(kernel, "triton_probs_kernel") == "d_chunks":
        pinned = _pinned_chunks(chunk_config, ChunkConfig, block_h=block_h, block_k=block_k, num_warps=num_warps,
                                num_stages=num_stages)
        _launch_chunked(q, keys, idx, scale, lden, out, block_d, pinned)
        return out
    on_m = _slots_on_m(slots_on_m)
    ladder = _ladder(block_d, h, q.dtype, head_loop=h > _block_h(h))
    pinned = _pinned(KernelConfig, ladder[0], block_h=block_h, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages)
    kernel = _build("_head_probs_kernel", q.device)

    def launch(cfg: KernelConfig) -> None:
        kernel[(t,)](
            q, keys, idx, lden, out,
            float(scale) * LOG2E, h, keys.shape[0], kt,
            q.stride(0), q.stride(1), keys.stride(0), idx.stride(0), lden.stride(0), lden.stride(1),
            out.stride(0),
            D=d, BLOCK_D=block_d, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, ONE_HEAD_BLOCK=h <= cfg.block_h,
            SLOTS_ON_M=on_m, PRECISION=_precision(q), DOT_F32=_dot_f32(q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("probs_sum", _config_key(q), ladder, pinned, launch)
    return out


def _launch_chunked(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, lden: torch.Tensor,
                    out: torch.Tensor, block_d: int, pinned: ChunkConfig | None) -> None:
    """Fill ``out`` ``[T, K]`` with the ``d_chunks`` kernel (checked inputs, ``T, K, H > 0``)."""
    t, h, d = q.shape
    kt = idx.shape[1]
    kernel = _build("_head_probs_chunked_kernel", q.device)

    def launch(cfg: ChunkConfig) -> None:
        n_sb, n_hb = triton.cdiv(kt, cfg.block_k), triton.cdiv(h, cfg.block_h)
        items = t * n_sb
        programs = _grid_programs(items, cfg.programs_per_sm, q.device)
        kernel[(programs,)](
            q, keys, idx, lden, out,
            float(scale) * LOG2E, h, keys.shape[0], kt, items, n_sb, n_hb,
            q.stride(0), q.stride(1), keys.stride(0), idx.stride(0), lden.stride(0), lden.stride(1),
            out.stride(0),
            D=d, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_DC=min(cfg.block_d, block_d),
            SLOTS_ON_M=bool(cfg.slots_on_m), PRECISION=_precision(q), DOT_F32=_dot_f32(q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("probs_chunks", _config_key(q), _chunk_ladder(block_d, h, q.dtype), pinned, launch)


def _launch_lse_chunked(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, lse: torch.Tensor,
                        block_d: int, pinned: LseChunkConfig | None) -> None:
    """Fill ``lse`` ``[T, H]`` (contiguous) with the ``d_chunks`` kernel (checked inputs, ``T, H, K > 0``)."""
    t, h, d = q.shape
    kt = idx.shape[1]
    kernel = _build("_lse_chunked_kernel", q.device)

    def launch(cfg: LseChunkConfig) -> None:
        n_sb, n_hb = triton.cdiv(kt, cfg.block_k), triton.cdiv(h, cfg.block_h)
        items = t * n_hb
        programs = _grid_programs(items, cfg.programs_per_sm, q.device)
        kernel[(programs,)](
            q, keys, idx, lse,
            float(scale) * LOG2E, h, keys.shape[0], kt, items, n_sb, n_hb,
            q.stride(0), q.stride(1), keys.stride(0), idx.stride(0),
            D=d, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_DC=min(cfg.block_d, block_d),
            PRECISION=_precision(q), DOT_F32=_dot_f32(q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("lse_chunks", _config_key(q), _lse_chunk_ladder(block_d, h, q.dtype), pinned, launch)
