"""The grouped low-rank output projection's first map (docs/design.md §1.2): ``y[:, g] = x[:, g] @ w[g]^T``.

* :func:`grouped_linear`: the map itself, ``[L, G, I] x [G, O, I] -> [L, G, O]``;
* :func:`head_group_projection`: the layer's use of it: the heads' outputs ``[L, H, D]``, each rotated
  back by minus its query's RoPE angle, grouped ``H / G`` consecutive heads at a time, then mapped.

``torch.einsum("lgi,goi->lgo")`` runs the map as one batched matmul over a group-major layout, so
autograd permutes ``x`` (all heads' outputs: 4 GiB at 64K tokens in the flash preset) and its gradient
into ``[G, L, I]`` copies and back, every step. Here each group is one
matmul that reads its ``[L, I]`` slice in place (rows ``G * I`` apart) and writes straight into its
slice of the ``[L, G, O]`` result (cuBLAS takes a leading dimension, so neither side is copied),
forward and backward. :func:`head_group_projection` also owns its input gradient, so the backward of
the RoPE rotation turns that buffer's last ``P`` dims in place (:func:`dsv4cp.ops.norm_rope.rotate_tail_`)
instead of writing a rotated copy of the whole gradient.

Under ``torch.compile`` both run as the einsum instead: Dynamo cannot trace a matmul into a strided
``out=`` slice (a graph break each), and the compiler plans the layouts of the map and its backward itself.
"""

from __future__ import annotations

import torch

from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.ops.norm_rope import rope_tail, rotate_tail_

__all__ = ["grouped_linear", "head_group_projection"]


class _GroupedLinear(torch.autograd.Function):
    """``x [L, H, D]`` (viewed as ``[L, G, H / G * D]``), rotated back by ``-positions * freqs`` on each
    head's last ``P`` dims first when ``positions`` is given; ``weight [G, O, H / G * D]``."""

    @staticmethod
    def forward(ctx, x, weight, positions, freqs, options):
        rows, groups = x.shape[0], weight.shape[0]
        if positions is not None:  # autograd is off here: a plain rotated copy
            x = rope_tail(x, positions, freqs, inverse=True, options=options)
        grouped = x.view(rows, groups, weight.shape[2])  # explicit width: zero rows are legal
        y = x.new_empty(rows, groups, weight.shape[1])
        for g in range(groups):
            torch.mm(grouped[:, g], weight[g].t(), out=y[:, g])
        ctx.save_for_backward(grouped, weight, positions, freqs)
        ctx.heads, ctx.options = x.shape[1:], options
        return y

    @staticmethod
    def backward(ctx, grad):
        grouped, weight, positions, freqs = ctx.saved_tensors
        grad = grad.to(grouped.dtype)
        dx = torch.empty_like(grouped) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for g in range(grouped.shape[1]):
            if dx is not None:
                torch.mm(grad[:, g], weight[g], out=dx[:, g])
            if dw is not None:
                torch.mm(grad[:, g].t(), grouped[:, g], out=dw[g])
        if dx is not None:
            dx = dx.view(grouped.shape[0], *ctx.heads)
            if positions is not None:  # the rotation by -angle is orthogonal: its backward turns by +angle
                rotate_tail_(dx, positions, freqs, inverse=False, options=ctx.options)
        return dx, dw, None, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, x_name: str, x_shape: str) -> None:
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight: must match {x_name}'s dtype and device ({x.dtype}, {x.device}), got "
                         f"({weight.dtype}, {weight.device})")
    if x.dim() != 3 or weight.dim() != 3:
        raise ValueError(f"{x_name}, weight: must be {x_shape} and [G, O, I], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y[l, g] = weight[g] @ x[l, g]`` for every group ``g``, differentiable in both.

    Args:
        x: ``[L, G, I]`` (any layout; copied once unless its rows are contiguous ``[G, I]`` blocks).
        weight: ``[G, O, I]``, x's dtype and device.
    Returns:
        ``[L, G, O]`` contiguous, x's dtype; equal to ``torch.einsum("lgi,goi->lgo", x, weight)``.
    """
    _check(x, weight, "x", "[L, G, I]")
    if weight.shape[0] != x.shape[1] or weight.shape[2] != x.shape[2]:
        raise ValueError(
            f"weight: must be [G={x.shape[1]}, O, I={x.shape[2]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if torch.compiler.is_compiling():
        return torch.einsum("lgi,goi->lgo", x, weight)
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:  # the per-group rows must view as [L, G * I]
        x = x.contiguous()
    return _GroupedLinear.apply(x, weight, None, None, DEFAULT_OPTIONS)


def head_group_projection(
    heads: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The output projection's first map: ``y[l, g] = weight[g] @ concat_{h in g} R(-positions[l]) heads[l, h]``
    with ``R`` the partial RoPE rotation of :func:`dsv4cp.ops.norm_rope.apply_rope` (the heads of group
    ``g`` are ``g * H / G ... (g + 1) * H / G - 1``), differentiable in ``heads`` and ``weight``.

    Args:
        heads: ``[L, H, D]`` attention outputs (any layout with a contiguous last dim; copied otherwise).
        weight: ``[G, O, H / G * D]``, heads' dtype and device (``G`` divides ``H``).
        positions: ``[L]`` integer document positions; ``freqs``: ``[P / 2]`` angular frequencies, ``P <= D``.
        options: the kernel options of the rotation (:func:`dsv4cp.ops.norm_rope.rope_tail`), both directions.
    Returns:
        ``[L, G, O]`` contiguous, heads' dtype; equal to :func:`grouped_linear` of ``rope_tail(heads,
        positions, freqs, inverse=True)`` reshaped to ``[L, G, H / G * D]``.
    """
    _check(heads, weight, "heads", "[L, H, D]")
    rows, h, d = heads.shape
    groups = weight.shape[0]
    if groups == 0 or h % groups or weight.shape[2] != h // groups * d:
        raise ValueError(f"weight: must be [G, O, H / G * D] with G dividing H={h} (D={d}), got {tuple(weight.shape)}")
    if not isinstance(positions, torch.Tensor) or positions.shape != (rows,):
        raise ValueError(f"positions: must be a [L={rows}] tensor, got {getattr(positions, 'shape', positions)}")
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 1 or not 0 < 2 * freqs.numel() <= d:
        raise ValueError(f"freqs: must be a [P/2] tensor with 2 <= P <= D={d}, got {getattr(freqs, 'shape', freqs)}")
    if torch.compiler.is_compiling():
        turned = rope_tail(heads, positions, freqs, inverse=True, options=options)
        turned = turned.reshape(rows, groups, weight.shape[2])
        return torch.einsum("lgi,goi->lgo", turned, weight)
    if heads.stride(2) != 1 and d > 1:
        heads = heads.contiguous()
    return _GroupedLinear.apply(heads, weight, positions, freqs.detach(), options)
