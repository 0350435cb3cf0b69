"""The layouts kept per packed batch (:mod:`dsv4cp.cp.layout_cache`): built once, equal to a fresh build,
rebuilt after the offsets are written, dropped with the batch; and the layer's later steps on one
batch launch none of the layout's kernels.

CPU, random packings from the per-test ``seed``.
"""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY_C, make_layer
from dsv4cp.cp import layout_cache
from dsv4cp.cp.layout import RankLayout, build_layout
from dsv4cp.cp.layout_cache import MAX_LAYOUTS, clear_layouts, layout_for
from dsv4cp.cp.partition import RowSplit
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling import nvtx


def _random_packed(gen: torch.Generator, total: int, docs: int) -> PackedSeqs:
    cuts = torch.randperm(total - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return PackedSeqs.from_lengths([b - a for a, b in zip(bounds[:-1], bounds[1:])], total=total)


def _assert_same_layout(got: RankLayout, want: RankLayout) -> None:
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert other == value, name


def test_one_build_per_batch_equal_to_a_fresh_build(seed):
    clear_layouts()
    gen = torch.Generator().manual_seed(seed)
    packed = _random_packed(gen, 96, 7)
    split = RowSplit.equal(96, 2)
    for ratio in (0, 4, 8):
        for rank in range(2):
            first = layout_for(packed, TINY_C, ratio, rank, 2, split=split)
            assert layout_for(packed, TINY_C, ratio, rank, 2, split=split) is first
            _assert_same_layout(first, build_layout(packed, TINY_C, ratio, rank, 2, split=split))
    other = _random_packed(gen, 96, 3)  # another batch of the same sizes: its own layout
    assert layout_for(other, TINY_C, 4, 0, 2, split=split) is not layout_for(packed, TINY_C, 4, 0, 2, split=split)


def test_written_offsets_rebuild_the_layout(seed):
    clear_layouts()
    gen = torch.Generator().manual_seed(seed)
    packed, new = _random_packed(gen, 64, 5), _random_packed(gen, 64, 5)
    before = layout_for(packed, TINY_C, 4)
    with torch.no_grad():  # what a CUDA-graph replay on new data does: copy into the captured offsets
        packed.cu_seqlens.copy_(new.cu_seqlens)
        packed.cu_seqlens_padded.copy_(new.cu_seqlens_padded)
    after = layout_for(packed, TINY_C, 4)
    assert after is not before
    _assert_same_layout(after, build_layout(packed, TINY_C, 4))
    assert not torch.equal(after.ext_doc, before.ext_doc)  # the new offsets moved the documents


def test_layouts_go_with_their_batch_and_stay_bounded(seed):
    clear_layouts()
    gen = torch.Generator().manual_seed(seed)
    packed = _random_packed(gen, 64, 4)
    layout_for(packed, TINY_C, 4)
    assert len(layout_cache._LAYOUTS) == 1
    del packed
    gc.collect()
    assert not layout_cache._LAYOUTS
    batches = [_random_packed(gen, 64, 4) for _ in range(MAX_LAYOUTS + 3)]
    for pk in batches:
        layout_for(pk, TINY_C, 4)
    assert len(layout_cache._LAYOUTS) == MAX_LAYOUTS
    newest = layout_for(batches[-1], TINY_C, 4)
    assert layout_for(batches[-1], TINY_C, 4) is newest


class _PhaseOps(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside phase ``layout.fwd`` (a phase listener too)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.count = 0, 0

    def enter(self, phase: str) -> None:
        self.depth += phase == "layout.fwd"

    def exit(self, phase: str) -> None:
        self.depth -= phase == "layout.fwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth and not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _layout_ops_of_a_step(layer, x, packed) -> int:
    counter = _PhaseOps()
    previous = nvtx.set_phase_listener(counter)
    try:
        with counter:
            layer(x, packed)
    finally:
        nvtx.set_phase_listener(previous)
    return counter.count


def test_later_steps_on_one_batch_launch_no_layout_kernels(seed):
    """The first step builds the layout (~80 ops); a later step on the same batch only lowers the
    selected entries to key rows and joins the key buffer (13 ops)."""
    clear_layouts()
    gen = torch.Generator().manual_seed(seed)
    packed = _random_packed(gen, 64, 6)
    layer = make_layer(TINY_C, 4, seed, torch.float32)
    x = torch.randn(64, TINY_C.hidden, generator=gen)
    first = _layout_ops_of_a_step(layer, x, packed)
    later = _layout_ops_of_a_step(layer, x, packed)
    assert first > 60, first
    assert later <= 15, later
    fresh = _random_packed(gen, 64, 6)
    assert _layout_ops_of_a_step(layer, x, fresh) == first
