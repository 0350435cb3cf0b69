"""Kernel options (:mod:`dsv4cp.kernel_options`) in force through a region's backward as well as its
forward: the backward runs later, outside any ``with`` block around the forward call.

:func:`options_in_backward` puts an identity node on each of the region's outputs; the first of them
that receives its gradient enters ``kernel_options.overrides(values)``, and the end of that backward
pass (an autograd engine callback) leaves it, so every backward kernel of the region, and of what
autograd runs after it in the same pass, sees the values. Identity nodes (``view_as``) change no
numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsv4cp import kernel_options


class _BackwardScope:
    """``overrides(values)``, entered once per backward pass from the first output gradient, left when
    the pass ends."""

    def __init__(self, values: Mapping[str, object]) -> None:
        self.values = dict(values)
        self._active = None

    def enter(self) -> None:
        if self._active is None:
            self._active = kernel_options.overrides(self.values)
            self._active.__enter__()
            torch.autograd.Variable._execution_engine.queue_callback(self.leave)

    def leave(self) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.__exit__(None, None, None)


class _EnterInBackward(torch.autograd.Function):
    """Identity whose backward enters the scope before the gradient flows on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scope: _BackwardScope) -> torch.Tensor:
        ctx.scope = scope
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.scope.enter()
        return grad, None


def options_in_backward(outputs: tuple[torch.Tensor | None, ...],
                        values: Mapping[str, object]) -> tuple[torch.Tensor | None, ...]:
    """``outputs`` (None and tensors without grad pass through) such that the kernel options
    ``values`` hold while their backward runs; checked here. No ``values``: ``outputs`` unchanged."""
    if not values or torch.compiler.is_compiling():  # compiled kernels take the options as arguments
        return outputs
    kernel_options.check_values(values)
    scope = _BackwardScope(values)
    return tuple(_EnterInBackward.apply(y, scope) if isinstance(y, torch.Tensor) and y.requires_grad else y
                 for y in outputs)
