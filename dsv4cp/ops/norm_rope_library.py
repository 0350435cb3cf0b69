"""The fused norm / RoPE kernels (:mod:`dsv4cp.kernels.norm_rope_triton`) as ``torch.library`` custom ops.

Dynamo cannot trace the kernels' autograd functions (their launches pick tiles on the host), so
under ``torch.compile`` :func:`dsv4cp.ops.norm_rope.head_norm_rope` and :func:`~dsv4cp.ops.norm_rope.rope_tail`
call these opaque ops instead, with the kernel options in force as text (:mod:`.custom_op_library`):

* ``dsv4cp::head_norm_rope_fwd(x [rows, H, D], positions [rows], freqs [P/2], eps, options) -> (out, rstd)``
  with ``rstd [rows, H]`` fp32 (saved for, and read by, ``dsv4cp::head_norm_rope_bwd``); differentiable in x;
* ``dsv4cp::rope_tail(x, positions, freqs, inverse, options) -> out``, differentiable in x (its backward is
  itself, turning the other way).

Both run the same kernels, with the same launches, as the eager autograd functions.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.kernels import norm_rope_triton
from dsv4cp.ops.custom_op_library import options_from


@torch.library.custom_op("dsv4cp::head_norm_rope_fwd", mutates_args=())
def head_norm_rope_fwd(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, eps: float,
                       options: str) -> tuple[torch.Tensor, torch.Tensor]:
    norm_rope_triton._check(x, positions, freqs, eps)
    kernel_options.note_backend("norm_rope", "triton")
    with options_from(options):
        cos, sin = norm_rope_triton.rope_table(positions, freqs)
        return norm_rope_triton._rope_fwd(x, cos, sin, norm=True, inverse=False, eps=eps)


@head_norm_rope_fwd.register_fake
def _(x, positions, freqs, eps, options):
    return x.new_empty(x.shape), x.new_empty(x.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4cp::head_norm_rope_bwd", mutates_args=())
def head_norm_rope_bwd(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, positions: torch.Tensor,
                       freqs: torch.Tensor, options: str) -> torch.Tensor:
    with options_from(options):
        cos, sin = norm_rope_triton.rope_table(positions, freqs)
        return norm_rope_triton._norm_rope_bwd(grad.to(x.dtype), x, rstd, cos, sin)


@head_norm_rope_bwd.register_fake
def _(grad, x, rstd, positions, freqs, options):
    return x.new_empty(x.shape)


def _save_norm_rope(ctx, inputs, output) -> None:
    x, positions, freqs, _eps, options = inputs
    ctx.save_for_backward(x, output[1], positions, freqs)
    ctx.options = options
    ctx.mark_non_differentiable(output[1])


def _norm_rope_backward(ctx, grad, _drstd):
    x, rstd, positions, freqs = ctx.saved_tensors
    return head_norm_rope_bwd(grad, x, rstd, positions, freqs, ctx.options), None, None, None, None


head_norm_rope_fwd.register_autograd(_norm_rope_backward, setup_context=_save_norm_rope)


@torch.library.custom_op("dsv4cp::rope_tail", mutates_args=())
def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool,
              options: str) -> torch.Tensor:
    norm_rope_triton._check(x, positions, freqs)
    kernel_options.note_backend("rope_tail", "triton")
    with options_from(options):
        cos, sin = norm_rope_triton.rope_table(positions, freqs)
        return norm_rope_triton._rope_fwd(x, cos, sin, norm=False, inverse=inverse)[0]


@rope_tail.register_fake
def _(x, positions, freqs, inverse, options):
    return x.new_empty(x.shape)


def _save_rope_tail(ctx, inputs, output) -> None:
    _x, positions, freqs, inverse, options = inputs
    ctx.save_for_backward(positions, freqs)
    ctx.inverse, ctx.options = inverse, options


def _rope_tail_backward(ctx, grad):
    positions, freqs = ctx.saved_tensors  # the rotation is orthogonal: its backward turns by minus the angle
    return rope_tail(grad, positions, freqs, not ctx.inverse, ctx.options), None, None, None, None


rope_tail.register_autograd(_rope_tail_backward, setup_context=_save_rope_tail)
