"""Backward Triton kernels of the sparse multi-query attention op with a sink (docs/design.md §4.2),
the forward being :mod:`.sparse_attention_fwd_triton`, and their wrappers :func:`sparse_attention_bwd`,
:func:`backward_plan` / :class:`BackwardPlan`.

(a) for all queries, then (b) and (c) per chunk of queries:

(a) ``_bwd_preprocess_kernel``: ``delta = <dO, O>`` per (t, h) and the sink-gradient partials
    ``-p_sink * delta`` (summed over t by ``torch.sum``: deterministic);
(b) ``_bwd_dq_kernel``: per (query, head block) like the forward: recomputes ``p`` from ``lse``,
    ``ds = p (dO.kv - delta) scale``, accumulates ``dq = ds @ kv`` and writes ``p`` and ``ds``
    (``[chunk, Kt, H]``, q's dtype: exactly the values the matrix unit consumes) to scratch;
(c) ``_bwd_dkv_kernel``: per (query, D chunk): ``dkv_slots = ds^T q + p^T dO`` over ALL heads (K = V:
    both roles add), then either fp32 ``tl.atomic_add`` into the kv rows (fast default) or, in
    deterministic mode, a store into a per-(query, slot) contribution buffer that ``_dkv_reduce_kernel``
    sums per kv row in a fixed order given by an inverted index (stable ``torch.sort`` of the flattened
    ``idx``): bitwise reproducible. The D chunks of one query are neighbouring programs, so its p / ds
    scratch is read from HBM once and then from L2.

"dq in dkv" placement (the default, :data:`~.sparse_attention_launch.DQ_IN_DKV_DEFAULT`; ``dq_in_dkv=False``
or the kernel option ``triton_dq_in_dkv=0`` selects the one above): (b) only writes p and ds, holding no
``[BLOCK_H, D]`` accumulator, so 64 heads fit one program on wgmma (one gather of each kv row per query at
H = 64, not two), and (c) also accumulates its D chunk of ``dq = ds @ kv`` (gathering that chunk of the kv
rows; ds is already loaded). :class:`BackwardPlan` holds the launches and buffers of one backward
(:func:`backward_plan`), each part callable alone (``bench/test_bench_sparse_attention.py``'s parts
benchmark times them).

A single fused backward (dq and dkv in one loop) needs two [*, 512] fp32 accumulators and a second copy
of q and dO in shared memory (~300 KB): it does not fit, hence (b) + (c) at the price of writing p and
ds once (2 x T x Kt x H x 2 bytes, in chunks of at most ``BWD_SCRATCH_BYTES``). Register and
shared-memory budgets and timings of the variants are in docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp.kernel_options import OPTIONS
from dsv4cp.kernels import is_deterministic
from dsv4cp.kernels._triton_gather import gather_loaded_rows, gather_rows, selected_length
from dsv4cp.kernels._triton_launch import pinned as _pinned
from dsv4cp.kernels.sparse_attention_launch import (
    _KERNELS,
    BWD_SCRATCH_BYTES,
    BWD_SCRATCH_MIN_CHUNK_ROWS,
    BWD_SCRATCH_MIN_CHUNKS,
    DQ_IN_DKV_DEFAULT,
    LOG2E,
    DkvConfig,
    KernelConfig,
    _block_h,
    _build,
    _check,
    _config_key,
    _dkv_dq_ladder,
    _dkv_ladder,
    _dot_f32,
    _dq_ladder,
    _launch,
    _precision,
    _scores_ladder,
)

__all__ = ["BackwardPlan", "backward_plan", "sparse_attention_bwd"]


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

    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)

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

    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)
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


_KERNELS.register(_bwd_preprocess_kernel, _bwd_dq_kernel, _bwd_dkv_kernel, _dkv_reduce_kernel)


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
    **launch: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`sparse_attention_fwd` (Triton).

    Args:
        dout: ``[T, H, D]`` gradient of ``out`` (q's dtype); q, kv, idx, sink, scale, topk_length as in
            the forward; ``out [T, H, D]`` and ``lse [T, H]`` fp32 from the forward.
        launch: how it runs (``deterministic``, the launch pins, the kernel variants): the keywords of
            :func:`backward_plan`, which checks them.

    Returns:
        ``dq [T, H, D]`` (q's dtype), ``dkv [N, D]`` (kv's dtype, accumulated in fp32), ``dsink [H]``
        (sink's dtype, accumulated in fp32 by per-row partials then ``torch.sum``).
    """
    plan = backward_plan(dout, q, kv, idx, sink, scale, out, lse, topk_length, **launch)
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
    dq_in_dkv: bool = DQ_IN_DKV_DEFAULT,
    dkv_one_product: bool = OPTIONS["triton_dkv_one_product"].default,
    index_ahead: bool = OPTIONS["triton_bwd_index_ahead"].default,
) -> BackwardPlan | None:
    """The launches of :func:`sparse_attention_bwd` (same tensors) with their buffers allocated, run by
    :meth:`BackwardPlan.run` or part by part; None when there is no query or no slot (every gradient zero).

    Args:
        deterministic: ``True``: kv gradients reduced through an inverted index in a fixed order
            (bitwise reproducible, slower); ``False``: fp32 atomics; ``None``:
            :func:`dsv4cp.kernels.is_deterministic`.
        block_h, block_k, num_warps, num_stages: pin the dq kernel's configuration;
        dkv_config: pin the dkv kernel's configuration.
        scratch_bytes: scratch budget per query chunk (default :data:`BWD_SCRATCH_BYTES`).
        dq_in_dkv: ``True``: the dq kernel only writes p / ds (64 heads per program on wgmma) and the
            dkv kernel accumulates dq by column block beside the kv gradients; ``False``: the dq kernel
            accumulates dq (mma.sync, 32 heads per program at D = 512); default: the kernel option
            ``triton_dq_in_dkv``'s (:data:`DQ_IN_DKV_DEFAULT`). block_h..num_stages pin the first kernel,
            dkv_config the second.
        dkv_one_product: ``True``: the dkv kernel forms ``ds^T q + p^T dO`` as one product over
            ``[ds | p]`` (p and ds share one scratch buffer, row by row); ``False``: two chained products;
            default: the kernel option ``triton_dkv_one_product``'s.
        index_ahead: ``True``: both kernels load the next step's row indices one step ahead; default: the
            kernel option ``triton_bwd_index_ahead``'s.
    """
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
    acc_dq_in_dkv, one_product, ahead = bool(dq_in_dkv), bool(dkv_one_product), bool(index_ahead)
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
        dq_pinned=_pinned(KernelConfig, dq_ladder[0], block_h=block_h, block_k=block_k,
                          num_warps=num_warps, num_stages=num_stages),
        dkv_pinned=_pinned(DkvConfig, dkv_ladder[0],
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
