"""The token compressor of C and H layers (docs/design.md §1.4): gated per-channel pooling of r-token groups."""

from __future__ import annotations

import torch
from torch import nn

from dsv4cp.config import layer_kind
from dsv4cp.cp.layout import RankLayout
from dsv4cp.layer.hadamard import hadamard_rotate
from dsv4cp.layer.norm import RMSNorm
from dsv4cp.layer.precision import PrecisionPinned
from dsv4cp.ops.norm_rope import apply_rope


class Compressor(PrecisionPinned):
    """Pools groups of ``ratio`` tokens of the layer input into one ``dim``-wide entry each.

    Ratio 4 overlaps: every projection has two halves (A, B) and entry j pools the A halves of group
    j-1 with the B halves of group j under one softmax per channel. Parameters: ``wkv``, ``wgate``
    (``hidden -> coff * dim``), ``ape`` (fp32 ``[ratio, coff * dim]``, a bias by position in the
    group) and ``norm``. The indexer's compressor also applies the Hadamard rotation. ``ape`` stays
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

    def forward(self, x_ext: torch.Tensor, layout: RankLayout, freqs: torch.Tensor) -> torch.Tensor:
        """``x_ext [E, hidden]`` (halo + own rows) -> this rank's owned entries ``[capacity, dim]``
        (zero rows in unused slots), normalised and rotated at each group's first position."""
        work = torch.promote_types(x_ext.dtype, torch.float32)  # pooling runs in fp32
        values = self.wkv(x_ext).to(work)
        gates = self.wgate(x_ext).to(work) + self.ape.to(work)[layout.ext_pos % self.ratio]
        rows = layout.group_rows  # [capacity, S]
        present = rows >= 0
        flat = rows.clamp_min(0).flatten()  # index_select: its backward is an index_add, not a sort
        values = values.index_select(0, flat).view(*rows.shape, values.shape[-1])
        gates = gates.index_select(0, flat).view(*rows.shape, gates.shape[-1])
        if self.overlap:  # slots [0, r) take half A of group j-1, slots [r, 2r) half B of group j
            r, d = self.ratio, self.dim
            values = torch.cat((values[:, :r, :d], values[:, r:, d:]), dim=1)
            gates = torch.cat((gates[:, :r, :d], gates[:, r:, d:]), dim=1)
        gates = gates.masked_fill(~present[..., None], float("-inf"))
        gates = gates.masked_fill(~layout.group_valid[:, None, None], 0.0)  # keep empty slots finite
        pooled = (torch.softmax(gates, dim=1) * values).sum(1)
        entries = apply_rope(self.norm(pooled), layout.group_pos, freqs).to(x_ext.dtype)
        if self.rotate:
            entries = hadamard_rotate(entries)
        return entries * layout.group_valid[:, None].to(entries.dtype)
