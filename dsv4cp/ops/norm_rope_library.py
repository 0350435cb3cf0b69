"""The fused norm / RoPE kernels (:mod:`dsv4cp.kernels.norm_rope_triton`) as ``torch.library`` custom ops.

Dynamo cannot trace the kernels' autograd functions (their launches pick tiles on the host), so
under ``torch.compile`` :func:`dsv4cp.ops.norm_rope.head_norm_rope` and :func:`~dsv4cp.ops.norm_rope.rope_tail`
call these opaque ops instead, with the launch pin (the kernel option ``triton_norm_rope_config``) as
``config: int[]`` (``[]``: the default rule):

* ``dsv4cp::head_norm_rope_fwd(x [rows, H, D], positions [rows], freqs [P/2], eps, config) -> (out, rstd)``
  with ``rstd [rows, H]`` fp32 (saved for, and read by, ``dsv4cp::head_norm_rope_bwd``); differentiable in x;
* ``dsv4cp::rope_tail(x, positions, freqs, inverse, config) -> out``, differentiable in x (its backward is
  itself, turning the other way).

Both run the same kernels, with the same launches, as the eager autograd functions.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.kernels import norm_rope_triton


def _pin(config: list[int]) -> norm_rope_triton.Config:
    """The custom ops' ``config`` as the kernels take it."""
    return tuple(config) or None


@torch.library.custom_op("dsv4cp::head_norm_rope_fwd", mutates_args=())
def head_norm_rope_fwd(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, eps: float,
                       config: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    norm_rope_triton._check(x, positions, freqs, eps)
    kernel_options.note_backend("norm_rope", "triton")
    cos, sin = norm_rope_triton.rope_table(positions, freqs)
    return norm_rope_triton._rope_fwd(x, cos, sin, norm=True, inverse=False, eps=eps, config=_pin(config))


@head_norm_rope_fwd.register_fake
def _(x, positions, freqs, eps, config):
    return x.new_empty(x.shape), x.new_empty(x.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4cp::head_norm_rope_bwd", mutates_args=())
def head_norm_rope_bwd(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, positions: torch.Tensor,
                       freqs: torch.Tensor, config: list[int]) -> torch.Tensor:
    cos, sin = norm_rope_triton.rope_table(positions, freqs)
    return norm_rope_triton._norm_rope_bwd(grad.to(x.dtype), x, rstd, cos, sin, _pin(config))


@head_norm_rope_bwd.register_fake
def _(grad, x, rstd, positions, freqs, config):
    return x.new_empty(x.shape)


def _save_norm_rope(ctx, inputs, output) -> None:
    x, positions, freqs, _eps, config = inputs
    ctx.save_for_backward(x, output[1], positions, freqs)
    ctx.config = config
    ctx.mark_non_differentiable(output[1])


def _norm_rope_backward(ctx, grad, _drstd):
    x, rstd, positions, freqs = ctx.saved_tensors
    return head_norm_rope_bwd(grad, x, rstd, positions, freqs, ctx.config), None, None, None, None


head_norm_rope_fwd.register_autograd(_norm_rope_backward, setup_context=_save_norm_rope)


@torch.library.custom_op("dsv4cp::rope_tail", mutates_args=())
def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool,
              config: list[int]) -> torch.Tensor:
    norm_rope_triton._check(x, positions, freqs)
    kernel_options.note_backend("rope_tail", "triton")
    cos, sin = norm_rope_triton.rope_table(positions, freqs)
    return norm_rope_triton._rope_fwd(x, cos, sin, norm=False, inverse=inverse, config=_pin(config))[0]


@rope_tail.register_fake
def _(x, positions, freqs, inverse, config):
    return x.new_empty(x.shape)


def _save_rope_tail(ctx, inputs, output) -> None:
    _x, positions, freqs, inverse, config = inputs
    ctx.save_for_backward(positions, freqs)
    ctx.inverse, ctx.config = inverse, config


def _rope_tail_backward(ctx, grad):
    positions, freqs = ctx.saved_tensors  # the rotation is orthogonal: its backward turns by minus the angle
    return rope_tail(grad, positions, freqs, not ctx.inverse, ctx.config), None, None, None, None


rope_tail.register_autograd(_rope_tail_backward, setup_context=_save_rope_tail)
