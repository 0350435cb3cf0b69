"""RMS normalisation, with and without a learned weight."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) (* weight)``, computed in fp32 (fp64 stays fp64)."""
    work = torch.promote_types(x.dtype, torch.float32)
    y = x.to(work)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(work)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight (named ``weight``, as in the checkpoints)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)
