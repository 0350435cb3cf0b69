"""The CP step the spawned-rank tests share: a tiny layer with seeded random weights, this rank's slice of
seeded input rows, the forward over the world's process group and the loss the tests back-propagate."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.harness.build import randomize_


def seeded_cp_forward(rank: int, world: int, packed: PackedSeqs, ratio: int, seed: int, **layer_options):
    """(layer, x_local, result, loss) of the tiny preset's layer at CP = ``world`` on rank ``rank``: weights
    and the whole batch's input drawn from one generator seeded ``seed`` (the same on every rank), the
    rank's contiguous rows as a leaf that takes a gradient, and ``loss = sum(out^2) + indexer loss``."""
    cfg = DSv4Config.preset("tiny")
    generator = torch.Generator().manual_seed(seed)
    layer = DSv4Attention(cfg, ratio, **layer_options)
    randomize_(layer, generator)
    x = torch.randn(packed.total, cfg.hidden, generator=generator)
    rows = packed.total // world
    x_local = x[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    result = layer(x_local, packed, dist.group.WORLD)
    loss = result.out.square().sum() + (result.indexer_loss if result.indexer_loss is not None else 0)
    return layer, x_local, result, loss
