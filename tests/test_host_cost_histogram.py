"""Host cost of a layer step on a histogram-packed batch (many short documents and a long one).

On a GPU the device idles while the host reads device data (a synchronisation) or runs Python between
short kernels; a per-document loop makes that grow with the batch's document count. On CPU, with the
recorder of :mod:`host_reads` and a count of the dispatched aten ops (each at least one kernel launch
on CUDA), one forward + backward of a C layer (both indexer-loss variants) and an H layer:

* reads tensor data on the host at most :data:`MOST_READS` times: the sparse-attention op's index
  check, a host check for CPU tensors only (on CUDA an asynchronous device assertion);
* dispatches exactly as many ops on a batch of :data:`MANY_DOCS` documents as on one document of the
  same rows: no work on the host per document;
* a second step on the same batch dispatches fewer ops than the first (its layout is kept,
  :mod:`dsv4cp.cp.layout_cache`), and no more than a step on a fresh batch minus the layout's.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY_C, cfg_for, make_layer
from dsv4cp.cp.layout_cache import clear_layouts
from dsv4cp.packing import PackedSeqs
from dsv4cp.workloads import load_histogram, sample_lengths
from host_reads import HostReads

TOTAL = 96
MANY_DOCS = 24
MOST_READS = 1
"""Host reads allowed per step on CPU: the index check of ``dsv4cp/ops/sparse_attention.py`` (``_require``)."""


def _histogram_packed(seed: int, total: int, docs: int) -> PackedSeqs:
    """``docs`` documents whose lengths follow the shipped histogram's shape, scaled to fill ``total``."""
    drawn = sample_lengths(load_histogram(), docs, random.Random(seed))
    spare = total - docs  # every document holds one row, the rest is shared in proportion
    lengths = [1 + spare * n // sum(drawn) for n in drawn]
    lengths[drawn.index(max(drawn))] += total - sum(lengths)
    return PackedSeqs.from_lengths(lengths, total=total)


class _OpCount(TorchDispatchMode):
    """The aten ops dispatched, views left out (no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _step(layer, x, packed, weight) -> None:
    res = layer(x, packed)
    loss = (res.out * weight).sum()
    if res.indexer_loss is not None:
        loss = loss + res.indexer_loss
    loss.backward()


def _layer(ratio: int, loss: str, seed: int):
    """A layer after one step (its one-time tables built), its input and output weight."""
    cfg = cfg_for(ratio, TINY_C, indexer_loss=loss)
    layer = make_layer(cfg, ratio, seed, torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOTAL, cfg.hidden, generator=gen).requires_grad_(True)
    weight = torch.randn(TOTAL, cfg.hidden, generator=gen)
    _step(layer, x, PackedSeqs.from_lengths([TOTAL // 2, TOTAL // 2]), weight)
    return layer, x, weight


def _ops_of_a_step(layer, x, packed, weight) -> int:
    """Ops of one step, gradients reset first (accumulating into existing ones adds ops)."""
    x.grad = None
    layer.zero_grad(set_to_none=True)
    counter = _OpCount()
    with counter:
        _step(layer, x, packed, weight)
    return counter.count


LAYERS = [(4, "sparse"), (4, "dense"), (8, "sparse")]


@pytest.mark.parametrize("ratio,loss", LAYERS)
def test_histogram_step_reads_the_device_at_most_once(ratio, loss, seed):
    clear_layouts()
    layer, x, weight = _layer(ratio, loss, seed)
    packed = _histogram_packed(seed, TOTAL, MANY_DOCS)
    assert packed.num_docs == MANY_DOCS
    with HostReads() as rec:
        _step(layer, x, packed, weight)
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert len(rec.events) <= MOST_READS, rec.report()
    assert all(r.made_in("dsv4cp/ops/sparse_attention.py", "_require") for r in rec.events), rec.report()


@pytest.mark.parametrize("ratio,loss", LAYERS)
def test_host_work_does_not_grow_with_the_documents(ratio, loss, seed):
    clear_layouts()
    layer, x, weight = _layer(ratio, loss, seed)
    one = PackedSeqs.from_lengths([TOTAL])
    many = _histogram_packed(seed, TOTAL, MANY_DOCS)
    ops_one, ops_many = _ops_of_a_step(layer, x, one, weight), _ops_of_a_step(layer, x, many, weight)
    assert ops_one == ops_many, f"{ops_one} ops on one document, {ops_many} on {MANY_DOCS}"


def test_a_later_step_on_the_batch_skips_the_layout(seed):
    clear_layouts()
    layer, x, weight = _layer(4, "sparse", seed)
    packed = _histogram_packed(seed, TOTAL, MANY_DOCS)
    first = _ops_of_a_step(layer, x, packed, weight)
    later = _ops_of_a_step(layer, x, packed, weight)
    fresh = _ops_of_a_step(layer, x, _histogram_packed(seed + 1, TOTAL, MANY_DOCS), weight)
    assert fresh == first
    assert first - later >= 60, f"the layout's ops: first step {first}, later step {later}"
