"""The token compressor of C and H layers (docs/design.md §1.4): gated per-channel pooling of r-token groups."""

from __future__ import annotations

import torch
from torch import nn

from dsv4cp.config import layer_kind
from dsv4cp.cp.layout import RankLayout
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.layer.hadamard import hadamard_rotate
from dsv4cp.layer.norm import RMSNorm
from dsv4cp.layer.precision import PrecisionPinned
from dsv4cp.ops.compress_pool import compress_pool
from dsv4cp.ops.norm_rope import rope_tail


class Compressor(PrecisionPinned):
    """Pools groups of ``ratio`` tokens of the layer input into one ``dim``-wide entry each.

    Ratio 4 overlaps: every projection has two halves (A, B) and entry j pools the A halves of group
    j-1 with the B halves of group j under one softmax per channel. Parameters: ``wkv``, ``wgate``
    (``hidden -> coff * dim``), ``ape`` (fp32 ``[ratio, coff * dim]``, a bias by position in the
    group) and ``norm``; the pooling is the op :func:`dsv4cp.ops.compress_pool.compress_pool` (a fused
    Triton kernel on CUDA). The indexer's compressor also applies the Hadamard rotation. ``ape`` stays
    fp32 (or finer) under module casts, see :mod:`dsv4cp.layer.precision`.
    """

    pinned_dtypes = {"ape": torch.float32}

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float, rotate: bool = False):
        super().__init__()
        self.dim, self.ratio, self.rotate = dim, ratio, rotate
        self.overlap = layer_kind(ratio) == "C"
        width = (2 if self.overlap else 1) * dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x_ext: torch.Tensor, layout: RankLayout, freqs: torch.Tensor,
                options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
        """``x_ext [E, hidden]`` (halo + own rows) -> this rank's owned entries ``[capacity, dim]``
        (zero rows in unused slots), normalised and rotated at each group's first position; ``options``:
        the layer's kernel options."""
        # The pooling runs in fp32 inside the op; its result is fp32 (fp64 for fp64 rows). Every group
        # starts at a document position that is a multiple of r, so the bias by slot equals the bias by
        # position ``ext_pos % r``.
        pooled = compress_pool(self.wkv(x_ext), self.wgate(x_ext), self.ape, layout.group_rows, layout.group_valid)
        # rope_tail: one fused kernel on CUDA where the torch rotation launches ~15 small ones each way
        entries = rope_tail(self.norm(pooled)[:, None], layout.group_pos, freqs, options=options)[:, 0].to(x_ext.dtype)
        if self.rotate:
            entries = hadamard_rotate(entries)
        return entries * layout.group_valid[:, None].to(entries.dtype)
