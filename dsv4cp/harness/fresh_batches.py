"""Timed steps on fresh batches: a point's steps cycle through N distinct batches, each step building
its batch's layout again (docs/design.md §5, "Repeated and fresh batches").

The layer keeps the per-batch layout (CP layout, gathered-row maps, RoPE tables) of the batches in use
(:mod:`dsv4cp.cp.layout_cache`), so steps repeated on one batch build it once: their time is a layer of
a deep model, whose layers share one layout. A one-layer model fed a new batch every step builds it in
every step. :class:`FreshBatches` measures that step: after each step it forgets the kept layouts
(:func:`~dsv4cp.cp.layout_cache.clear_layouts`), as a training loop drops the batch it is done with (and
the cache its layout), so in the next step the layer's :func:`~dsv4cp.cp.layout_cache.layout_for` takes
its miss path and builds the layout of the batch it meets. Clearing is needed because the cache keeps up
to :data:`~dsv4cp.cp.layout_cache.MAX_LAYOUTS` layouts: a cycle of fewer batches would otherwise hit.
After the step, not before the next, as a training loop's host frees what it is done with: the next
step's start holds only what that step does.

The batches are built before timing (no data generation in the timed steps) and held throughout:
batch 0 is the point's own step; batch ``b >= 1`` has the same documents (the point's packing and
seed give the same lengths: the same work, the same model bound and split, so the fresh-batch time
differs from the repeated one by what the batch changes, not by other documents), its own offset
tensors, and its own input rows and upstream gradient, drawn from a device generator seeded
``seed * INPUT_SEED_STRIDE + b * cp + rank + 1`` (batch 0's formula, :mod:`dsv4cp.harness.build`,
continued: distinct per batch and rank). The layer (weights, gradients) is shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from dsv4cp.cp.comm import group_size_and_rank
from dsv4cp.cp.layout_cache import clear_layouts
from dsv4cp.harness.build import INPUT_SEED_STRIDE, LayerStep
from dsv4cp.layer import AttentionOutput

__all__ = ["FreshBatches", "batch_bytes", "batch_seed", "fresh_batches"]


def batch_bytes(rows: int, hidden: int, dtype: torch.dtype, backward: bool) -> int:
    """Device bytes one more batch holds on a rank of ``rows`` rows: its ``[rows, hidden]`` input rows and
    upstream gradient, and the input's gradient when ``backward`` (its offsets are negligible)."""
    return (3 if backward else 2) * rows * hidden * dtype.itemsize


@dataclass
class FreshBatches:
    """Call it to run the next batch's step (cycling), then forget every kept layout. Built by
    :func:`fresh_batches`, which forgets them once first, so that every call builds its layout."""

    steps: list[LayerStep]
    """One step per batch, sharing one layer; ``steps[0]`` is the point's own step."""
    last: LayerStep | None = field(default=None, init=False)
    """The step that ran last (its inputs' gradients, for the finiteness check)."""
    _next: int = field(default=0, init=False)

    def __call__(self) -> AttentionOutput:
        step = self.steps[self._next]
        self._next = (self._next + 1) % len(self.steps)
        self.last = step
        try:
            return step()
        finally:
            clear_layouts()  # this batch is done with: the next step meets no kept layout


def fresh_batches(step: LayerStep, count: int, seed: int) -> FreshBatches:
    """``count`` (>= 2) batches for ``step``'s layer (see the module docstring): ``step`` itself, then
    ``count - 1`` built here with copies of its offsets and rows drawn from ``seed``, the seed ``step`` was
    built with (:func:`dsv4cp.harness.build.build_step`); forgets every kept layout. ``ValueError`` naming
    ``fresh_batches`` for a count below 2."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise ValueError(f"fresh_batches: the steps cycle through at least 2 batches, got {count!r}")
    cp, rank = group_size_and_rank(step.cp_group)
    device, (rows, hidden), dtype = step.x.device, step.x.shape, step.x.dtype
    steps = [step]
    for batch in range(1, count):
        # new offset tensors of the same documents (validated once more: one host read, before timing)
        packed = dataclasses.replace(step.packed, cu_seqlens=step.packed.cu_seqlens.clone(),
                                     cu_seqlens_padded=step.packed.cu_seqlens_padded.clone())
        inputs = torch.Generator(device=device).manual_seed(batch_seed(seed, batch, cp, rank))
        x = torch.randn(rows, hidden, generator=inputs, device=device, dtype=dtype).requires_grad_(step.backward)
        upstream = torch.randn(rows, hidden, generator=inputs, device=device, dtype=dtype)
        steps.append(LayerStep(step.layer, packed, x, upstream, step.backward, step.cp_group, step.split))
    clear_layouts()  # a layout kept from an earlier step on batch 0 would meet the first call
    return FreshBatches(steps)


def batch_seed(seed: int, batch: int, cp: int, rank: int) -> int:
    """The seed of rank ``rank``'s input rows in batch ``batch`` of ``cp`` ranks: batch 0's is
    :func:`~dsv4cp.harness.build.build_step`'s ``seed * INPUT_SEED_STRIDE + rank + 1``."""
    return seed * INPUT_SEED_STRIDE + batch * cp + rank + 1
