"""The orthonormal Hadamard rotation of the lightning indexer (docs/design.md §1.5)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def _hadamard(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"index_head_dim: the Hadamard rotation needs a power of two, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * dim**-0.5).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dim with ``H`` the Sylvester Hadamard matrix scaled to be orthonormal."""
    return x @ _hadamard(x.shape[-1], x.dtype, x.device)
