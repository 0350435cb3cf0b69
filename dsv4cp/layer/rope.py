"""Partial, interleaved rotary embedding with optional YaRN frequencies (DESIGN 1.3)."""

from __future__ import annotations

import math

import torch

from dsv4cp.config import DSv4Config


def rope_frequencies(cfg: DSv4Config, compress_ratio: int) -> torch.Tensor:
    """Angular frequencies ``w_i`` (fp64, ``[P/2]``) of the layer's one RoPE table.

    W layers: ``base^(-2i/P)``. C/H layers: the compressed base with YaRN's ramp between
    the original frequencies (fast dims) and frequencies divided by ``yarn_factor`` (slow dims).
    """
    p = cfg.rope_dim
    base = cfg.rope_base_for(compress_ratio)
    freqs = base ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)
    if compress_ratio == 0:
        return freqs

    def correction_dim(beta: float) -> float:
        return p * math.log(cfg.yarn_original_len / (2 * math.pi * beta)) / (2 * math.log(base))

    low = min(max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0), p - 1)
    high = min(max(math.ceil(correction_dim(cfg.yarn_beta_slow)), 0), p - 1)
    span = (high - low) if high != low else 1e-3
    ramp = ((torch.arange(p // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / cfg.yarn_factor * ramp


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
