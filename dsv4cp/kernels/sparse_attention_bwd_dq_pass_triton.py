"""Triton sparse-attention backward with dq in its own pass (docs/design.md §4.2).

The same op and gradients as :func:`dsv4cp.kernels.sparse_attention_triton.sparse_attention_bwd`; the
backward's first two parts are that module's (:class:`~dsv4cp.kernels.sparse_attention_triton.BackwardPlan`:
``delta`` and the sink-gradient partials, then per query chunk the scores kernel writing ``p`` and ``ds``
side by side to a ``[chunk, Kt, 2, H]`` scratch); the rest is two query-major kernels of this module:

* ``_kv_pass_kernel``: per (query, column block), ``g = [ds | p] [BLOCK_K, 2H] @ [q ; dO] [2H, BLOCK_DC]``
  (one product, K = V: both roles add) and fp32 atomics of ``g`` into the kv rows. Unlike the default's
  dkv kernel it gathers no kv columns and holds no dq accumulator, so one program can span more columns
  (fewer re-reads of the scratch) in the same registers. With one column block per program
  (``KvPassConfig.column_blocks = 1``) each of a query's ``D / BLOCK_DC`` programs reads the query's whole
  ``[ds | p]`` scratch rows and index row again: at D = 512 and 128 columns four times the scratch traffic,
  on the L2 that the atomics already load. ``column_blocks = C`` gives one program ``C`` blocks: their
  ``[q ; dO]`` tiles loaded once before the slot loop (held in shared memory as the products' B operands:
  ``C * 2H * BLOCK_DC`` elements), then per slot step the ``[ds | p]`` tile and the row indices are loaded
  once and each block multiplies them and issues its own ``[BLOCK_K, BLOCK_DC]`` atomics (the same
  addresses, mask and width as one block per program). ``C = 1`` compiles to the one-block kernel.
* ``_dq_pass_kernel``: per (query, head block, column block), ``dq = ds @ kv[idx]`` over the query's
  slots (the forward's value product with ``ds`` for ``p``): no atomics, each dq element written once.

Why not key-major kv gradients (for each kv row, the queries that chose it): with one kv row shared by
all H heads, a row's gradient is ``sum over its (query, slot) pairs of [ds | p][pair] @ [q ; dO][query]``,
a ``[1, 2H] @ [2H, D]`` product per pair that reads the query's whole ``[2H, D]`` block: per row there is
no second row to share that read with (the selection of a compressed row by two neighbouring queries is
random), so the pass would read ``T * Kt * 2H * D`` elements of q / dO instead of ``T * 2H * D``. The
query-major product reads each query's block once; only its sums need the atomics.

Kernel options (read by the op, :mod:`dsv4cp.ops.sparse_attention`): ``triton_bwd_dq_pass`` selects this
backward, ``triton_kv_pass_config`` / ``triton_dq_pass_config`` pin its two launches (else their ladders).
Deterministic mode is the default backward's (no atomics); this one always adds with atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp.kernels._triton_gather import selected_length
from dsv4cp.kernels._triton_launch import Kernels, check_tiles
from dsv4cp.kernels.sparse_attention_bwd_triton import backward_plan
from dsv4cp.kernels.sparse_attention_launch import _dot_f32, _precision

__all__ = ["DqPassConfig", "KvPassConfig", "SplitBackwardPlan", "sparse_attention_bwd_dq_pass",
           "split_backward_plan"]


@dataclass(frozen=True)
class KvPassConfig:
    """kv-pass launch: slots per step (matrix-unit M), head-dim columns per product (N), warps, stages, and
    column blocks per program: one program covers ``column_blocks * block_d`` columns of its query, loading
    each step's ``[ds | p]`` tile and row indices once for all of them (1: one block per program)."""

    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    column_blocks: int = 1


@dataclass(frozen=True)
class DqPassConfig:
    """dq-pass launch: heads per program (M), head-dim columns per program (N), slots per step (K), warps,
    stages."""

    block_h: int
    block_d: int
    block_k: int
    num_warps: int
    num_stages: int


def _kv_pass_kernel(
    Q, DOUT, IDX, TOPK, PDS, DKV,
    H, N, KT, T0, SCRATCH_ROW,
    stride_qt, stride_qh, stride_it, stride_dt, stride_dh,
    D: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_K: tl.constexpr,
    COLUMN_BLOCKS: tl.constexpr, HAS_TOPK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """kv-row gradients of query t = T0 + pid // n_db (n_db = cdiv(D, COLUMN_BLOCKS * BLOCK_DC) programs per
    query), columns ``[(pid % n_db) * COLUMN_BLOCKS * BLOCK_DC, +COLUMN_BLOCKS * BLOCK_DC)`` in COLUMN_BLOCKS
    blocks of BLOCK_DC: ``g[slot] = [ds | p][slot] @ [q ; dO]`` over all H heads (BLOCK_HK >= H), fp32
    atomics into DKV ``[N, D]`` at the slot's row (valid slots below the query's length, columns below D).

    Q, DOUT ``[T, H, D]``; IDX ``[T, KT]``; TOPK ``[T]`` (read iff HAS_TOPK); PDS the scores kernel's
    scratch: row ``(t - T0) * KT + slot`` (``SCRATCH_ROW`` elements apart) holds ds of the H heads, then p.
    Every block's ``[q ; dO]`` tile is loaded before the slot loop (loop-invariant: the products' B
    operands); per step the ``[ds | p]`` tile and the row indices are loaded once and each column block
    multiplies them and issues its atomics. The next step's row indices are loaded a step ahead (off the
    path to the atomics' addresses)."""
    program_cols: tl.constexpr = COLUMN_BLOCKS * BLOCK_DC
    n_db: tl.constexpr = (D + program_cols - 1) // program_cols
    pid = tl.program_id(0)
    t_local = (pid // n_db).to(tl.int64)
    t = T0 + t_local
    d_blocks = ()  # each column block's columns and their mask (< D)
    dmask_blocks = ()
    for cb in tl.static_range(COLUMN_BLOCKS):
        d = (pid % n_db) * program_cols + cb * BLOCK_DC + tl.arange(0, BLOCK_DC)
        d_blocks = d_blocks + (d,)
        dmask_blocks = dmask_blocks + (d < D,)
    # [q ; dO] [2 BLOCK_HK, BLOCK_DC] per column block: rows c < BLOCK_HK from q (they meet ds), the others
    # from dO (p)
    cols = tl.arange(0, 2 * BLOCK_HK)
    c_head = cols % BLOCK_HK
    c_from_p = cols >= BLOCK_HK
    c_mask = c_head < H
    qdo_rows = tl.where(c_from_p[:, None], DOUT + t * stride_dt + c_head[:, None] * stride_dh,
                        Q + t * stride_qt + c_head[:, None] * stride_qh)
    qdo_blocks = ()
    for cb in tl.static_range(COLUMN_BLOCKS):
        qdo = tl.load(qdo_rows + d_blocks[cb][None, :], mask=c_mask[:, None] & dmask_blocks[cb][None, :], other=0.0)
        if DOT_F32:
            qdo = qdo.to(tl.float32)
        qdo_blocks = qdo_blocks + (qdo,)
    pds_cols = tl.where(c_from_p, H, 0) + c_head

    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)
    rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len, other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_len = slots < kt_len
        rows = rows_next.to(tl.int64)
        rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
        valid = (rows >= 0) & (rows < N)
        pds = tl.load(PDS + (t_local * KT + slots)[:, None] * SCRATCH_ROW + pds_cols[None, :],
                      mask=in_len[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_K, 2 BLOCK_HK]
        if DOT_F32:
            pds = pds.to(tl.float32)
        for cb in tl.static_range(COLUMN_BLOCKS):
            g = tl.dot(pds, qdo_blocks[cb], input_precision=PRECISION)  # [BLOCK_K, BLOCK_DC] fp32
            tl.atomic_add(DKV + rows[:, None] * D + d_blocks[cb][None, :], g,
                          mask=valid[:, None] & dmask_blocks[cb][None, :], sem="relaxed")


def _dq_pass_kernel(
    KV, IDX, TOPK, PDS, DQ,
    H, N, KT, T0, SCRATCH_ROW, N_HB,
    stride_kvn, stride_it, stride_dqt, stride_dqh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_TOPK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """dq of query t = T0 + pid // (N_HB * cdiv(D, BLOCK_DC)), a block of BLOCK_H heads and BLOCK_DC columns:
    ``dq = ds @ kv[idx]`` over the query's slots (ds has the logit scale in it; 0 on empty slots), written
    once to DQ ``[T, H, D]`` (its dtype). KV ``[N, D]``; IDX, TOPK, PDS as in ``_kv_pass_kernel``."""
    n_db: tl.constexpr = (D + BLOCK_DC - 1) // BLOCK_DC
    pid = tl.program_id(0)
    t_local = (pid // (N_HB * n_db)).to(tl.int64)
    t = T0 + t_local
    hb = (pid // n_db) % N_HB
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = (pid % n_db) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dmask = d < D

    kt_len = selected_length(TOPK, t, KT, HAS_TOPK)
    dq = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    rows_next = tl.load(IDX + t * stride_it + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < kt_len, other=-1)
    for k0 in range(0, kt_len, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_len = slots < kt_len
        rows = rows_next.to(tl.int64)
        rows_next = tl.load(IDX + t * stride_it + slots + BLOCK_K, mask=slots + BLOCK_K < kt_len, other=-1)
        valid = (rows >= 0) & (rows < N)
        kv = tl.load(KV + rows[:, None] * stride_kvn + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        ds_t = tl.load(PDS + (t_local * KT + slots)[:, None] * SCRATCH_ROW + heads[None, :],
                       mask=in_len[:, None] & hmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_H]
        if DOT_F32:
            kv = kv.to(tl.float32)
            ds_t = ds_t.to(tl.float32)
        dq = tl.dot(tl.trans(ds_t), kv, dq, input_precision=PRECISION)
    tl.store(DQ + t * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])


_KERNELS = Kernels("sparse_attention dq-pass triton", _kv_pass_kernel, _dq_pass_kernel, op="sparse_attention")
_build, _launch = _KERNELS.build, _KERNELS.launch


def _kv_pass_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[KvPassConfig]:
    """[q ; dO] of ``2 * next_pow2(H)`` rows stays in shared memory: at H = 64 and 256 columns (one block of
    256, or two of 128) 64 KB."""
    if block_d >= 256 and dtype != torch.float32:
        # 64 x 128 x 8 warps x 3 stages first at both head counts: 6.97 ms (flash) / 17.44 ms (pro) against
        # 7.32 / 22.48 at 2 stages and 7.65 / 20.00 for the next best (results/2026-12-02-h200-sparse-backward);
        # then two column blocks per program (each step's [ds | p] tile read once for 256 columns): 7.22 ms
        # at flash, 18.01 at pro with 2 stages (results/2026-12-03-h200-kv-pass-column-blocks)
        ladder = [(64, 128, 8, 3), (64, 128, 8, 3, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1)]
    else:
        wide = min(block_d, 128 if dtype == torch.float32 else 256)
        ladder = [(32, wide, 4, 2), (16, min(wide, 64), 4, 1)]
    return [KvPassConfig(*c) for c in ladder]


def _dq_pass_ladder(block_d: int, heads: int, dtype: torch.dtype) -> list[DqPassConfig]:
    """A [block_h, block_d] fp32 accumulator (at most 128 registers per thread), the gathered kv columns
    [block_k, block_d] in ``num_stages`` buffers."""
    bh = max(16, min(128, triton.next_power_of_2(heads)))
    if block_d >= 256 and dtype != torch.float32:
        # measured on an H200 (results/2026-12-02-h200-sparse-backward): H = 128, 128 x 128 columns 6.45 ms
        # against 7.66 at 256; H = 64, 64 x 256 x 4 warps 2.13 ms against 2.31 for 64 x 512 x 8 warps
        if bh >= 128:
            ladder = [(128, 128, 32, 8, 3), (128, 256, 32, 8, 3), (64, 256, 32, 4, 3)]
        else:
            ladder = [(bh, 256, 32, 4, 3), (bh, 512, 32, 8, 3), (bh, 256, 64, 4, 2)]
    else:
        bh = min(bh, 64)
        ladder = [(bh, min(block_d, 128), 32, 4, 2), (min(bh, 32), min(block_d, 64), 16, 4, 1)]
    return [DqPassConfig(*c) for c in ladder]


@dataclass
class SplitBackwardPlan:
    """One backward's launches (:func:`split_backward_plan`), each part callable alone for a benchmark:
    ``base`` (the default backward's plan: :meth:`preprocess`, and per chunk the scores kernel writing p and
    ds side by side), then per chunk :meth:`kv_gradients` and :meth:`dq`. :meth:`run` runs them in order."""

    base: object
    kv_ladder: list[KvPassConfig]
    dq_ladder: list[DqPassConfig]
    kv_pinned: KvPassConfig | None
    dq_pinned: DqPassConfig | None

    def starts(self) -> range:
        return self.base.starts()

    def preprocess(self) -> None:
        self.base.preprocess()

    def scores(self, t0: int) -> None:
        self.base.scores(t0)

    def kv_gradients(self, t0: int, *, write: bool = True) -> None:
        """The kv pass on the chunk at ``t0``. ``write=False`` launches it with no kv row in range (every
        atomic masked off: the same loads and products without the atomics' traffic), to time their share."""
        b = self.base
        q, dout, idx = b.q, b.dout, b.idx
        t, h, d = q.shape
        rows = min(b.chunk, t - t0)

        def launch(cfg: KvPassConfig) -> None:
            _build("_kv_pass_kernel", q.device)[(rows * triton.cdiv(d, cfg.block_d * cfg.column_blocks),)](
                q, dout, idx, b.topk, b.dsbuf, b.dkv,
                h, b.kv.shape[0] if write else 0, idx.shape[1], t0, b.scratch_row,
                q.stride(0), q.stride(1), idx.stride(0), dout.stride(0), dout.stride(1),
                D=d, BLOCK_DC=cfg.block_d, BLOCK_HK=max(16, triton.next_power_of_2(h)), BLOCK_K=cfg.block_k,
                COLUMN_BLOCKS=cfg.column_blocks, HAS_TOPK=b.topk_length is not None, PRECISION=_precision(q),
                DOT_F32=_dot_f32(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        _launch("bwd_kv_pass", _shape_class(q), self.kv_ladder, self.kv_pinned, launch)

    def dq(self, t0: int) -> None:
        """The dq pass on the chunk at ``t0``."""
        b = self.base
        q, kv, idx, dq = b.q, b.kv, b.idx, b.dq
        t, h, d = q.shape
        rows = min(b.chunk, t - t0)

        def launch(cfg: DqPassConfig) -> None:
            n_hb = triton.cdiv(h, cfg.block_h)
            _build("_dq_pass_kernel", q.device)[(rows * n_hb * triton.cdiv(d, cfg.block_d),)](
                kv, idx, b.topk, b.dsbuf, dq,
                h, kv.shape[0], idx.shape[1], t0, b.scratch_row, n_hb,
                kv.stride(0), idx.stride(0), dq.stride(0), dq.stride(1),
                D=d, BLOCK_H=cfg.block_h, BLOCK_DC=cfg.block_d, BLOCK_K=cfg.block_k,
                HAS_TOPK=b.topk_length is not None, PRECISION=_precision(q), DOT_F32=_dot_f32(q),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )

        _launch("bwd_dq_pass", _shape_class(q), self.dq_ladder, self.dq_pinned, launch)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every part in order: ``(dq, dkv, dsink)``."""
        b = self.base
        b.preprocess()
        dsink = b.dsink_part.sum(0)
        for t0 in b.starts():
            b.scores(t0)
            self.kv_gradients(t0)
            self.dq(t0)
        return b.dq, b.dkv.to(b.kv.dtype), dsink.to(b.sink.dtype)


def _shape_class(q: torch.Tensor) -> tuple:
    return (q.device.type, q.shape[2], q.dtype, triton.next_power_of_2(q.shape[1]))


def split_backward_plan(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *,
                        kv_config: KvPassConfig | None = None,
                        dq_config: DqPassConfig | None = None) -> SplitBackwardPlan | None:
    """The launches of :func:`sparse_attention_bwd_dq_pass` (same arguments, checked by the default
    backward's :func:`~dsv4cp.kernels.sparse_attention_triton.backward_plan`); None when there is no query
    or no slot."""
    base = backward_plan(dout, q, kv, idx, sink, scale, out, lse, topk_length, deterministic=False,
                         dq_in_dkv=True, dkv_one_product=True)
    if base is None:
        return None
    block_d = triton.next_power_of_2(q.shape[2])
    return SplitBackwardPlan(
        base=base, kv_ladder=_kv_pass_ladder(block_d, q.shape[1], q.dtype),
        dq_ladder=_dq_pass_ladder(block_d, q.shape[1], q.dtype),
        kv_pinned=_checked(kv_config, "kv_config"), dq_pinned=_checked(dq_config, "dq_config"),
    )


def _checked(config, name: str):
    """A pinned configuration (None: the ladder) with its tiles powers of two >= 16 and at least one warp,
    stage (and column block); errors start with ``name``, the keyword argument."""
    if config is not None:
        check_tiles(config, prefix=f"{name}.")
        if config.num_warps < 1 or config.num_stages < 1:
            raise ValueError(f"{name}: num_warps and num_stages must be >= 1, got {config}")
        if isinstance(config, KvPassConfig) and config.column_blocks < 1:
            raise ValueError(f"{name}.column_blocks: must be >= 1, got {config.column_blocks}")
    return config


def sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *,
                                 kv_config: KvPassConfig | None = None,
                                 dq_config: DqPassConfig | None = None):
    """Backward of the Triton sparse attention with dq in its own pass: the arguments and results of
    :func:`~dsv4cp.kernels.sparse_attention_triton.sparse_attention_bwd` (kv gradients by fp32 atomics);
    ``kv_config`` / ``dq_config`` pin the two passes (else their ladders)."""
    plan = split_backward_plan(dout, q, kv, idx, sink, scale, out, lse, topk_length, kv_config=kv_config,
                               dq_config=dq_config)
    if plan is None:
        return (torch.zeros_like(q), torch.zeros(kv.shape, dtype=kv.dtype, device=kv.device),
                torch.zeros(sink.shape, dtype=sink.dtype, device=sink.device))
    return plan.run()
