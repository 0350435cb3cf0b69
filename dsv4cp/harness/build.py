"""The one seeded builder of a Case's layer and inputs, and the one objective every pass back-propagates.

Everything comes from ``case.seed``, the same way on every caller (the timed step, the parity check,
the replay check, the layer benchmarks):

- the layer's weights: :func:`randomize_` (every parameter non-trivial) on a CPU generator seeded
  ``seed``, then the cast to the Case's device and dtype;
- rank ``r``'s input rows, then its upstream gradient, from one generator on the device seeded
  ``seed * INPUT_SEED_STRIDE + r + 1`` (:func:`rank_inputs`); the whole batch's inputs are the ranks'
  rows in order (:func:`batch_inputs`), so the reference that checks a CP run sees exactly its inputs.

The objective (:func:`backward_`): one backward seeded directly with the upstream gradient of the
output and ``d/d(indexer_loss) = 1``, the gradients of ``sum(out * upstream) + indexer_loss`` without
any loss kernel in the step. The forward records the autograd graph in both directions (a training
forward; parameters require gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4cp.cp.comm import group_size_and_rank
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.case import Case
from dsv4cp.layer.attention import AttentionOutput, DSv4Attention
from dsv4cp.packing import PackedSeqs

INPUT_SEED_STRIDE = 65_537
"""Rank ``r``'s rows come from a generator seeded ``seed * INPUT_SEED_STRIDE + r + 1``: distinct per
rank and per seed, and never the weights' seed."""


def randomize_(layer: DSv4Attention, generator: torch.Generator) -> None:
    """Give every parameter a non-trivial value (sinks, biases by position, norm weights too)."""
    with torch.no_grad():
        layer.reset_parameters(generator)
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif name.endswith("attn_sink") or name.endswith("ape"):
                param.copy_(0.5 * noise)


def build_layer(case: Case, device: torch.device | str | None = None) -> DSv4Attention:
    """The Case's layer with its seeded weights, on ``device`` (default: the Case's) in the Case's dtype."""
    layer = DSv4Attention(case.cfg, case.ratio, backend=case.backend, overlap=case.overlap, recompute=case.recompute,
                          kernel_options=case.kernel_options)
    randomize_(layer, torch.Generator().manual_seed(case.seed))
    return layer.to(device=torch.device(device if device is not None else case.device), dtype=case.torch_dtype)


def rank_inputs(case: Case, split: RowSplit, rank: int,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, upstream)``, both ``[rows of rank, hidden]`` in the Case's dtype: rank ``rank``'s input rows
    under ``split`` and the gradient of the output the objective seeds (module docstring)."""
    device = torch.device(device if device is not None else case.device)
    rows, hidden, dtype = split.rows(rank), case.cfg.hidden, case.torch_dtype
    generator = torch.Generator(device=device).manual_seed(case.seed * INPUT_SEED_STRIDE + rank + 1)
    x = torch.randn(rows, hidden, generator=generator, device=device, dtype=dtype)
    upstream = torch.randn(rows, hidden, generator=generator, device=device, dtype=dtype)
    return x, upstream


def batch_inputs(case: Case, split: RowSplit,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, upstream)`` of the whole batch: every rank's :func:`rank_inputs` under ``split``, in rank order."""
    parts = [rank_inputs(case, split, rank, device) for rank in range(split.cp)]
    return torch.cat([x for x, _ in parts]), torch.cat([up for _, up in parts])


def one_rank_inputs(case: Case, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, upstream)`` of the whole batch as one rank draws it, whatever the Case's split: the same batch
    at every CP degree (what a replay slices)."""
    return rank_inputs(case, RowSplit.equal(case.rows(), 1), 0, device)


def backward_(result: AttentionOutput, upstream: torch.Tensor) -> None:
    """The objective's backward: ``upstream`` into the output, 1 into the indexer loss (module docstring)."""
    outputs, seeds = [result.out], [upstream]
    if result.indexer_loss is not None:
        outputs, seeds = outputs + [result.indexer_loss], seeds + [None]  # None: d/d(loss) = 1
    torch.autograd.backward(outputs, seeds)


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
            backward_(result, self.upstream)
        return result


def build_step(case: Case, *, cp_group: dist.ProcessGroup | None = None, rank: int | None = None,
               device: torch.device | str | None = None) -> LayerStep:
    """The Case's seeded training step on rank ``rank`` of ``cp_group`` (module docstring).

    ``rank``: whose rows of the Case's split (default: equal slices over the group's ranks) to draw, with
    its input generator; default: this process's rank in ``cp_group`` (0 without one). ``device``: where this rank runs
    (default: the Case's device type). ``ValueError`` naming ``rank`` for a rank outside the split,
    before anything is built.
    """
    device = torch.device(device if device is not None else case.device)
    cp, group_rank = group_size_and_rank(cp_group)
    rank = group_rank if rank is None else rank
    split = case.row_split(len(case.split) - 1 if case.split is not None else cp)  # a split names its ranks
    if not 0 <= rank < split.cp:
        raise ValueError(f"rank: must be in [0, {split.cp}) of the split's ranks, got {rank}")
    layer = build_layer(case, device)
    x, upstream = rank_inputs(case, split, rank, device)
    return LayerStep(layer, case.packed(device), x.requires_grad_(case.backward), upstream, case.backward,
                     cp_group, split)


def build_case(case: Case, device: torch.device | str | None = None,
               ) -> tuple[DSv4Attention, PackedSeqs, torch.Tensor, torch.Tensor]:
    """``(layer, packed, x, upstream)`` of the Case on one rank: its seeded layer, its batch on ``device``
    (default: the Case's) and the whole batch's inputs and upstream gradient (no gradient required)."""
    x, upstream = one_rank_inputs(case, device)
    return build_layer(case, device), case.packed(device if device is not None else case.device), x, upstream
