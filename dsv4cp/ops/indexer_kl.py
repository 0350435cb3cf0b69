"""The indexer loss's KL distillation terms (docs/design.md §1.5): the torch reference
:func:`kl_distillation` and :func:`indexer_kl`, which runs it or the fused Triton pass
(:mod:`dsv4cp.kernels.indexer_kl_triton`) as the kernel option ``indexer_loss_kl`` says.

The fused pass computes each row's term and its score gradient together; the gradient is saved (the
loss is a scalar), so the backward only scales it by the incoming gradient, as the dense variant's
chunked loss does. The rows' terms are summed by ``torch.sum`` (deterministic, no atomics).
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.kernels import HAS_TRITON
from dsv4cp.ops.custom_op_library import note_eager

KL_IMPLS = ("torch", "triton")


def kl_distillation(
    target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, row_weight: torch.Tensor
) -> torch.Tensor:
    """``sum_t row_weight[t] * KL(normalise(target_mass[t]) || softmax(scores[t]))`` over valid slots.

    ``target_mass``, ``scores``, ``valid``: ``[rows, K]``; ``row_weight``: ``[rows]``. Rows without a
    valid slot contribute 0.
    """
    has_slot = valid.any(-1)
    mass = target_mass.masked_fill(~valid, 0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    log_pred = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    per_slot = torch.xlogy(target, target) - target * log_pred.masked_fill(~valid, 0)
    per_row = per_slot.masked_fill(~valid, 0).sum(-1)
    return (per_row * (row_weight * has_slot)).sum()


FUSED_MAX_K = 4096
"""Most slots per row the fused pass takes (the row is one tile of registers); wider rows run the reference."""


def fused_serves(scores: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the fused Triton pass serves ``scores`` (and the ``others``, the target and row weights): CUDA
    fp32 tensors, ``scores`` ``[rows, K]`` with ``K`` within one tile (:data:`FUSED_MAX_K`), triton
    installed."""
    return (HAS_TRITON and scores.dim() == 2 and scores.shape[1] <= FUSED_MAX_K
            and all(t.is_cuda and t.dtype == torch.float32 for t in (scores, *others)))


class _FusedKL(torch.autograd.Function):
    """Per-row KL terms from the fused pass, differentiable in ``scores`` through the saved gradient."""

    @staticmethod
    def forward(ctx, target_mass, scores, valid, row_weight, with_grad: bool):
        from dsv4cp.kernels.indexer_kl_triton import kl_rows_triton  # lazy: imports triton

        row_loss, dscores = kl_rows_triton(target_mass.detach(), scores.detach(), valid, row_weight.detach(),
                                           with_grad=with_grad)
        ctx.save_for_backward(dscores)
        return row_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        (dscores,) = ctx.saved_tensors  # kept whenever a backward can reach here (``with_grad``)
        return None, grad_rows[:, None] * dscores, None, None, None


def fused_kl_rows(target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor,
                  row_weight: torch.Tensor) -> torch.Tensor:
    """``[rows]`` fp32: each row's ``row_weight * KL`` term (:func:`kl_distillation`'s, before its sum) from
    the fused Triton pass, differentiable in ``scores`` (``target_mass`` and ``row_weight`` get none).

    ``target_mass``, ``scores``: ``[rows, K]`` fp32; ``valid``: ``[rows, K]`` bool, the slots scored;
    ``row_weight``: ``[rows]`` fp32. The score gradient is computed in the forward when grad mode is on
    and ``scores`` requires grad, and saved (``[rows, K]`` fp32)."""
    with_grad = torch.is_grad_enabled() and scores.requires_grad
    note_eager("indexer_kl", "triton")
    if torch.compiler.is_compiling():  # one opaque node: .indexer_kl_library
        return torch.ops.dsv4cp.indexer_kl_rows(target_mass, scores, valid, row_weight, with_grad)[0]
    return _FusedKL.apply(target_mass, scores, valid, row_weight, with_grad)


def indexer_kl(target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor,
               row_weight: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """:func:`kl_distillation`: a scalar, differentiable in ``scores``.

    ``impl``: ``"torch"`` (the reference) or ``"triton"`` (the fused pass where it serves the scores,
    :func:`fused_serves`, else the reference); default: the kernel option ``indexer_loss_kl``'s default. The fused
    pass notes ``indexer_kl`` -> ``triton``; the reference notes nothing (a compiled graph's code generated
    from it could not, :mod:`.custom_op_library`). Shapes as :func:`fused_kl_rows`; the reference takes any
    float dtype.
    """
    if impl is None:
        impl = kernel_options.OPTIONS["indexer_loss_kl"].default
    elif impl not in KL_IMPLS:
        raise ValueError(f"impl: must be one of {', '.join(map(repr, KL_IMPLS))}, got {impl!r}")
    if impl == "triton" and fused_serves(scores, target_mass, row_weight):
        return fused_kl_rows(target_mass, scores, valid, row_weight).sum()
    return kl_distillation(target_mass, scores, valid, row_weight)
