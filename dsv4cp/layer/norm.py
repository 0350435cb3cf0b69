"""RMS normalisation with a learned weight (the module); the function is the op
:func:`dsv4cp.ops.norm_rope.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from dsv4cp.ops.norm_rope import rms_norm

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight (named ``weight``, as in the checkpoints)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)
