"""RMS normalisation and partial rotary embedding (docs/design.md §1.3): the torch references and the fused ops.

* :func:`rms_norm`, :func:`apply_rope`: the torch references (any device, any float dtype; a weighted
  :func:`rms_norm` on CUDA runs torch's fused kernel).
* :func:`head_norm_rope`: ``apply_rope(rms_norm(x, eps), positions, freqs)`` on the attention queries;
* :func:`rope_tail`: ``apply_rope(x, positions, freqs, inverse)`` on the attention outputs;
* :func:`rotate_tail_`: the same rotation in place, not differentiable (on a buffer the caller owns).

The last three take the call's kernel options (``options``, a
:class:`~dsv4cp.kernel_options.KernelOptions`: the launch pin ``triton_norm_rope_config``) and run the fused
Triton kernels of :mod:`dsv4cp.kernels.norm_rope_triton` where they serve
the input (:func:`use_fused`: CUDA, bf16 / fp16 / fp32, D a multiple of 16) and the references otherwise.
"""

from __future__ import annotations

import torch

from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.kernels import norm_rope_triton
from dsv4cp.kernels.norm_rope_triton import use_fused
from dsv4cp.ops.custom_op_library import note_eager

__all__ = ["apply_rope", "head_norm_rope", "rms_norm", "rope_tail", "rotate_tail_", "use_fused"]


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) (* weight)``, computed in fp32 (fp64 stays fp64), in x's dtype.

    On CUDA, with a weight, torch's fused RMS norm runs it (the same fp32 arithmetic in one kernel each
    way instead of ~7 forward and ~12 backward small ones, which leave the GPU waiting for their launches
    where the step has no long kernel queued): for bf16 / fp16 x with a weight of its dtype, and for fp32 x
    (a bf16 / fp16 weight is widened exactly)."""
    if weight is not None and x.is_cuda and _fused_norm_serves(x, weight):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    work = torch.promote_types(x.dtype, torch.float32)
    y = x.to(work)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(work)
    return y.to(x.dtype)


def _fused_norm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's fused RMS norm computes exactly what the reference computes: fp32 math on x and a
    weight of x's dtype (a narrower weight is widened to fp32 without rounding)."""
    if x.dtype == torch.float32:
        return weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * len(freqs)`` dims of ``x`` pairwise (2i, 2i+1) by ``positions * freqs``.

    Args:
        x: ``[..., rows, (heads,) D]``; ``positions``: ``[rows]`` document positions (any int dtype).
        inverse: rotate by minus the angle (undoes the rotation; used on attention outputs).
    Angles are formed in fp64 so large positions stay exact; the product runs in x's dtype (fp32 at least).
    """
    p = 2 * freqs.numel()
    angles = positions.to(torch.float64)[:, None] * freqs.to(positions.device)[None, :]
    if inverse:
        angles = -angles
    work = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    if x.dim() == 3:  # [rows, heads, D]: same angle for every head
        cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., -p:].to(work).unflatten(-1, (p // 2, 2))
    even, odd = rot[..., 0], rot[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-p], rotated.to(x.dtype)), dim=-1)


def head_norm_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, eps: float, *,
                   options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``apply_rope(rms_norm(x, eps), positions, freqs)`` of ``x [rows, H, D]`` (weightless per-head norm),
    differentiable in x; ``[rows, H, D]`` in x's dtype. Fused on CUDA: no fp32 copy kept for backward."""
    fused = use_fused(x, freqs)
    note_eager("norm_rope", "triton" if fused else "torch")
    if fused and torch.compiler.is_compiling():  # one opaque node: .norm_rope_library
        return torch.ops.dsv4cp.head_norm_rope_fwd(x, positions, freqs.detach(), float(eps),
                                                   list(options.triton_norm_rope_config or ()))[0]
    if fused:
        return norm_rope_triton.head_norm_rope(x, positions, freqs, eps, config=options.triton_norm_rope_config)
    return apply_rope(rms_norm(x, eps), positions, freqs)


def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, *,
              options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``apply_rope(x, positions, freqs, inverse)`` of ``x [rows, H, D]``, differentiable in x; fused on
    CUDA (rotates the tail in place of copying the whole tensor)."""
    fused = use_fused(x, freqs)
    note_eager("rope_tail", "triton" if fused else "torch")
    if fused and torch.compiler.is_compiling():  # one opaque node: .norm_rope_library
        return torch.ops.dsv4cp.rope_tail(x, positions, freqs.detach(), bool(inverse),
                                          list(options.triton_norm_rope_config or ()))
    if fused:
        return norm_rope_triton.rope_tail(x, positions, freqs, inverse=inverse, config=options.triton_norm_rope_config)
    return apply_rope(x, positions, freqs, inverse=inverse)


def rotate_tail_(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, *,
                 options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x[..., -P:] = apply_rope(x[..., -P:], positions, freqs, inverse)`` in place on ``x [rows, H, D]``
    (not differentiable; returns x). Fused on CUDA: only the last ``P`` dims are read and written."""
    if use_fused(x, freqs) and x.stride(2) == 1:
        return norm_rope_triton.rotate_tail_(x, positions, freqs, inverse=inverse,
                                             config=options.triton_norm_rope_config)
    tail = x[..., x.shape[-1] - 2 * freqs.numel():]
    tail.copy_(apply_rope(tail, positions, freqs, inverse=inverse))
    return x
