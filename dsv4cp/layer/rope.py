"""The frequencies of the partial, interleaved rotary embedding, with optional YaRN (docs/design.md §1.3); the
rotation itself is the op :func:`dsv4cp.ops.norm_rope.apply_rope`."""

from __future__ import annotations

import math

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.ops.norm_rope import apply_rope

__all__ = ["apply_rope", "rope_frequencies"]  # apply_rope: the op, kept importable beside its table


def rope_frequencies(cfg: DSv4Config, compress_ratio: int) -> torch.Tensor:
    """Angular frequencies ``w_i`` (fp64, ``[P/2]``) of the layer's one RoPE table.

    W layers: ``base^(-2i/P)``. C/H layers: the compressed base with YaRN's ramp between
    the original frequencies (fast dims) and frequencies divided by ``yarn_factor`` (slow dims).
    The layer's ``rope_freqs`` buffer keeps fp64 under module casts (:mod:`dsv4cp.layer.precision`): in
    bf16 a frequency is off by up to 0.4%, radians of angle between tokens thousands of positions apart.
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
