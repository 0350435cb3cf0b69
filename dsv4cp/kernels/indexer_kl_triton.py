"""Triton kernel of the sparse indexer loss's KL terms and their score gradient in one pass (docs/design.md
§1.5): :func:`kl_rows_triton`, behind :func:`dsv4cp.ops.indexer_kl.indexer_kl`.

Per row ``t`` of ``[rows, K]`` fp32 tensors ``target_mass``, ``scores`` and the bool ``valid`` (the slots
scored: the selected entries ``>= 0``), with ``w = row_weight[t]`` and ``has = any valid slot``:

* ``row_loss[t] = w * has * sum_valid (xlogy(p, p) - p * log_softmax_valid(scores))``, ``p = mass /
  max(sum_valid mass, tiny)`` (the fp32 ``tiny``), exactly the terms of the torch reference
  :func:`dsv4cp.ops.indexer_kl.kl_distillation` (``0 log 0 = 0``; a row without a valid slot gives 0);
* ``dscores[t] = w * has * (softmax_valid(scores) * sum_valid p - p)`` on valid slots, 0 elsewhere: the
  gradient of ``row_loss[t]`` in the scores (``sum p`` is 1, or 0 on a row whose valid mass is all 0,
  where the reference's gradient is 0 too), written only when asked for.

Non-finite values propagate as in the reference: a NaN or infinite mass makes the row's terms NaN (the
clamp keeps NaN: ``propagate_nan``), a NaN score NaN through the softmax's sum.

Tiling: one program per row, the whole row in one ``[BLOCK_K]`` tile (``BLOCK_K`` = the next power of two
of ``K``; the layer's ``K = 512``): every reduction of the row (mass, max, exponential sum, KL terms)
stays on chip, each input is read once and the gradient written once. The cost is the traffic: at the
64K flash shapes (rows = 65536, K = 512) 4 + 4 + 1 bytes read and 4 written per slot, 0.44 GB (the bool
mask rather than the int64 entries saves 0.23 GB). The torch reference it replaces runs ~25 kernels
(masked fills, log_softmax, xlogy, sums) and keeps several ``[rows, K]`` tensors for its backward.

The masses and scores are loaded under the row's bound ``cols < K`` and masked after: with ``K`` a
multiple of 16 (the JIT's specialisation) they are 16-byte vector loads (``ld.global.v4.b32``; under the
data-dependent slot mask they were scalar), the four mask bytes of a thread one ``ld.global.b32``, the
gradient 16-byte vector stores (read off the PTX at ``K = 512``).

Resources (``triton.compile`` for sm_90 with Triton 3.9, ``python -m bench.compile_indexer_kl_sm90``:
16-byte aligned pointers, strides and ``K``; registers per thread with / without the gradient; no spill):
``BLOCK_K = 512`` (the layer), 4 warps: 32 / 32 registers, 16 B of shared memory (the reductions' 11
barriers); 1024, 4 warps: 60 / 48, 4 KB / 16 B; 4096, 8 warps: 104 / 89, 4 KB / 32 B. At 32 registers
and 128 threads a multiprocessor holds 16 programs (rows) at once, its 2048-thread limit.

Arithmetic: the target's division is IEEE (``div.rn``, as torch's: a one-slot row's target is exactly 1,
its term exactly 0); the softmax's is the fast ``div.full`` and its exponential ``ex2.approx`` (a few
ulp, inside the tests' tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp.kernels._triton_launch import Kernels

__all__ = ["MAX_K", "KLConfig", "kl_rows_triton"]

MAX_K = 4096  # dsv4cp.ops.indexer_kl.FUSED_MAX_K sends no wider row here
"""Most slots per row: the row is one tile of registers (fp32 ``BLOCK_K`` values of five tensors)."""

_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class KLConfig:
    """Launch of ``_kl_rows_kernel``: warps per row's program."""

    num_warps: int


def _kl_rows_kernel(
    TARGET, SCORES, VALID, WEIGHT, ROW_LOSS, DSCORES,
    K, stride_tt, stride_st, stride_vt, stride_dt,
    TINY: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    """Row ``t`` = program id: ``ROW_LOSS[t]`` and, ``WRITE_GRAD``, ``DSCORES[t, :K]`` (module docs)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    inside = cols < K
    valid = tl.load(VALID + t * stride_vt + cols, mask=inside, other=0) != 0
    # loaded under the row's bound only (vector loads: the empty slots share the valid ones' lines), then masked
    mass = tl.where(valid, tl.load(TARGET + t * stride_tt + cols, mask=inside, other=0.0), 0.0)
    scores = tl.where(valid, tl.load(SCORES + t * stride_st + cols, mask=inside, other=0.0), float("-inf"))
    has = tl.sum(valid.to(tl.int32), 0) > 0

    total_mass = tl.maximum(tl.sum(mass, 0), TINY, propagate_nan=tl.PropagateNan.ALL)
    target = tl.math.div_rn(mass, total_mass)  # IEEE, as torch: a point mass's target is exactly 1
    top = tl.where(has, tl.max(scores, 0), 0.0)  # a row without a valid slot: no -inf - -inf
    shifted = scores - top
    exps = tl.exp(shifted)  # 0 at the invalid slots' -inf
    denominator = tl.sum(exps, 0)
    # no intermediate infinity or NaN of the masked slots: log 1 = 0 stands in where a log would be of 0
    log_pred = tl.where(valid, shifted - tl.log(tl.where(has, denominator, 1.0)), 0.0)
    xlogx = target * tl.log(tl.where(target == 0.0, 1.0, target))  # 0 log 0 = 0; NaN stays NaN
    terms = tl.where(valid, xlogx - target * log_pred, 0.0)
    weight = tl.where(has, tl.load(WEIGHT + t), 0.0)
    tl.store(ROW_LOSS + t, tl.sum(terms, 0) * weight)
    if WRITE_GRAD:
        target_sum = tl.sum(target, 0)
        grad = tl.where(valid, weight * (exps / tl.where(has, denominator, 1.0) * target_sum - target), 0.0)
        tl.store(DSCORES + t * stride_dt + cols, grad, mask=inside)


_KERNELS = Kernels("indexer kl triton", _kl_rows_kernel, op="indexer_kl")


def _ladder(block_k: int) -> list[KLConfig]:
    """One configuration: 4 warps up to 1024 slots (4 to 8 values per thread), then 8."""
    return [KLConfig(4 if block_k <= 1024 else 8)]


def _check(target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, row_weight: torch.Tensor) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores: must be [rows, K], got shape {tuple(scores.shape)}")
    rows, k = scores.shape
    if k > MAX_K:
        raise ValueError(f"scores: at most {MAX_K} slots per row fit one tile, got K = {k}")
    for name, tensor, dtype in (("target_mass", target_mass, torch.float32), ("scores", scores, torch.float32),
                                ("valid", valid, torch.bool)):
        if tensor.shape != scores.shape or tensor.dtype != dtype or tensor.device != scores.device:
            raise ValueError(f"{name}: must be [{rows}, {k}] {dtype} on {scores.device}, got {list(tensor.shape)} "
                             f"{tensor.dtype} on {tensor.device}")
    if row_weight.shape != (rows,) or row_weight.dtype != torch.float32 or row_weight.device != scores.device:
        raise ValueError(f"row_weight: must be [{rows}] torch.float32 on {scores.device}, got "
                         f"{list(row_weight.shape)} {row_weight.dtype} on {row_weight.device}")


def kl_rows_triton(target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, row_weight: torch.Tensor,
                   *, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(row_loss [rows] fp32, dscores [rows, K] fp32 or None)`` of the module docs.

    ``target_mass``, ``scores``: ``[rows, K]`` fp32; ``valid``: ``[rows, K]`` bool, the slots scored;
    ``row_weight``: ``[rows]`` fp32. ``with_grad``: also the scores' gradient of ``row_loss``
    (else None). Inputs are checked here; strided rows are read in place (unit stride along K needed:
    made contiguous otherwise)."""
    _check(target_mass, scores, valid, row_weight)
    target_mass, scores, valid = (x if x.stride(-1) == 1 else x.contiguous() for x in (target_mass, scores, valid))
    rows, k = scores.shape
    if rows == 0 or k == 0:  # no slot: every term and gradient is 0
        return (torch.zeros(rows, dtype=torch.float32, device=scores.device),
                torch.zeros((rows, k), dtype=torch.float32, device=scores.device) if with_grad else None)
    # the kernel writes every row's term and every slot's gradient (0 where not valid): nothing to clear first
    row_loss = torch.empty(rows, dtype=torch.float32, device=scores.device)
    dscores = torch.empty((rows, k), dtype=torch.float32, device=scores.device) if with_grad else None
    block_k = max(16, triton.next_power_of_2(k))
    kernel = _KERNELS.build("_kl_rows_kernel", scores.device)
    out_grad = dscores if with_grad else row_loss  # a placeholder pointer: WRITE_GRAD False never stores there

    def launch(cfg: KLConfig) -> None:
        kernel[(rows,)](
            target_mass, scores, valid, row_weight.contiguous(), row_loss, out_grad,
            k, target_mass.stride(0), scores.stride(0), valid.stride(0), out_grad.stride(0),
            TINY=_TINY, BLOCK_K=block_k, WRITE_GRAD=with_grad, num_warps=cfg.num_warps,
        )

    _KERNELS.launch("rows", (scores.device.type, block_k), _ladder(block_k), None, launch)
    return row_loss, dscores
