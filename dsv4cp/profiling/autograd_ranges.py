"""Backward-pass phase ranges for regions that autograd builds itself (DESIGN 5, NVTX).

Custom autograd functions wrap their own backward in ``nvtx_range``. For a region of ordinary ops
(a projection, the compressor) ``BackwardRegion`` puts two identity nodes on its boundary: the one
on the region's output opens the phase's range when its gradient arrives, the one on the input
closes it once the input's gradient is complete. The two nodes are added whether or not ranges are
on (they then do nothing), so switching ranges cannot change the graph, nor the order in which
gradients are summed: numerics stay bitwise identical.
"""

from __future__ import annotations

import torch

from dsv4cp.profiling.nvtx import Span, nvtx_range


class _SpanMarkerInBackward(torch.autograd.Function):
    """Identity whose backward calls ``action`` (a span's ``open`` or ``close``) when its gradient arrives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, action) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.action()
        return grad, None


class BackwardRegion:
    """Marks ``phase`` (e.g. ``"compress.bwd"``) around the backward of the ops between
    ``region.input(x)`` and ``region.output(y)``."""

    def __init__(self, phase: str) -> None:
        self._span = Span(phase)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return _SpanMarkerInBackward.apply(x, self._span.close) if x.requires_grad else x

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return _SpanMarkerInBackward.apply(y, self._span.open) if y.requires_grad else y


def phase_region(phase: str, fn, x: torch.Tensor, *args):
    """``fn(x, *args)`` inside range ``{phase}.fwd``, its backward inside ``{phase}.bwd``."""
    region = BackwardRegion(f"{phase}.bwd")
    with nvtx_range(f"{phase}.fwd"):
        return region.output(fn(region.input(x), *args))
