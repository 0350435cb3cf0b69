"""Tables the model keeps in high precision whatever dtype the rest of the module is cast to.

DeepSeek-V4 keeps a few small tensors above the activation precision: the RoPE frequencies (fp64
here, built so), the per-head attention sink (fp32, docs/design.md §1.2) and the compressor's position bias
``ape`` (fp32, docs/design.md §1.4). A plain ``module.to(torch.bfloat16)`` (or ``.half()``, ``.bfloat16()``,
``.to(device, dtype)``) would round them too: in bf16 the RoPE frequencies are off by up to 0.4%,
tens of radians of angle between a query and a compressed key 64K tokens away.

:class:`PrecisionPinned` makes every such cast safe. A module lists its pinned tensors with a floor
dtype; any ``nn.Module._apply`` cast that would LOWER a pinned tensor below its floor instead casts
it, from its unrounded value, to the floor dtype, on the device the cast asked for. Casts that do not
lower precision (``.to(device)``, ``.double()``, ``.float()`` for fp32 tables) act as usual, so an
fp64 layer keeps fp64 everywhere (its sink and ``ape`` too): the rule is "never lower their
precision", and fp64 tests need every tensor in fp64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn


def _less_precise(dtype: torch.dtype, floor: torch.dtype) -> bool:
    """True when floating ``dtype`` has a coarser resolution than ``floor`` (bf16/fp16/fp8 vs fp32)."""
    return torch.finfo(dtype).eps > torch.finfo(floor).eps


class PrecisionPinned(nn.Module):
    """Mixin base for modules holding tables that casts must not round.

    Subclasses set :attr:`pinned_dtypes`, e.g. ``{"attn_sink": torch.float32}``: names of their own
    parameters or buffers (not of children: each child pins its own) and the least precise dtype each
    may be stored in. A parameter's ``.grad`` follows its parameter.
    """

    pinned_dtypes: ClassVar[dict[str, torch.dtype]] = {}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        floors: dict[int, torch.dtype] = {}  # id of a pinned tensor (or its grad) -> its floor dtype
        for name, floor in self.pinned_dtypes.items():
            tensor = self._parameters.get(name, self._buffers.get(name))
            if tensor is None:
                continue
            floors[id(tensor)] = floor
            if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
                floors[id(tensor.grad)] = floor

        def keep_precision(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            floor = floors.get(id(tensor))
            if floor is None or not applied.is_floating_point() or not _less_precise(applied.dtype, floor):
                return applied
            # ``applied`` has already lost digits: cast again from the unrounded tensor.
            return tensor.to(device=applied.device, dtype=floor)

        # Children receive the wrapped function too; it only acts on this module's own tensors (by id).
        return super()._apply(keep_precision, recurse)
