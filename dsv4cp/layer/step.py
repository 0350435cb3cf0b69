"""The timed training step of one layer (docs/design.md §5): what ``layer``, ``profile``, every sweep
point, the layer benchmarks and the CPU partition measurements time.

A step is the layer's forward on this rank's rows, then, unless forward only, one backward seeded
directly with a fixed random upstream gradient of the output and ``d/d(indexer_loss) = 1``: the
gradients of ``sum(out * upstream) + indexer_loss`` without any loss kernel in the step. The forward
records the autograd graph in both cases (a training forward; parameters require gradients).

:func:`build_step` makes everything the step needs from one seed, the same way on every caller:
the layer's weights from :func:`dsv4cp.cp.check.randomize_` (the parity check's, every parameter
non-trivial) on a CPU generator seeded ``seed``; this rank's input rows, then its upstream gradient,
from one generator on the device seeded ``seed * 65_537 + rank + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4cp.config import DSv4Config
from dsv4cp.cp.check import randomize_
from dsv4cp.cp.comm import group_size_and_rank
from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.layer.attention import AttentionOutput, DSv4Attention
from dsv4cp.packing import PackedSeqs

INPUT_SEED_STRIDE = 65_537
"""Rank ``r``'s rows come from a generator seeded ``seed * INPUT_SEED_STRIDE + r + 1``: distinct per
rank and per seed, and never the weights' seed."""


@dataclass
class LayerStep:
    """One training step of ``layer`` on this rank's rows; call it to run the step.

    Gradients accumulate across calls into ``x.grad`` and the parameters' ``.grad`` (as in a CUDA-graph
    replay); zero them between steps when the values matter.
    """

    layer: DSv4Attention
    packed: PackedSeqs
    """The whole batch's documents, on the layer's device."""
    x: torch.Tensor
    """``[rows, hidden]`` this rank's input rows, in the layer's dtype; requires grad when ``backward``."""
    upstream: torch.Tensor
    """``[rows, hidden]`` the fixed gradient of the output seeded into the backward, in the layer's dtype."""
    backward: bool
    """Run the backward after the forward (False: forward only)."""
    cp_group: dist.ProcessGroup | None = None
    """The CP group (None: one rank)."""
    split: RowSplit | None = None
    """The ranks' row ranges (None: equal slices)."""

    def __call__(self) -> AttentionOutput:
        """Run the step; returns the forward's output (its tensors keep no graph after a backward)."""
        result = self.layer(self.x, self.packed, cp_group=self.cp_group, split=self.split)
        if self.backward:
            outputs, seeds = [result.out], [self.upstream]
            if result.indexer_loss is not None:
                outputs, seeds = outputs + [result.indexer_loss], seeds + [None]  # None: d/d(loss) = 1
            torch.autograd.backward(outputs, seeds)
        return result


def build_step(
    cfg: DSv4Config, ratio: int, packed: PackedSeqs, *, seed: int, backward: bool,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "auto",
    overlap: str = "none", recompute: bool = False, cp_group: dist.ProcessGroup | None = None,
    split: RowSplit | None = None, rank: int | None = None, kernel_options: KernelOptions | None = None,
) -> LayerStep:
    """The seeded step of a layer of ``cfg`` at compression ``ratio`` on ``packed`` (see the module docstring).

    ``rank``: whose rows of ``split`` (default: equal slices of ``packed.total`` over the group) to
    draw, with its input generator; default: this process's rank in ``cp_group`` (0 without one).
    ``backend``, ``overlap``, ``recompute`` and ``kernel_options`` (resolved once by the caller; None: the
    layer resolves them) go to :class:`DSv4Attention`. ``ValueError`` naming
    ``rank`` for a rank outside the split, before anything is built.
    """
    device = torch.device(device)
    cp, group_rank = group_size_and_rank(cp_group)
    rank = group_rank if rank is None else rank
    if split is None:
        split = RowSplit.equal(packed.total, cp)
    if not 0 <= rank < split.cp:
        raise ValueError(f"rank: must be in [0, {split.cp}) of the split's ranks, got {rank}")
    layer = DSv4Attention(cfg, ratio, backend=backend, overlap=overlap, recompute=recompute,
                          kernel_options=kernel_options)
    randomize_(layer, torch.Generator().manual_seed(seed))
    layer = layer.to(device=device, dtype=dtype)
    rows = split.rows(rank)
    inputs = torch.Generator(device=device).manual_seed(seed * INPUT_SEED_STRIDE + rank + 1)
    x = torch.randn(rows, cfg.hidden, generator=inputs, device=device, dtype=dtype).requires_grad_(backward)
    upstream = torch.randn(rows, cfg.hidden, generator=inputs, device=device, dtype=dtype)
    return LayerStep(layer, packed.to(device), x, upstream, backward, cp_group, split)
