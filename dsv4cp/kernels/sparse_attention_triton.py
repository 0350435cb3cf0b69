"""Triton kernels for the sparse multi-query attention op with a sink (docs/design.md §4.1, 4.2).

The op (see :func:`dsv4cp.ops.sparse_attention`)::

    l_j    = scale * <q[t, h], kv[idx[t, j]]>        over the valid slots j of query t
    out    = sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h})   (0 when t has no valid slot)
    lse    = log sum_j e^{l_j}                         (natural log, sink EXCLUDED, -inf if none)

A slot is valid when ``0 <= idx < N`` and its position is below ``topk_length[t]`` (when given); one kv
row is both the key and the value of every head (multi-query, K = V); repeated rows are repeated keys.

Kernels, in the style of Triton's tutorials (kernel bodies, then their Python wrappers):

* forward ``_fwd_kernel``: one program per (query token, block of ``BLOCK_H`` heads). The heads sit on
  the matrix-unit M dimension; the query's slots are visited in blocks of ``BLOCK_K``: the gathered kv
  rows ``[BLOCK_K, D]`` are loaded ONCE and used both as K (``s = q @ kv^T``) and as V
  (``acc += p @ kv``). Online softmax in fp32 with ``exp2`` (``scale * log2 e`` folded into the logits),
  the sink folded into the denominator at the end.
* backward: (a) for all queries, then (b) and (c) per chunk of queries:
  (a) ``_bwd_preprocess_kernel``: ``delta = <dO, O>`` per (t, h) and the sink-gradient partials
      ``-p_sink * delta`` (summed over t by ``torch.sum``: deterministic);
  (b) ``_bwd_dq_kernel``: per (query, head block) like the forward: recomputes ``p`` from ``lse``,
      ``ds = p (dO.kv - delta) scale``, accumulates ``dq = ds @ kv`` and writes ``p`` and ``ds``
      (``[chunk, Kt, H]``, q's dtype: exactly the values the matrix unit consumes) to scratch;
  (c) ``_bwd_dkv_kernel``: per (query, D chunk): ``dkv_slots = ds^T q + p^T dO`` over ALL heads
      (K = V: both roles add), then either fp32 ``tl.atomic_add`` into the kv rows (fast default) or, in
      deterministic mode, a store into a per-(query, slot) contribution buffer that
      ``_dkv_reduce_kernel`` sums per kv row in a fixed order given by an inverted index (stable
      ``torch.sort`` of the flattened ``idx``): bitwise reproducible. The D chunks of one query are
      neighbouring programs, so its p / ds scratch is read from HBM once and then from L2.
  "dq in dkv" placement (the default since measured 1.25x faster on an H200, :data:`DQ_IN_DKV_DEFAULT`;
  ``dq_in_dkv=False`` or ``DSV4CP_TRITON_DQ_IN_DKV=0`` selects the one above): (b) only writes p and
  ds, holding no ``[BLOCK_H, D]`` accumulator, so 64 heads fit one
  program on wgmma (one gather of each kv row per query at H = 64, not two), and (c) also accumulates
  its D chunk of ``dq = ds @ kv`` (gathering that chunk of the kv rows; ds is already loaded).
  :class:`BackwardPlan` holds the launches and buffers of one backward (:func:`backward_plan`), each
  part callable alone (``bench/test_bench_sparse_attention.py``'s parts benchmark times them).

How ``D = 512`` fits an sm_90 SM (227 KB of shared memory per block, 64K 32-bit registers). The head dim
is one tile (``BLOCK_D = next_pow2(D)``: one ``tl.dot`` reduces over all of it); a ``[64, 512]`` fp32
accumulator takes 128 registers per thread over ``num_warps = 8`` (two warpgroups, each owning 256 of
the 512 columns; 16 warps would cap registers at 128 per thread and do not compile at 128 heads). bf16
configurations at D = 512, compiled for sm_90a with Triton 3.6 (the H200 machine's) without a GPU
(``triton.compile`` for target ``cuda 90`` with the launch's 16-byte divisibility of pointers and
strides, then ``cuobjdump -res-usage`` / ``-sass``: registers, stack bytes from spills, shared memory;
``python -m bench.sparse_attention_resources`` prints them for every sweep candidate):

* forward ``BLOCK_H=64, BLOCK_K=64, 8 warps, 2 stages`` (the ladder's first), duplicated logits (the
  layout before the variants below): 192 KB (q 64 KB + 2 x 64 KB of gathered rows), wgmma for both
  products, 255 registers, no spill. Triton lays the ``[64, BLOCK_K]``
  logits out over warps [8, 1], so both warpgroups compute the same q @ kv^T (the price of splitting the
  accumulator's columns; computing ``kv @ q^T`` instead keeps the [8, 1] layout). ``BLOCK_K=32,
  3 stages``: 128 KB, 40 B of stack; ``BLOCK_K=128``: over the shared memory. Measured on an H200
  (``bench/sweep_sparse_attention_configs.py``, flash shapes): 5.62 ms = 244 TFLOP/s (``BLOCK_K=32``:
  162 TFLOP/s).
* forward with split logits (``LOGITS="split"``, kernel option ``triton_fwd_logits``, the default with
  the indices a step ahead, below; Triton 3.6):
  the logits get warps [4, 2], each warpgroup computing ``[64, BLOCK_K / 2]``: 36 wgmma instructions in
  the loop's SASS against 68, matrix work per warpgroup and step 2 units instead of 3 (logits 1 instead
  of 2, values 1), for two cross-warpgroup row reductions and p's trip through shared memory. Same
  ladder: ``64, 64, 8, 2``: 208 KB, 246 registers, no spill (H = 128: 255 and 40 B of stack);
  ``64, 32, 8, 3``: 136 KB, 233 registers; ``64, 64, 8, 1``: 144 KB, 255 registers, no spill;
  ``64, 64, 8, 3``: 208 KB, 252 registers, no spill (3 stages: the pipeliner loads the indices a step
  ahead itself). With Triton 3.9 the gap widens: the duplicated layout spills 184 B, the split takes
  236 registers and none. Measured on an H200 (flash, T = 16K, ``bench/test_bench_sparse_attention.py``,
  results/2026-12-02-h200-indexer-attention-variants/kernels/sparse_attn.txt): duplicated 5.48 ms = 251 TFLOP/s, split
  5.06 ms = 271, indices ahead alone 5.56 ms = 247, split with indices ahead 4.42 ms = 311 (the default
  since). Split with indices ahead at ``64, 32, 8, 3`` / ``64, 32, 8, 4``: 228 registers, no spill,
  168 / 200 KB: the rows of 2 / 3 steps ahead in flight (the index load off the path lets the pipeliner
  give the row copies ``num_stages`` buffers).
* split forward with a lazy rescale (``LAZY_RESCALE``, kernel option ``triton_fwd_lazy_rescale``, off):
  the accumulator's multiply (128 per thread and step) only on a step that moves the max, for a program-
  wide max and a branch: with the indices ahead ``64, 64, 8, 2`` spills 176 B (255 registers), ``64, 32,
  8, 4`` 16 B. Expected to lose at the default tile unless the spills are cheap.
* forward with the slots on M (``LOGITS="slots_on_m"``): ``kv @ q^T`` on warps [8, 1] over 128 slots,
  wgmma N = 64 (the split's N = 32 reads the shared-memory A operand twice as often per product), 40
  wgmma instructions. Two stages of 128 rows are over the shared memory (336 KB), so one stage: the
  rows are staged through registers, ``64, 128, 8, 1``: 208 KB, 255 registers and 272 B of stack
  (H = 128: 336 B). Expected to lose to the split unless the spills are cheap.
* dq kernel ``BLOCK_H=32, BLOCK_K=64, 8 warps, 2 stages`` (default): 132 KB, mma.sync, 225 registers, no
  spill (``BLOCK_K=32``: 98 KB, 185 registers). With 64 heads (wgmma) it spills 712 B.
  Without its dq accumulator ("dq in dkv"): ``BLOCK_H=64, BLOCK_K=32, 8 warps, 2 stages``: wgmma,
  196 KB, 140 registers, no spill (``BLOCK_K=64``: 1 stage, 192 KB, 162 registers).
* dkv kernel ``BLOCK_K=64`` slots x 256 columns (128 when H > 64), 8 warps, 2 stages: wgmma, 160 KB,
  183 (122) registers, no spill; atomics compile to vectorised ``RED.ADD.F32`` (4 floats). With dq: the
  same columns, 224 KB and 252 registers at H = 64, 192 KB and 224 registers at H = 128, no spill.
  Its two chained products put the first (``ds^T q``) on warps [8, 1]: both warpgroups compute it whole
  (per warpgroup and step 2 units of matrix work where 1.5 would do, with dq) and its ``[64, 256]`` fp32
  result (64 KB) crosses to the second product's layout through shared memory.
* dkv kernel as one product (``ONE_PRODUCT``, kernel option ``triton_dkv_one_product``; p and ds side by
  side in one ``[chunk, Kt, 2, H]`` scratch): ``[ds | p] [64, 2H] @ [q ; dO] [2H, 256]`` on warps [4, 2],
  dq's ``ds^T`` read from the same shared-memory tile (a split, no reload). With dq at H = 64
  ``64, 256, 8, 2``: 208 KB, 242 registers, no spill, 12 wgmma instructions against 16;
  ``64, 256, 8, 1``: 128 KB, 254 registers; ``64, 256, 16, 1``: 128 KB, 128 registers; at H = 128
  ``64, 128, 8, 2``: 160 KB, 227 registers. Expected (a model): the kernel's matrix work per warpgroup
  x 0.75 and no 64 KB layout conversion per step.
* indices one step ahead (``INDEX_AHEAD``, kernel options ``triton_fwd_index_ahead`` /
  ``triton_bwd_index_ahead``). Triton 3.6's two-stage pipeline of a gather issues, at the end of a step,
  a blocking load of the next step's indices and then the next step's row copies, which the next step
  waits for at once: the index load's latency sits in every step. Loaded a step ahead (registers, no
  shared memory), the copies start without it. Forward ``64, 64, 8, 2``: 255 registers and 8 B of stack
  (H = 128: 80 B), split logits the same at 208 KB (72 B); scores ``64, 64, 8, 1``: 186 registers
  against 160; dkv one product ``64, 256, 8, 2``: 230 registers, no spill (two products: 104 B of
  stack).

A single fused backward (dq and dkv in one loop) needs two [*, 512] fp32 accumulators and a second copy
of q and dO in shared memory (~300 KB): it does not fit, hence (b) + (c) at the price of writing p and
ds once (2 x T x Kt x H x 2 bytes, in chunks of at most ``BWD_SCRATCH_BYTES``).
Each launch tries a short ladder of configurations and falls back to the next on ``OutOfResources``
(cached per shape class); the wrappers' keyword arguments, else the kernel options ``triton_fwd_config`` /
``triton_bwd_config`` (``"block_h,block_k,num_warps,num_stages"``) and ``triton_dkv_config``
(``"block_k,block_d,num_warps,num_stages"``) pin one.

Kernels are built lazily per execution mode: CUDA tensors use compiled ``triton.jit`` kernels, CPU
tensors use Triton's interpreter (slow: tiny sizes only), which needs ``TRITON_INTERPRET=1`` in the
environment before triton is first imported (triton builds its language library at import). The
package ``dsv4cp.kernels`` registers the backends without importing this module (nor triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels import is_deterministic
from dsv4cp.kernels._triton_gather import gather_loaded_rows, gather_rows
from dsv4cp.kernels._triton_launch import Kernels, OutOfResources  # noqa: F401  (OutOfResources: re-exported)
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels._triton_launch import pinned as _pinned
from dsv4cp.kernels.contracts import check_sparse_attention_inputs as _check_inputs

__all__ = [
    "BWD_SCRATCH_BYTES",
    "DQ_IN_DKV_ENV",
    "MAX_HEAD_DIM",
    "BackwardPlan",
    "DkvConfig",
    "KernelConfig",
    "backward_plan",
    "sparse_attention_bwd",
    "sparse_attention_fwd",
]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 512
"""Largest head dim the kernels accept (one ``[BLOCK_H, D]`` fp32 accumulator tile per program)."""

BWD_SCRATCH_BYTES = 2 * 2**30
"""Budget of the backward's scratch per query chunk: p and ds ``[chunk, Kt, H]`` (q's dtype) and, in
deterministic mode, the fp32 kv-gradient contributions ``[chunk, Kt, D]``."""
BWD_SCRATCH_MIN_CHUNKS = 5
"""The default backward splits its queries into at least this many chunks (of at least
:data:`BWD_SCRATCH_MIN_CHUNK_ROWS` rows), so the scratch is at most a fifth of the whole p / ds and
shrinks with the rank's rows under CP instead of sitting at the fixed byte cap on every rank (a fixed
2 GiB kept CP = 2's peak memory at 0.556x of CP = 1's); a few more launches of large kernels."""
BWD_SCRATCH_MIN_CHUNK_ROWS = 1024
"""Smallest query chunk the :data:`BWD_SCRATCH_MIN_CHUNKS` rule makes (small inputs stay one launch)."""

DQ_IN_DKV_ENV = kernel_options.OPTIONS["triton_dq_in_dkv"].env
"""The variable of the kernel option ``triton_dq_in_dkv``, the backward's dq placement (``1``: dq
accumulated by the dkv kernel); the ``dq_in_dkv`` keyword of :func:`sparse_attention_bwd` wins over it."""
DQ_IN_DKV_DEFAULT = kernel_options.OPTIONS["triton_dq_in_dkv"].default
"""The placement when neither the keyword nor the environment says: in the dkv kernel, the faster on an
H200 (``bench/sweep_sparse_attention_configs.py``, flash shapes; the figures: docs/kernels.md)."""

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FWD_LOGITS = kernel_options.OPTIONS["triton_fwd_logits"].choices


@dataclass(frozen=True)
class KernelConfig:
    """Forward / dq-kernel launch: heads per program (matrix-unit M), slots per step, warps, stages."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DkvConfig:
    """dkv-kernel launch: slots per step (matrix-unit M), head-dim columns per program, warps, stages."""

    block_k: int
    block_d: int
    num_warps: int
    num_stages: int


# ---------------------------------------------------------------------------------------------------
# Kernel bodies. Plain functions; ``_build`` turns each into a ``triton.jit`` kernel (CUDA) or an
# interpreted one (CPU) on first use.
# ---------------------------------------------------------------------------------------------------


def _fwd_kernel(
    Q, KV, IDX, SINK, TOPK, OUT, LSE,  # pointers
    qk_scale2,  # fp32: scale * log2(e)
    H, N, KT, N_HB,  # heads, kv rows, slots per query, head blocks per query
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_TOPK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, LOGITS: tl.constexpr,
    INDEX_AHEAD: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):
    """Forward of one (query token t, head block).

    Q ``[T, H, D]``, KV ``[N, D]`` (same float dtype), IDX ``[T, KT]`` int32/int64, SINK ``[H]`` fp32,
    TOPK ``[T]`` int32 (read iff HAS_TOPK), OUT ``[T, H, D]`` (Q's dtype), LSE ``[T, H]`` fp32.

    LOGITS, how the ``[BLOCK_H, BLOCK_K]`` logits are laid out. Triton lays out a product whose result
    feeds another product over all warps along M (``[num_warps, 1]``):

    * ``"duplicated"``: ``q @ kv^T``, heads on M: at 64 heads and 8 warps both warpgroups compute the same
      logits;
    * ``"split"``: the same product, but p and the rescaled accumulator reach the value product through a
      branch that is always taken (``k0 < kt_len`` inside the loop). The branch's results are not in the
      logits' forward slice, so the logits get the ordinary ``[4, 2]`` layout: each warpgroup computes
      half of the slots, the softmax's row max and sum cross the warpgroups and p goes to the value
      product through shared memory;
    * ``"slots_on_m"``: ``kv @ q^T`` (``[BLOCK_K, BLOCK_H]``), slots on M: with ``BLOCK_K = 128`` each
      warpgroup computes its 64 slots for all 64 heads (wgmma N = 64 where the split has N = 32), the
      softmax runs down the columns and ``p^T`` is transposed into the value product.

    INDEX_AHEAD: each step loads the next step's row indices and gathers the rows of indices loaded one
    step earlier. Triton's two-stage pipeline issues the next step's gather at the end of a step, right
    after loading (and waiting for) the indices it needs; loaded ahead, they are there already.

    LAZY_RESCALE (split logits only): the running max moves, and the ``[BLOCK_H, D]`` accumulator is
    rescaled, only on a step where some head's max rises by more than 8 (log2 units); otherwise p is
    taken against the kept max (so p <= 2^8) and the step skips the accumulator's multiply. The same
    max enters the sum and the accumulator, so the result is exact either way.
    """
    pid = tl.program_id(0)
    t = (pid // N_HB).to(tl.int64)
    hb = pid % N_HB
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 products there
        q = q.to(tl.float32)
    kt_len = KT
    if HAS_TOPK:
        kt_len = tl.minimum(tl.maximum(tl.load(TOPK + t).to(tl.int32), 0), KT)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if INDEX_AHEAD:
        rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len,
                            other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        if INDEX_AHEAD:
            rows_here = rows_next
            rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
            rows, valid, kv = gather_loaded_rows(KV, rows_here, N, stride_kvn, d, dmask, D, BLOCK_D, DOT_F32)
        else:
            rows, valid, kv = gather_rows(KV, IDX + t * stride_it, slots, slots < kt_len, N, stride_kvn, d, dmask,
                                          D, BLOCK_D, DOT_F32)  # K and V
        if LOGITS == "slots_on_m":
            s_t = tl.dot(kv, tl.trans(q), input_precision=PRECISION) * qk_scale2  # [BLOCK_K, BLOCK_H]
            s_t = tl.where(valid[:, None], s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: avoid -inf - -inf
            alpha = tl.math.exp2(m_i - m_use)
            p_t = tl.math.exp2(s_t - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p_t, 0)
            acc = tl.dot(tl.trans(p_t.to(kv.dtype)), kv, acc * alpha[:, None], input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if LAZY_RESCALE:  # one decision for the whole program: a branch, not a select
                floor = tl.where(m_i == float("-inf"), -3.0e38, m_i)  # no key yet: any finite max rises
                rescale = tl.max(m_new - floor, 0) > 8.0
                m_new = tl.where(rescale, m_new, m_i)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: avoid -inf - -inf
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if LOGITS == "split":
                if k0 < kt_len:  # always: hides p's and alpha's origin from the chained-product layout rule
                    p_v = p.to(kv.dtype)
                    if LAZY_RESCALE:
                        if rescale:
                            acc_v = acc * alpha[:, None]
                        else:
                            acc_v = acc
                    else:
                        acc_v = acc * alpha[:, None]
                else:
                    p_v = tl.zeros([BLOCK_H, BLOCK_K], dtype=kv.dtype)
                    acc_v = acc
                acc = tl.dot(p_v, kv, acc_v, input_precision=PRECISION)
            else:
                acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # Sink: denominator 2^m * l + 2^(sink*log2e); a row with no key has acc = 0 -> out = 0.
    sink2 = tl.load(SINK + heads, mask=hmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i + tl.math.exp2(sink2 - m_use)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = acc / denom[:, None]
    has_key = l_i > 0.0
    lse = tl.where(has_key, (m_use + tl.math.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(OUT + t * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])
    tl.store(LSE + t * H + heads, lse, mask=hmask)


def _bwd_preprocess_kernel(
    OUT, DOUT, LSE, SINK, DELTA, DSINK_PART,
    H, stride_ot, stride_oh, stride_dt, stride_dh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Per (t, head block): DELTA ``[T, H]`` fp32 = <dO, O>; DSINK_PART ``[T, H]`` fp32 = -p_sink * delta
    with p_sink = e^sink / (e^lse + e^sink). OUT, DOUT ``[T, H, D]``, LSE ``[T, H]`` fp32, SINK ``[H]``."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d[None, :] < D)
    o = tl.load(OUT + t * stride_ot + heads[:, None] * stride_oh + d[None, :], mask=mask, other=0.0)
    do = tl.load(DOUT + t * stride_dt + heads[:, None] * stride_dh + d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + t * H + heads, mask=hmask, other=float("-inf"))
    sink = tl.load(SINK + heads, mask=hmask, other=float("-inf")).to(tl.float32)
    # p_sink = 1 / (1 + e^(lse - sink)); a row with no key (lse = -inf) has p_sink = 1 (and delta = 0).
    no_key = lse == float("-inf")
    diff = tl.where(no_key, 0.0, lse - tl.where(no_key, 0.0, sink))  # sink = -inf -> +inf -> p_sink = 0
    p_sink = tl.where(no_key, 1.0, 1.0 / (1.0 + tl.math.exp2(diff * 1.4426950408889634)))
    tl.store(DELTA + t * H + heads, delta, mask=hmask)
    tl.store(DSINK_PART + t * H + heads, -p_sink * delta, mask=hmask)


def _bwd_dq_kernel(
    Q, KV, IDX, TOPK, DOUT, LSE, DELTA, SINK, DQ, PBUF, DSBUF,
    scale, qk_scale2,
    H, N, KT, N_HB, T0, SCRATCH_ROW,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh, stride_dqt, stride_dqh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_TOPK: tl.constexpr, ACC_DQ: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    INDEX_AHEAD: tl.constexpr,
):
    """dq of one (query token t = T0 + pid // N_HB, head block), and its p / ds scratch.

    Q, DOUT ``[T, H, D]``, KV ``[N, D]``, IDX ``[T, KT]``, TOPK ``[T]`` (iff HAS_TOPK), LSE, DELTA
    ``[T, H]`` fp32, SINK ``[H]`` fp32. Writes, for the slots below the query's length, PBUF / DSBUF
    (Q's dtype; ``SCRATCH_ROW`` elements from one (query, slot) row to the next: ``[chunk, KT, H]``
    each, or the two halves of one ``[chunk, KT, 2, H]``) at ``(t - T0, slot, head)``:
    p = e^{l - logaddexp(lse, sink)} and ds = p (<dO, kv> - delta) scale (0 on empty slots); with
    ACC_DQ also DQ ``[T, H, D]`` (Q's dtype). Without ACC_DQ (dq left to ``_bwd_dkv_kernel``) no
    ``[BLOCK_H, D]`` accumulator lives in registers, so 64 heads fit one program on wgmma. INDEX_AHEAD:
    as in ``_fwd_kernel``.
    """
    pid = tl.program_id(0)
    t_local = (pid // N_HB).to(tl.int64)
    t = T0 + t_local
    hb = pid % N_HB
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qd_mask = hmask[:, None] & dmask[None, :]

    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DOUT + t * stride_dt + heads[:, None] * stride_dh + d[None, :], mask=qd_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE + t * H + heads, mask=hmask, other=float("-inf")) * 1.4426950408889634
    delta = tl.load(DELTA + t * H + heads, mask=hmask, other=0.0)
    sink2 = tl.load(SINK + heads, mask=hmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    # log2 of the full denominator (keys + sink); heads with no key (or padding) get +inf -> p = 0.
    mx = tl.maximum(lse2, sink2)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.math.exp2(lse2 - mx_use) + tl.math.exp2(sink2 - mx_use)
    has_key = hmask & (lse2 > float("-inf"))
    lt2 = tl.where(has_key, mx_use + tl.math.log2(tl.where(has_key, total, 1.0)), float("inf"))

    kt_len = KT
    if HAS_TOPK:
        kt_len = tl.minimum(tl.maximum(tl.load(TOPK + t).to(tl.int32), 0), KT)

    if ACC_DQ:
        dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if INDEX_AHEAD:
        rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len,
                            other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_len = slots < kt_len
        if INDEX_AHEAD:
            rows_here = rows_next
            rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
            rows, valid, kv = gather_loaded_rows(KV, rows_here, N, stride_kvn, d, dmask, D, BLOCK_D, DOT_F32)
        else:
            rows, valid, kv = gather_rows(KV, IDX + t * stride_it, slots, in_len, N, stride_kvn, d, dmask,
                                          D, BLOCK_D, DOT_F32)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale2
        p = tl.math.exp2(s - lt2[:, None])
        p = tl.where(valid[None, :], p, 0.0)  # [BLOCK_H, BLOCK_K] probabilities (sink in denominator)
        dp = tl.dot(do, tl.trans(kv), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None]) * scale).to(kv.dtype)  # d loss / d (q.k), scale folded in
        if ACC_DQ:
            dq = tl.dot(ds, kv, dq, input_precision=PRECISION)
        scratch = (t_local * KT + slots)[None, :] * SCRATCH_ROW + heads[:, None]
        smask = hmask[:, None] & in_len[None, :]
        tl.store(PBUF + scratch, p.to(PBUF.dtype.element_ty), mask=smask)
        tl.store(DSBUF + scratch, ds.to(DSBUF.dtype.element_ty), mask=smask)
    if ACC_DQ:
        tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=qd_mask)


def _bwd_dkv_kernel(
    Q, DOUT, KV, IDX, TOPK, PBUF, DSBUF, DKV, DQ,
    H, N, KT, T0, SCRATCH_ROW,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh, stride_dqt, stride_dqh,
    D: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_TOPK: tl.constexpr, DETERMINISTIC: tl.constexpr, ACC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, ONE_PRODUCT: tl.constexpr, INDEX_AHEAD: tl.constexpr,
):
    """kv-row gradients of one query token t = T0 + pid // cdiv(D, BLOCK_DC), head-dim columns
    ``[(pid % cdiv(D, BLOCK_DC)) * BLOCK_DC, +BLOCK_DC)``: ``g[slot] = ds[:, slot]^T q + p[:, slot]^T dO``
    summed over all H heads (BLOCK_HK >= H, padded heads masked); with ACC_DQ also the same columns of
    ``dq = ds @ kv`` (the ``_bwd_dq_kernel`` launched without ACC_DQ left them), gathering those columns
    of the query's kv rows.

    Q, DOUT ``[T, H, D]``, KV ``[N, D]`` (read iff ACC_DQ); PBUF, DSBUF from ``_bwd_dq_kernel``
    (``SCRATCH_ROW`` elements per (query, slot) row). DKV is an fp32 ``[N, D]`` buffer receiving
    atomic adds, or with DETERMINISTIC an fp32 ``[chunk, KT, D]`` contribution buffer written at
    ``(t - T0, slot)`` for the valid slots. DQ ``[T, H, D]`` (Q's dtype) is written iff ACC_DQ.

    ONE_PRODUCT (PBUF = DSBUF + H: the p half of each row right after its ds half): ``g`` is one product
    ``[ds | p] @ [q ; dO]`` over K = 2 BLOCK_HK. As two products (the accumulator of the second being the
    result of the first) Triton lays the first out over warps ``[num_warps, 1]``: at 64 slots and 8 warps
    both warpgroups compute the same ``ds^T q``, and its ``[BLOCK_K, BLOCK_DC]`` fp32 result crosses to
    the second product's layout through shared memory on every step. One product has neither.
    INDEX_AHEAD: the next step's row indices are loaded one step ahead (as in ``_fwd_kernel``).
    """
    # The column blocks of one query are neighbouring programs: they run together, so the query's p / ds
    # scratch (read by each of them) comes from L2 after the first.
    n_db: tl.constexpr = (D + BLOCK_DC - 1) // BLOCK_DC
    pid = tl.program_id(0)
    t_local = (pid // n_db).to(tl.int64)
    t = T0 + t_local
    d = (pid % n_db) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dmask = d < D
    heads = tl.arange(0, BLOCK_HK)
    hmask = heads < H
    qd_mask = hmask[:, None] & dmask[None, :]
    if ONE_PRODUCT:  # [q ; dO] [2 BLOCK_HK, BLOCK_DC]: rows c < BLOCK_HK from q, the others from dO
        cols = tl.arange(0, 2 * BLOCK_HK)
        c_head = cols % BLOCK_HK
        c_from_p = cols >= BLOCK_HK  # the rows of dO meet p's columns of the scratch
        c_mask = c_head < H
        qdo_rows = tl.where(c_from_p[:, None], DOUT + t * stride_dt + c_head[:, None] * stride_dh,
                            Q + t * stride_qt + c_head[:, None] * stride_qh)
        qdo = tl.load(qdo_rows + d[None, :], mask=c_mask[:, None] & dmask[None, :], other=0.0)
        pds_cols = tl.where(c_from_p, H, 0) + c_head  # offset in a scratch row: ds then p
        if DOT_F32:
            qdo = qdo.to(tl.float32)
    else:
        q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
        do = tl.load(DOUT + t * stride_dt + heads[:, None] * stride_dh + d[None, :], mask=qd_mask, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)

    kt_len = KT
    if HAS_TOPK:
        kt_len = tl.minimum(tl.maximum(tl.load(TOPK + t).to(tl.int32), 0), KT)
    if ACC_DQ:
        dq = tl.zeros([BLOCK_HK, BLOCK_DC], dtype=tl.float32)
    if INDEX_AHEAD:
        rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len,
                            other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_len = slots < kt_len
        if INDEX_AHEAD:
            rows = rows_next.to(tl.int64)
            rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
        else:
            rows = tl.load(IDX + t * stride_it + slots, mask=in_len, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < N)
        srow = (t_local * KT + slots)[:, None] * SCRATCH_ROW
        scratch = srow + heads[None, :]
        smask = in_len[:, None] & hmask[None, :]
        if ONE_PRODUCT:
            pds = tl.load(DSBUF + srow + pds_cols[None, :], mask=in_len[:, None] & c_mask[None, :], other=0.0)
            if DOT_F32:
                pds = pds.to(tl.float32)
            g = tl.dot(pds, qdo, input_precision=PRECISION)  # [BLOCK_K, BLOCK_DC] fp32
            if ACC_DQ:  # ds^T for dq: the first half of the same tile (read from shared memory, no reload)
                ds_t, _ = tl.split(tl.permute(tl.reshape(pds, [BLOCK_K, 2, BLOCK_HK]), (0, 2, 1)))
        else:
            ds_t = tl.load(DSBUF + scratch, mask=smask, other=0.0)  # [BLOCK_K, BLOCK_HK]
            p_t = tl.load(PBUF + scratch, mask=smask, other=0.0)
            if DOT_F32:
                ds_t = ds_t.to(tl.float32)
                p_t = p_t.to(tl.float32)
            g = tl.dot(ds_t, q, input_precision=PRECISION)
            g = tl.dot(p_t, do, g, input_precision=PRECISION)  # [BLOCK_K, BLOCK_DC] fp32
        gmask = valid[:, None] & dmask[None, :]
        if ACC_DQ:  # ds is 0 on empty slots, so their (masked, zero) kv columns add nothing
            kv = tl.load(KV + rows[:, None] * stride_kvn + d[None, :], mask=gmask, other=0.0)
            if DOT_F32:
                kv = kv.to(tl.float32)
            dq = tl.dot(tl.trans(ds_t), kv, dq, input_precision=PRECISION)
        if DETERMINISTIC:
            tl.store(DKV + (t_local * KT + slots)[:, None] * D + d[None, :], g, mask=gmask)
        else:
            tl.atomic_add(DKV + rows[:, None] * D + d[None, :], g, mask=gmask, sem="relaxed")
    if ACC_DQ:
        tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=qd_mask)


def _dkv_reduce_kernel(
    CONTRIB, PERM, SEG, DKV,
    D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Deterministic kv-gradient reduction: program (r, d block) adds to DKV[r] (fp32 ``[N, D]``) the
    contribution rows ``CONTRIB[PERM[i]]`` (fp32 ``[chunk * KT, D]``) for i in ``[SEG[r], SEG[r+1])``, in
    that order, BLOCK_C at a time. PERM int64 is the stable sort of the flattened slot rows, SEG
    ``[N + 1]`` int64 the start of each row's run in it."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    start = tl.load(SEG + r)
    end = tl.load(SEG + r + 1)
    if end > start:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i0 in range(start, end, BLOCK_C):
            offs = i0 + tl.arange(0, BLOCK_C)
            cmask = offs < end
            src = tl.load(PERM + offs, mask=cmask, other=0)
            vals = tl.load(CONTRIB + src[:, None] * D + d[None, :], mask=cmask[:, None] & dmask[None, :],
                           other=0.0)
            acc += tl.sum(vals, 0)
        old = tl.load(DKV + r * D + d, mask=dmask, other=0.0)
        tl.store(DKV + r * D + d, old + acc, mask=dmask)


_KERNELS = Kernels("sparse_attention triton", _fwd_kernel, _bwd_preprocess_kernel, _bwd_dq_kernel,
                   _bwd_dkv_kernel, _dkv_reduce_kernel, op="sparse_attention")
_BODIES, _BUILT, _CHOSEN = _KERNELS.bodies, _KERNELS.built, _KERNELS.chosen
_build, _launch = _KERNELS.build, _KERNELS.launch


# ---------------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------------


def _block_h(heads: int) -> int:
    return max(16, min(64, triton.next_power_of_2(heads)))


def _fwd_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[KernelConfig]:
    bh = _block_h(heads)
    if block_d >= 256:
        ladder = [(bh, 64, 8, 2), (bh, 32, 8, 3), (bh, 64, 8, 1), (bh, 32, 8, 1)]
        if dtype == torch.float32:
            ladder = [(bh, 32, 8, 2), (bh, 32, 8, 1), (bh, 16, 8, 1)]
        ladder.append((min(bh, 32), 16, 4, 1))
    else:
        ladder = [(bh, 64, 4, 2), (bh, 32, 4, 2), (bh, 32, 4, 1)]
    return [KernelConfig(*c) for c in ladder]


def _fwd_slots_on_m_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[KernelConfig]:
    """The forward with slots on M: 128 slots per step at D = 512 (M = 128 over 8 warps gives each
    warpgroup its own 64 slots; at 64 they would both compute all of them), in one stage (two are over
    the shared memory), then the ordinary ladder."""
    ladder = _fwd_ladder(block_d, heads, dtype)
    if block_d >= 256 and dtype != torch.float32:
        ladder.insert(0, KernelConfig(_block_h(heads), 128, 8, 1))
    return ladder


def _dq_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[KernelConfig]:
    bh = _block_h(heads)
    if block_d >= 256:
        # 32 heads per program (mma.sync): the [32, 512] fp32 dq tile leaves room for everything else;
        # 64 heads (wgmma) compiles to ~200 KB of shared memory but spills ~200 registers per iteration.
        bh32 = min(bh, 32)
        ladder = [(bh32, 64, 8, 2), (bh32, 32, 8, 2), (bh, 32, 8, 2), (bh32, 32, 8, 1), (16, 16, 4, 1)]
        if dtype == torch.float32:
            ladder = [(bh32, 16, 8, 1), (16, 16, 8, 1), (16, 16, 4, 1)]
    else:
        ladder = [(bh, 32, 4, 2), (bh, 32, 4, 1), (bh, 16, 4, 1)]
    return [KernelConfig(*c) for c in ladder]


def _scores_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[KernelConfig]:
    """The dq kernel without its dq accumulator (dq in the dkv kernel): only the [BLOCK_H, BLOCK_K]
    logits live in registers, so 64 heads go on wgmma; q and dO [64, 512] take 128 KB of shared memory,
    leaving room for two stages of 32 gathered rows (or one of 64)."""
    bh = _block_h(heads)
    if block_d >= 256:
        # (bh, 64, 8, 1) first: 20.0 ms vs 21.8 ms for (bh, 32, 8, 2) at the flash shapes on an H200
        ladder = [(bh, 64, 8, 1), (bh, 32, 8, 2), (bh, 32, 8, 1), (min(bh, 32), 32, 8, 2), (16, 16, 4, 1)]
        if dtype == torch.float32:
            ladder = [(min(bh, 32), 16, 8, 1), (16, 16, 8, 1), (16, 16, 4, 1)]
    else:
        ladder = [(bh, 32, 4, 2), (bh, 32, 4, 1), (bh, 16, 4, 1)]
    return [KernelConfig(*c) for c in ladder]


def _dkv_dq_ladder(block_d: int, heads: int, dtype: torch.dtype, one_product: bool) -> list[DkvConfig]:
    """The dkv kernel also accumulating dq: a second [H, block_d] fp32 tile and a [block_k, block_d]
    gather of kv columns; at D = 512 the same columns per program as :func:`_dkv_ladder` still fit.
    The one product at H <= 64 starts at 128 columns and 4 warps (112 KB: two programs per SM, one's
    gathers under the other's products): 16.37 ms against 17.93 ms at ``64, 256, 8, 2`` (flash, T = 16K,
    results/2026-12-02-h200-layer-defaults/kernels/sparse_bwd.txt)."""
    if block_d >= 256:
        if triton.next_power_of_2(heads) >= 128:
            ladder = [(64, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 1), (16, 32, 4, 1)]
        elif one_product:
            ladder = [(64, 128, 4, 2), (64, 256, 8, 2), (64, 128, 8, 2), (32, 64, 4, 1), (16, 32, 4, 1)]
        else:
            ladder = [(64, 256, 8, 2), (64, 128, 8, 2), (32, 64, 4, 1), (16, 32, 4, 1)]
        if dtype == torch.float32:
            ladder = [(32, 64, 4, 2), (16, 64, 4, 1), (16, 32, 4, 1)]
    else:
        wide = min(block_d, 128)
        ladder = [(64, wide, 4, 2), (32, wide, 4, 1), (16, min(wide, 32), 4, 1)]
    return [DkvConfig(*c) for c in ladder]


def _option_flag(option: str, explicit: bool | None) -> bool:
    """A variant switch: the keyword argument ``explicit``, else the flag kernel option ``option``."""
    if explicit is not None:
        return bool(explicit)
    return bool(kernel_options.get(option))


def _dq_in_dkv(explicit: bool | None) -> bool:
    """Where the backward accumulates dq: the keyword argument, else the kernel option ``triton_dq_in_dkv``
    (``0``: in the dq kernel; ``1``: in the dkv kernel; default :data:`DQ_IN_DKV_DEFAULT`)."""
    return _option_flag("triton_dq_in_dkv", explicit)


def _dkv_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[DkvConfig]:
    wide = min(block_d, 256)
    if block_d >= 256:
        if triton.next_power_of_2(heads) >= 128:  # q and dO column blocks are [128, block_d]
            ladder = [(64, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 1)]
        else:
            ladder = [(64, wide, 8, 2), (64, 128, 4, 2), (64, 128, 4, 1), (32, 64, 4, 1)]
        if dtype == torch.float32:
            ladder = [(64, 128, 4, 2), (32, 64, 4, 1), (16, 64, 4, 1)]
    else:
        ladder = [(64, wide, 4, 2), (32, wide, 4, 1), (16, min(wide, 64), 4, 1)]
    return [DkvConfig(*c) for c in ladder]


# ---------------------------------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------------------------------


def _check(q, kv, idx, sink, topk_length) -> None:
    """The op's shape / dtype / device checks (``_check_inputs``) and what the kernels need on top of
    them: a bf16 / fp16 / fp32 q with D a multiple of 16 up to MAX_HEAD_DIM (checked first), a floating
    sink, int32 / int64 topk_length, a CUDA (or, interpreted, CPU) device."""
    if q.dim() == 3:
        d = q.shape[2]
        if q.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"q: dtype must be one of bf16, fp16, fp32 for the triton backend, got {q.dtype}")
        if d % 16 != 0 or d == 0:
            raise ValueError(f"q: head dim D must be a positive multiple of 16 (matrix-unit K), got {d}")
        if d > MAX_HEAD_DIM:
            raise ValueError(f"q: head dim D must be at most {MAX_HEAD_DIM} for the triton backend, got {d}")
    _check_inputs(q, kv, idx, sink, topk_length)
    if not sink.dtype.is_floating_point:
        raise ValueError(f"sink: dtype must be floating (fp32), got {sink.dtype}")
    if topk_length is not None and topk_length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_length: dtype must be int32 (or int64), got {topk_length.dtype}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q: device must be cuda (or cpu under the Triton interpreter), got {q.device}")


def _precision(q: torch.Tensor) -> str:
    # fp32 products stay fp32 ("ieee", not tf32): fp32 inputs (tests), and bf16 upcast by the interpreter.
    # bf16/fp16 on the GPU ignore the setting; "tf32" is Triton's default.
    return "ieee" if q.dtype == torch.float32 or _dot_f32(q) else "tf32"


def _dot_f32(q: torch.Tensor) -> bool:
    # Triton's interpreter (3.9) feeds bf16 tiles to numpy as raw uint16 in tl.dot: upcast there.
    return _interpreted(q.device) and q.dtype == torch.bfloat16


def _config_key(q: torch.Tensor) -> tuple:
    return (q.device.type, q.shape[2], q.dtype, _block_h(q.shape[1]), triton.next_power_of_2(q.shape[1]))


# ---------------------------------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------------------------------


def sparse_attention_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    topk_length: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    logits: str | None = None,
    index_ahead: bool | None = None,
    lazy_rescale: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of sparse multi-query attention with a sink (Triton).

    Args:
        q: ``[T, H, D]`` bf16, fp16 or fp32 (D a multiple of 16, at most 512).
        kv: ``[N, D]`` same dtype: each row is key and value of every head.
        idx: ``[T, Kt]`` int32 (or int64) rows of ``kv``; ``-1`` marks an empty slot. Rows ``>= N`` are
            treated as empty (no memory fault) rather than raising.
        sink: ``[H]`` fp32 sink logits.
        scale: logit scale.
        topk_length: optional ``[T]`` int32: query t uses its first ``topk_length[t]`` slots only.
        block_h, block_k, num_warps, num_stages: pin a launch configuration (default: the ladder).
        logits: the logits' layout, ``"duplicated"`` (both warpgroups compute all of them), ``"split"``
            (each computes half of the slots) or ``"slots_on_m"`` (``kv @ q^T``): ``LOGITS`` of
            ``_fwd_kernel``; ``None``: the kernel option ``triton_fwd_logits``.
        index_ahead: ``True``: each step loads the next step's row indices (``INDEX_AHEAD``); ``None``:
            the kernel option ``triton_fwd_index_ahead``.
        lazy_rescale: ``True``: with split logits, the accumulator is rescaled only when a head's max rises
            by more than 2^8 (``LAZY_RESCALE``); ``None``: the kernel option ``triton_fwd_lazy_rescale``.

    Returns:
        ``out [T, H, D]`` in q's dtype and ``lse [T, H]`` fp32 (natural log, sink excluded, -inf for a
        row with no valid key, whose ``out`` is 0).
    """
    _check(q, kv, idx, sink, topk_length)
    layout = kernel_options.get("triton_fwd_logits") if logits is None else logits
    if layout not in FWD_LOGITS:
        raise ValueError(f"logits: must be one of {', '.join(FWD_LOGITS)}, got {layout!r}")
    ahead = _option_flag("triton_fwd_index_ahead", index_ahead)
    lazy = _option_flag("triton_fwd_lazy_rescale", lazy_rescale) and layout == "split"
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.contiguous()
    sink = sink.to(torch.float32).contiguous()
    t, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    topk = topk_length.contiguous() if topk_length is not None else idx  # dummy pointer when absent
    block_d = triton.next_power_of_2(d)
    ladder = (_fwd_slots_on_m_ladder if layout == "slots_on_m" else _fwd_ladder)(block_d, h, q.dtype)
    pinned = _pinned("triton_fwd_config", KernelConfig, ladder[0], block_h=block_h, block_k=block_k,
                     num_warps=num_warps, num_stages=num_stages)
    kernel = _build("_fwd_kernel", q.device)

    def launch(cfg: KernelConfig) -> None:
        n_hb = triton.cdiv(h, cfg.block_h)
        kernel[(t * n_hb,)](
            q, kv, idx, sink, topk, out, lse,
            float(scale) * LOG2E, h, kv.shape[0], idx.shape[1], n_hb,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
            HAS_TOPK=topk_length is not None, PRECISION=_precision(q), DOT_F32=_dot_f32(q), LOGITS=layout,
            INDEX_AHEAD=ahead, LAZY_RESCALE=lazy, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch("fwd", (*_config_key(q), layout, ahead, lazy), ladder, pinned, launch)  # a configuration per variant
    return out, lse


def sparse_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    *,
    deterministic: bool | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dkv_config: DkvConfig | None = None,
    scratch_bytes: int | None = None,
    dq_in_dkv: bool | None = None,
    dkv_one_product: bool | None = None,
    index_ahead: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`sparse_attention_fwd` (Triton).

    Args:
        dout: ``[T, H, D]`` gradient of ``out`` (q's dtype); q, kv, idx, sink, scale, topk_length as in
            the forward; ``out [T, H, D]`` and ``lse [T, H]`` fp32 from the forward.
        deterministic: ``True``: kv gradients reduced through an inverted index in a fixed order
            (bitwise reproducible, slower); ``False``: fp32 atomics; ``None``:
            :func:`dsv4cp.kernels.is_deterministic`.
        block_h, block_k, num_warps, num_stages: pin the dq kernel's configuration;
        dkv_config: pin the dkv kernel's configuration.
        scratch_bytes: scratch budget per query chunk (default :data:`BWD_SCRATCH_BYTES`).
        dq_in_dkv: ``True``: the dq kernel only writes p / ds (64 heads per program on wgmma) and the
            dkv kernel accumulates dq by column block beside the kv gradients; ``False``: the dq kernel
            accumulates dq (mma.sync, 32 heads per program at D = 512); ``None``: the kernel option
            ``triton_dq_in_dkv`` (:data:`DQ_IN_DKV_ENV`, else :data:`DQ_IN_DKV_DEFAULT`). block_h..num_stages
            pin the first kernel, dkv_config the second.
        dkv_one_product: ``True``: the dkv kernel forms ``ds^T q + p^T dO`` as one product over
            ``[ds | p]`` (p and ds share one scratch buffer, row by row); ``False``: two chained products;
            ``None``: the kernel option ``triton_dkv_one_product``.
        index_ahead: ``True``: both kernels load the next step's row indices one step ahead; ``None``: the
            kernel option ``triton_bwd_index_ahead``.

    Returns:
        ``dq [T, H, D]`` (q's dtype), ``dkv [N, D]`` (kv's dtype, accumulated in fp32), ``dsink [H]``
        (sink's dtype, accumulated in fp32 by per-row partials then ``torch.sum``).
    """
    plan = backward_plan(dout, q, kv, idx, sink, scale, out, lse, topk_length, deterministic=deterministic,
                         block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                         dkv_config=dkv_config, scratch_bytes=scratch_bytes, dq_in_dkv=dq_in_dkv,
                         dkv_one_product=dkv_one_product, index_ahead=index_ahead)
    if plan is None:  # no query or no slot: every gradient is zero
        return (torch.zeros_like(q), torch.zeros(kv.shape, dtype=kv.dtype, device=kv.device),
                torch.zeros(sink.shape, dtype=sink.dtype, device=sink.device))
    return plan.run()


def backward_plan(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    *,
    deterministic: bool | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dkv_config: DkvConfig | None = None,
    scratch_bytes: int | None = None,
    dq_in_dkv: bool | None = None,
    dkv_one_product: bool | None = None,
    index_ahead: bool | None = None,
) -> BackwardPlan | None:
    """The launches of :func:`sparse_attention_bwd` (same arguments, checked the same way) with their
    buffers allocated, run by :meth:`BackwardPlan.run` or part by part; None when there is no query or no
    slot (every gradient zero)."""
    _check(q, kv, idx, sink, topk_length)
    t, h, d = q.shape
    if dout.shape != q.shape or dout.dtype != q.dtype:
        raise ValueError(f"dout: must be {tuple(q.shape)} {q.dtype}, got {tuple(dout.shape)} {dout.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"out: must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if lse.shape != (t, h):
        raise ValueError(f"lse: must be [{t}, {h}], got shape {tuple(lse.shape)}")
    for name, tensor in (("dout", dout), ("out", out), ("lse", lse)):
        if tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")
    if deterministic is None:
        deterministic = is_deterministic()
    acc_dq_in_dkv = _dq_in_dkv(dq_in_dkv)
    one_product = _option_flag("triton_dkv_one_product", dkv_one_product)
    ahead = _option_flag("triton_bwd_index_ahead", index_ahead)
    q, kv, idx, dout, out = q.contiguous(), kv.contiguous(), idx.contiguous(), dout.contiguous(), out.contiguous()
    kt = idx.shape[1]
    if t == 0 or kt == 0:
        return None
    block_d = triton.next_power_of_2(d)
    dq_ladder = (_scores_ladder if acc_dq_in_dkv else _dq_ladder)(block_d, h, q.dtype)
    dkv_ladder = (_dkv_dq_ladder(block_d, h, q.dtype, one_product) if acc_dq_in_dkv
                  else _dkv_ladder(block_d, h, q.dtype))
    budget = BWD_SCRATCH_BYTES if scratch_bytes is None else int(scratch_bytes)
    per_query = 2 * kt * h * q.element_size() + (kt * d * 4 if deterministic else 0)
    chunk = max(1, min(t, budget // per_query))
    if scratch_bytes is None:  # at least BWD_SCRATCH_MIN_CHUNKS chunks: the scratch shrinks with the rank's rows
        chunk = min(chunk, max(BWD_SCRATCH_MIN_CHUNK_ROWS, -(-t // BWD_SCRATCH_MIN_CHUNKS)))
    return BackwardPlan(
        q=q, kv=kv, idx=idx, sink=sink, scale=float(scale), out=out, lse=lse.to(torch.float32).contiguous(),
        dout=dout, topk_length=None if topk_length is None else topk_length.contiguous(),
        deterministic=deterministic, acc_dq_in_dkv=acc_dq_in_dkv, one_product=one_product, ahead=ahead,
        chunk=chunk, dq_ladder=dq_ladder, dkv_ladder=dkv_ladder,
        dq_pinned=_pinned("triton_bwd_config", KernelConfig, dq_ladder[0], block_h=block_h, block_k=block_k,
                          num_warps=num_warps, num_stages=num_stages),
        dkv_pinned=_pinned("triton_dkv_config", DkvConfig, dkv_ladder[0],
                           **({} if dkv_config is None else vars(dkv_config))),
    )


@dataclass
class BackwardPlan:
    """One backward's launches and buffers (:func:`backward_plan`), each part callable alone so that a
    benchmark can time it: :meth:`preprocess` (delta and the sink-gradient partials of all queries),
    then per query chunk (:meth:`starts`) :meth:`scores` (the first kernel: p and ds to scratch, or dq
    too), :meth:`kv_gradients` (the dkv kernel: fp32 atomics, or contribution rows in deterministic mode;
    dq with ``acc_dq_in_dkv``) and, in deterministic mode, :meth:`destinations` (the stable sort of the
    chunk's slot rows) and :meth:`reduce` (the per-row sums). :meth:`run` runs them all, in order.

    Tensors as :func:`sparse_attention_bwd` takes them (contiguous; ``lse`` fp32); the buffers (``dq``,
    fp32 ``dkv``, ``delta``, ``dsink_part``, the p / ds scratch of ``chunk`` queries and, deterministic,
    the contributions) are allocated by ``__post_init__``."""

    q: torch.Tensor
    kv: torch.Tensor
    idx: torch.Tensor
    sink: torch.Tensor
    scale: float
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    topk_length: torch.Tensor | None
    deterministic: bool
    acc_dq_in_dkv: bool
    one_product: bool
    ahead: bool
    chunk: int
    dq_ladder: list[KernelConfig]
    dkv_ladder: list[DkvConfig]
    dq_pinned: KernelConfig | None
    dkv_pinned: DkvConfig | None

    def __post_init__(self) -> None:
        q, dev = self.q, self.q.device
        t, h, d = q.shape
        kt = self.idx.shape[1]
        self.dq = torch.empty_like(q)
        self.dkv = torch.zeros(self.kv.shape[0], d, dtype=torch.float32, device=dev)
        self.delta = torch.empty(t, h, dtype=torch.float32, device=dev)
        self.dsink_part = torch.empty(t, h, dtype=torch.float32, device=dev)
        self.sink32 = self.sink.to(torch.float32).contiguous()
        if self.one_product:  # one [chunk, kt, 2, h] buffer: each (query, slot) row holds ds then p
            pds = torch.empty(self.chunk, kt, 2, h, dtype=q.dtype, device=dev)
            self.dsbuf, self.pbuf, self.scratch_row = pds[:, :, 0], pds[:, :, 1], 2 * h
        else:
            self.pbuf = torch.empty(self.chunk, kt, h, dtype=q.dtype, device=dev)
            self.dsbuf = torch.empty(self.chunk, kt, h, dtype=q.dtype, device=dev)
            self.scratch_row = h
        self.contrib = (torch.empty(self.chunk * kt, d, dtype=torch.float32, device=dev) if self.deterministic
                        else None)
        self.topk = self.topk_length if self.topk_length is not None else self.idx  # dummy pointer when absent

    def starts(self) -> range:
        """The first query of each chunk."""
        return range(0, self.q.shape[0], self.chunk)

    def preprocess(self) -> None:
        """(a) ``delta = <dO, O>`` and the sink-gradient partials, for all queries at once."""
        q, out, dout = self.q, self.out, self.dout
        t, h, d = q.shape
        block_d = triton.next_power_of_2(d)
        pre_bh = 16 if block_d >= 256 else _block_h(h)  # [16, 512] tiles: ~70 registers at 8 warps
        _build("_bwd_preprocess_kernel", q.device)[(t, triton.cdiv(h, pre_bh))](
            out, dout, self.lse, self.sink32, self.delta, self.dsink_part,
            h, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_H=pre_bh, num_warps=8 if block_d >= 256 else 4,
        )

    def scores(self, t0: int) -> None:
        """(b) The first kernel on the chunk starting at query ``t0``: p and ds to scratch (and dq
        without ``acc_dq_in_dkv``)."""
        q, kv, idx, dout, dq = self.q, self.kv, self.idx, self.dout, self.dq
        t, h, d = q.shape
        rows = min(self.chunk, t - t0)

        def launch(cfg: KernelConfig) -> None:
            n_hb = triton.cdiv(h, cfg.block_h)
            _build("_bwd_dq_kernel", q.device)[(rows * n_hb,)](
                q, kv, idx, self.topk, dout, self.lse, self.delta, self.sink32, dq, self.pbuf, self.dsbuf,
                self.scale, self.scale * LOG2E, h, kv.shape[0], idx.shape[1], n_hb, t0, self.scratch_row,
                q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1),
                dq.stride(0), dq.stride(1),
                D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
                HAS_TOPK=self.topk_length is not None, ACC_DQ=not self.acc_dq_in_dkv, PRECISION=_precision(q),
                DOT_F32=_dot_f32(q), INDEX_AHEAD=self.ahead, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        # the two placements fit different configurations, and so may the variants
        _launch("bwd_dq" + self._placement, (*_config_key(q), self.ahead), self.dq_ladder, self.dq_pinned, launch)

    def kv_gradients(self, t0: int) -> None:
        """(c) The dkv kernel on the chunk starting at query ``t0``: kv-row gradients (fp32 atomics into
        ``dkv``, or contribution rows in deterministic mode) and, with ``acc_dq_in_dkv``, dq."""
        q, kv, idx, dout, dq = self.q, self.kv, self.idx, self.dout, self.dq
        t, h, d = q.shape
        rows = min(self.chunk, t - t0)

        def launch(cfg: DkvConfig) -> None:
            _build("_bwd_dkv_kernel", q.device)[(rows * triton.cdiv(d, cfg.block_d),)](
                q, dout, kv, idx, self.topk, self.pbuf, self.dsbuf,
                self.contrib if self.deterministic else self.dkv, dq,
                h, kv.shape[0], idx.shape[1], t0, self.scratch_row,
                q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1),
                dq.stride(0), dq.stride(1),
                D=d, BLOCK_DC=cfg.block_d, BLOCK_HK=max(16, triton.next_power_of_2(h)), BLOCK_K=cfg.block_k,
                HAS_TOPK=self.topk_length is not None, DETERMINISTIC=self.deterministic, ACC_DQ=self.acc_dq_in_dkv,
                PRECISION=_precision(q), DOT_F32=_dot_f32(q), ONE_PRODUCT=self.one_product, INDEX_AHEAD=self.ahead,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        _launch("bwd_dkv" + self._placement, (*_config_key(q), self.ahead, self.one_product), self.dkv_ladder,
                self.dkv_pinned, launch)

    def destinations(self, t0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic mode, chunk ``t0``: ``(perm, seg)`` of :func:`_contribution_order`."""
        rows = min(self.chunk, self.q.shape[0] - t0)
        topk = None if self.topk_length is None else self.topk_length[t0:t0 + rows]
        return _contribution_order(self.idx[t0:t0 + rows], topk, self.dkv.shape[0])

    def reduce(self, order: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Deterministic mode: add a chunk's contributions to ``dkv`` in the fixed ``order``."""
        _reduce_contributions(self.contrib, *order, self.dkv)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every part in order: ``(dq, dkv, dsink)`` as :func:`sparse_attention_bwd` returns them."""
        self.preprocess()
        dsink = self.dsink_part.sum(0)
        for t0 in self.starts():
            self.scores(t0)
            self.kv_gradients(t0)
            if self.deterministic:
                self.reduce(self.destinations(t0))
        return self.dq, self.dkv.to(self.kv.dtype), dsink.to(self.sink.dtype)

    @property
    def _placement(self) -> str:
        return "_dq_in_dkv" if self.acc_dq_in_dkv else ""


def _contribution_order(idx, topk_length, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, seg)`` for a chunk's slots ``idx [rows, Kt]``: ``perm`` the stable sort of the flattened
    slot rows (query-major, then slot; empty slots last), ``seg [n + 1]`` the start of each kv row's run
    in it: a fixed order, hence bitwise reproducible sums."""
    rows = idx.long()
    valid = (rows >= 0) & (rows < n)
    if topk_length is not None:
        slots = torch.arange(idx.shape[1], device=idx.device)
        valid &= slots[None, :] < topk_length.long()[:, None]
    keys = torch.where(valid, rows, torch.full_like(rows, n)).reshape(-1)  # empty slots sort last
    sorted_keys, perm = torch.sort(keys, stable=True)
    seg = torch.searchsorted(sorted_keys, torch.arange(n + 1, device=idx.device))
    return perm, seg


def _reduce_contributions(contrib, perm, seg, dkv) -> None:
    """dkv[r] += the chunk's contributions to row r (``contrib [rows * Kt, D]`` fp32), in the order
    ``perm`` / ``seg`` of :func:`_contribution_order`."""
    n, d = dkv.shape
    block_d = min(triton.next_power_of_2(d), 128)
    _build("_dkv_reduce_kernel", dkv.device)[(n, triton.cdiv(d, block_d))](
        contrib, perm, seg, dkv, D=d, BLOCK_C=16, BLOCK_D=block_d, num_warps=4,
    )
