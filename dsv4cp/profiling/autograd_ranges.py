"""Backward-pass phase ranges for regions that autograd builds itself (docs/design.md §5, NVTX).

Custom autograd functions wrap their own backward in ``nvtx_range``. For a region of ordinary ops
(a projection, the compressor) ``BackwardRegion`` puts identity nodes on its boundary: the one on
the region's output opens the phase's range when its gradient arrives, the one on the input closes
it once the input's gradient is complete. When no input requires grad (a region fed detached
tensors, trained only through its parameters), the region's backward ends where its parameters'
gradients are accumulated: the range closes after the last of those accumulations, and at the
latest when the backward pass ends, so no range is ever left open.

The identity nodes are added whether or not ranges are on (they then do nothing), so switching
ranges cannot change the graph, nor the order in which gradients are summed: numerics stay
bitwise identical. While ``torch.compile`` traces, no node is added (Dynamo cannot trace the walk over
``grad_fn`` nor the callbacks): a compiled region's backward has no phase range of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dsv4cp.profiling.nvtx import Span, nvtx_range


class _SpanMarkerInBackward(torch.autograd.Function):
    """Identity whose backward calls ``action`` (e.g. a span's ``open`` or ``close``) when its gradient arrives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.action()
        return grad, None


def _parameter_accumulators(outputs: Iterable[torch.Tensor]) -> list[torch.autograd.graph.Node]:
    """The gradient-accumulation nodes of the leaves that ``outputs`` were computed from.

    Only for regions whose inputs do not require grad: every path back from their outputs then ends
    at a leaf inside the region (a parameter), so the walk stays within the region.
    """
    seen: set[torch.autograd.graph.Node] = set()
    stack = [y.grad_fn for y in outputs]
    leaves = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf's gradient lands here
            leaves.append(node)
        else:
            stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _CloseAfterAccumulation:
    """Closes ``span`` once every node of ``accumulators`` has run, or when the backward pass ends."""

    def __init__(self, span: Span, accumulators: list[torch.autograd.graph.Node]) -> None:
        self._span, self._left = span, len(accumulators)
        self._handles = [node.register_hook(self._accumulated) for node in accumulators]
        self._fallback_queued = False

    def _accumulated(self, _grad_inputs, _grad_outputs) -> None:
        self._left -= 1
        if self._left == 0:
            self.finish()

    def open_span(self) -> None:
        """Called from backward, when the region's output gradient arrives."""
        self._span.open()
        if not self._fallback_queued:  # a parameter left out of this backward must not keep it open
            self._fallback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        self._span.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BackwardRegion:
    """Marks ``phase`` (e.g. ``"compress.bwd"``) around the backward of the ops between
    ``region.input(x)`` and ``region.output(y)`` (or ``region.outputs(y1, y2, ...)``)."""

    def __init__(self, phase: str) -> None:
        self._span = Span(phase)
        self._input_marked = False

    def input(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad or torch.compiler.is_compiling():
            return x
        self._input_marked = True
        return _SpanMarkerInBackward.apply(x, self._span.close)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.outputs(y)[0]

    def outputs(self, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The region's outputs, marked; call after every ``input`` of the region."""
        differentiable = [y for y in ys if y.requires_grad]
        if not differentiable or torch.compiler.is_compiling():
            return ys
        if self._input_marked:
            open_span = self._span.open
        else:
            open_span = _CloseAfterAccumulation(self._span, _parameter_accumulators(differentiable)).open_span
        return tuple(_SpanMarkerInBackward.apply(y, open_span) if y.requires_grad else y for y in ys)


def phase_region(phase: str, fn, x: torch.Tensor, *args):
    """``fn(x, *args)`` inside range ``{phase}.fwd``, its backward inside ``{phase}.bwd``."""
    region = BackwardRegion(f"{phase}.bwd")
    with nvtx_range(f"{phase}.fwd"):
        return region.output(fn(region.input(x), *args))
