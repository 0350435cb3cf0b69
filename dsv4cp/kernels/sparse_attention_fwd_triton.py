"""Forward Triton kernel of the sparse multi-query attention op with a sink (docs/design.md §4.1) and
its wrapper :func:`sparse_attention_fwd`.

The op (see :func:`dsv4cp.ops.sparse_attention`)::

    l_j    = scale * <q[t, h], kv[idx[t, j]]>        over the valid slots j of query t
    out    = sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h})   (0 when t has no valid slot)
    lse    = log sum_j e^{l_j}                         (natural log, sink EXCLUDED, -inf if none)

A slot is valid when ``0 <= idx < N`` and its position is below ``topk_length[t]`` (when given); one kv
row is both the key and the value of every head (multi-query, K = V); repeated rows are repeated keys.

``_fwd_kernel``: one program per (query token, block of ``BLOCK_H`` heads). The heads sit on the
matrix-unit M dimension; the query's slots are visited in blocks of ``BLOCK_K``: the gathered kv rows
``[BLOCK_K, D]`` are loaded ONCE and used both as K (``s = q @ kv^T``) and as V (``acc += p @ kv``).
Online softmax in fp32 with ``exp2`` (``scale * log2 e`` folded into the logits), the sink folded into
the denominator at the end. Its variants (the logits' layout, the indices a step ahead, a lazy rescale)
are kernel options; their register and shared-memory budgets and timings are in docs/kernels.md.

Kernels are built lazily per execution mode (:mod:`.sparse_attention_launch`): CUDA tensors use compiled
``triton.jit`` kernels, CPU tensors Triton's interpreter (slow: tiny sizes only), which needs
``TRITON_INTERPRET=1`` in the environment before triton is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4cp.kernel_options import OPTIONS
from dsv4cp.kernels._triton_gather import gather_loaded_rows, gather_rows, selected_length
from dsv4cp.kernels._triton_launch import pinned as _pinned
from dsv4cp.kernels.sparse_attention_launch import (
    _KERNELS,
    FWD_LOGITS,
    LOG2E,
    KernelConfig,
    _build,
    _check,
    _config_key,
    _dot_f32,
    _fwd_ladder,
    _fwd_slots_on_m_ladder,
    _launch,
    _precision,
)

__all__ = ["sparse_attention_fwd"]


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
    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)

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


_KERNELS.register(_fwd_kernel)


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
    logits: str = OPTIONS["triton_fwd_logits"].default,
    index_ahead: bool = OPTIONS["triton_fwd_index_ahead"].default,
    lazy_rescale: bool = OPTIONS["triton_fwd_lazy_rescale"].default,
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
            ``_fwd_kernel`` (default: the kernel option ``triton_fwd_logits``'s).
        index_ahead: ``True``: each step loads the next step's row indices (``INDEX_AHEAD``; default:
            the kernel option ``triton_fwd_index_ahead``'s).
        lazy_rescale: ``True``: with split logits, the accumulator is rescaled only when a head's max rises
            by more than 2^8 (``LAZY_RESCALE``; default: the kernel option ``triton_fwd_lazy_rescale``'s).

    Returns:
        ``out [T, H, D]`` in q's dtype and ``lse [T, H]`` fp32 (natural log, sink excluded, -inf for a
        row with no valid key, whose ``out`` is 0).
    """
    _check(q, kv, idx, sink, topk_length)
    layout, ahead = logits, bool(index_ahead)
    if layout not in FWD_LOGITS:
        raise ValueError(f"logits: must be one of {', '.join(FWD_LOGITS)}, got {layout!r}")
    lazy = bool(lazy_rescale) and layout == "split"
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
    pinned = _pinned(KernelConfig, ladder[0], block_h=block_h, block_k=block_k,
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

