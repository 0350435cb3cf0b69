"""The first keys-on-M scores backward (the head dimension whole, not in halves), as measured in this
folder's first call (``bwd_kernel.txt``) and as the ``full`` variants of ``variants.py``: 64 x 128 fp32 key
gradient tiles live at once, which spilled (``ncu.txt``: 4.3 GB of local loads at 64K)."""

import triton.language as tl

from dsv4cp.kernels._triton_gather import gather_rows
from dsv4cp.kernels.indexer_scores_triton import _store_key_grads


def whole_width_kernel(
    Q, W, KEYS, IDX, GRAD, DQ, DW, DKEYS, DEST, CONTRIB,
    HI, G, KSEL, T0,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_gt, stride_dqt, stride_dqh, stride_dkn,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    SORTED: tl.constexpr, RELAXED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """``_gather_bwd_kernel`` (same arguments, same results) with the selected keys on the matrix unit's M
    dimension: the logits are computed transposed, ``s^T = k q^T`` (``[BLOCK_K, BLOCK_H]``), so that the
    key gradient ``dk = ds^T q`` takes ``ds^T`` straight from the logits' accumulator registers as its
    A operand (no transpose; ``BLOCK_K = 64`` keys per warpgroup is a whole wgmma M), and ``dq += ds k``
    reads ``ds`` from one shared-memory copy of ``ds^T``. ``dw`` is accumulated elementwise in a
    ``[BLOCK_K, BLOCK_H]`` register tile (``relu(s^T) g``) and reduced over the keys once, after the loop,
    instead of a cross-thread reduction per step."""
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
    dw_parts = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, KSEL, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        smask = slots < KSEL
        rows, valid, kg = gather_rows(KEYS, IDX + t * stride_it, slots, smask, G, stride_kn, d, dmask,
                                      DI, BLOCK_D, DOT_F32)
        g = tl.load(GRAD + t * stride_gt + slots, mask=valid, other=0.0)
        st = tl.dot(kg, tl.trans(q), input_precision=PRECISION)  # [BLOCK_K, BLOCK_H]
        dw_parts += tl.maximum(st, 0.0) * g[:, None]
        dst = tl.where(st > 0.0, g[:, None] * w[None, :], 0.0).to(q.dtype)
        dk = tl.dot(dst, q, input_precision=PRECISION)  # [BLOCK_K, BLOCK_D] fp32
        dq = tl.dot(tl.trans(dst), kg, dq, input_precision=PRECISION)
        _store_key_grads(dk, rows, valid, d, dmask, DKEYS, DEST, CONTRIB, t_local, slots, KSEL, stride_dkn, DI,
                         SORTED, RELAXED)
    tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qd_mask)
    tl.store(DW + t * HI + heads, tl.sum(dw_parts, 0), mask=hmask)
