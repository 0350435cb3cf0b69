"""The per-rank layouts of the packed batches in use, built once per batch (docs/design.md §3.1).

:func:`dsv4cp.cp.layout.build_layout` launches ~80 tiny kernels. At the start of a step nothing else
is queued, so the GPU idles for all of their launch time (~2 ms per layer on an H200). The layout
depends only on the batch's offsets and sizes, so every layer of a model (and every step repeated on
one batch) can share it: :func:`layout_for` builds it on first use and hands the same
:class:`~dsv4cp.cp.layout.RankLayout` to later calls on the same batch.

"The same batch" means the same :class:`~dsv4cp.packing.PackedSeqs` object whose offset tensors were
not written since (their autograd version counters, bumped by every in-place write such as
``copy_``). A batch's layouts are dropped with the batch (a weak reference: the cache keeps no batch
alive), and at most :data:`MAX_LAYOUTS` are kept. Layouts are rebuilt, not reused, while a CUDA graph
is being captured (the graph must hold the layout kernels, so that a replay after new offsets are
copied in computes the new layout) and while ``torch.compile`` traces the layer.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import RankLayout, build_layout
from dsv4cp.cp.partition import RowSplit
from dsv4cp.packing import PackedSeqs

__all__ = ["MAX_LAYOUTS", "clear_layouts", "layout_for"]

MAX_LAYOUTS = 8
"""Layouts kept, least recently used dropped first: every layer kind (W, C, H) of a model on a batch or two."""


class _Entry(NamedTuple):
    packed: weakref.ref  # dead once the batch is gone; its callback then drops the entry
    versions: tuple[int, int]
    layout: RankLayout


_LAYOUTS: OrderedDict[tuple, _Entry] = OrderedDict()


def _versions(packed: PackedSeqs) -> tuple[int, int]:
    return packed.cu_seqlens._version, packed.cu_seqlens_padded._version


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def layout_for(
    packed: PackedSeqs, cfg: DSv4Config, compress_ratio: int, rank: int = 0, cp: int = 1,
    split: RowSplit | None = None,
) -> RankLayout:
    """``build_layout(packed, cfg, compress_ratio, rank, cp, split=split)``, built once per batch (see the
    module docstring); the returned tensors are shared by every caller: never write to them."""
    if torch.compiler.is_compiling() or _capturing(packed.cu_seqlens_padded.device):
        return build_layout(packed, cfg, compress_ratio, rank, cp, split=split)
    key = (id(packed), cfg, compress_ratio, rank, cp, None if split is None else split.bounds)
    entry = _LAYOUTS.get(key)
    if entry is not None and entry.packed() is packed and entry.versions == _versions(packed):
        _LAYOUTS.move_to_end(key)
        return entry.layout
    layout = build_layout(packed, cfg, compress_ratio, rank, cp, split=split)
    _LAYOUTS[key] = _Entry(weakref.ref(packed, lambda _ref, key=key: _drop(key)), _versions(packed), layout)
    _LAYOUTS.move_to_end(key)
    while len(_LAYOUTS) > MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)
    return layout


def _drop(key: tuple) -> None:
    """A batch was collected: forget its layout (unless a new batch at the same id replaced the entry)."""
    entry = _LAYOUTS.get(key)
    if entry is not None and entry.packed() is None:
        del _LAYOUTS[key]


def clear_layouts() -> None:
    """Forget every kept layout (frees their device memory)."""
    _LAYOUTS.clear()
