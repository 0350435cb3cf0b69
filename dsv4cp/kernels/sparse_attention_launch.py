"""Launch planning of the Triton sparse-attention kernels (forward :mod:`.sparse_attention_fwd_triton`,
backward :mod:`.sparse_attention_bwd_triton`; the op is :func:`dsv4cp.ops.sparse_attention`):

* the launch configurations (:class:`KernelConfig`, :class:`DkvConfig`) and each kernel's ladder, tried
  in order until one compiles within the device's registers and shared memory (``OutOfResources`` moves
  to the next; the one that fits is cached per shape class);
* the input checks the kernels need on top of the op's;
* the matrix-unit precision and the interpreter's fp32 upcast;
* the one kernel set (:data:`_KERNELS`) the forward and backward modules register their bodies in, so a
  launch's cache and what ran are kept per op.

How ``D = 512`` fits an sm_90 SM (227 KB of shared memory per block, 64K 32-bit registers): the head dim
is one tile (``BLOCK_D = next_pow2(D)``: one ``tl.dot`` reduces over all of it); a ``[64, 512]`` fp32
accumulator takes 128 registers per thread over ``num_warps = 8`` (two warpgroups, each owning 256 of
the 512 columns; 16 warps would cap registers at 128 per thread and do not compile at 128 heads). The
ladders start at the configurations measured fastest on an H200 (docs/kernels.md, "Sparse attention
(Triton)") and step down to ones that fit smaller devices and fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dsv4cp import kernel_options
from dsv4cp.kernels._triton_launch import Kernels, OutOfResources  # noqa: F401  (OutOfResources: re-exported)
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels.contracts import check_sparse_attention_inputs as _check_inputs

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
accumulated by the dkv kernel), which the op hands to the ``dq_in_dkv`` keyword of the backward."""
DQ_IN_DKV_DEFAULT = kernel_options.OPTIONS["triton_dq_in_dkv"].default
"""The placement by default: in the dkv kernel, the faster on an
H200 (docs/kernels.md)."""

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

_KERNELS = Kernels("sparse_attention triton", op="sparse_attention")
"""The sparse-attention kernels: the forward and backward modules register their bodies here."""
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
