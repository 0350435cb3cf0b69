"""The grouped low-rank output projection's first map (docs/design.md §1.2): ``y[:, g] = x[:, g] @ w[g]^T``.

``torch.einsum("lgi,goi->lgo")`` runs it as one batched matmul over a group-major layout, so autograd
permutes ``x`` (all heads' outputs, ``[L, G, I]``: 4 GiB at 64K tokens in the flash preset) and its
gradient into ``[G, L, I]`` copies and back: 7.6 ms of copy kernels per step on an H200, more than
half the time of the matmuls themselves. Here each group is one matmul that reads its ``[L, I]``
slice in place (rows ``G * I`` apart) and writes straight into its slice of the ``[L, G, O]`` result
(cuBLAS takes a leading dimension, so neither side is copied), forward and backward.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_linear"]


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], x.shape[1], weight.shape[1])
        for g in range(x.shape[1]):
            torch.mm(x[:, g], weight[g].t(), out=y[:, g])
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for g in range(x.shape[1]):
            if dx is not None:
                torch.mm(grad[:, g], weight[g], out=dx[:, g])
            if dw is not None:
                torch.mm(grad[:, g].t(), x[:, g], out=dw[g])
        return dx, dw


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y[l, g] = weight[g] @ x[l, g]`` for every group ``g``, differentiable in both.

    Args:
        x: ``[L, G, I]`` (any layout whose last dim is contiguous).
        weight: ``[G, O, I]``, x's dtype and device.
    Returns:
        ``[L, G, O]`` contiguous, x's dtype; equal to ``torch.einsum("lgi,goi->lgo", x, weight)``.
    """
    if x.dim() != 3 or weight.dim() != 3:
        raise ValueError(f"x, weight: must be [L, G, I] and [G, O, I], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[0] != x.shape[1] or weight.shape[2] != x.shape[2]:
        raise ValueError(
            f"weight: must be [G={x.shape[1]}, O, I={x.shape[2]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight: must match x's dtype and device ({x.dtype}, {x.device}), got "
                         f"({weight.dtype}, {weight.device})")
    if x.stride(2) != 1 and x.shape[2] > 1:
        x = x.contiguous()
    return _GroupedLinear.apply(x, weight)
