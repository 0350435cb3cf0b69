"""Every sorted lookup (``searchsorted`` / ``bucketize``) on the layer's path compiles under Inductor.

The failure seen on CUDA with torch 2.11 (``InductorError: NotImplementedError: SliceView``): Inductor's
lowering of ``searchsorted`` realises the boundary tensor and reads its stride (``_boundaries_helper``),
and a view of an unrealised computation (``rank_bounds[1:]``, a slice of a stacked tensor) stays a
``SliceView``, which has none (later versions turn such views into strided ones first). Inductor's C++
backend has no bucketize codegen (it falls back to ATen), so on CPU that lowering never runs; the
lowering it would get is what these tests pin instead: in the ATen graph Inductor receives (its own
decompositions, forward and backward), no boundary tensor of a lookup is the output of a view op.
Graph inputs are realised buffers with a stride (an offset view of one is fine), so they may be
boundaries. Then each lookup's function runs under ``torch.compile`` (Inductor) on offsets that are
views at a storage offset, with empty documents and padding, and equals eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.cp.mtp import rolled_source_valid
from dsv4cp.harness.build import build_case
from dsv4cp.harness.case import Case
from dsv4cp.kernels.indexer_plan import key_ranges
from dsv4cp.packing import PackedSeqs

CFG = DSv4Config.preset("tiny")
LOOKUPS = {torch.ops.aten.searchsorted.Tensor: 0, torch.ops.aten.bucketize.Tensor: 1}
"""Lookup op -> the position of its boundary (sorted sequence) argument."""


def _viewed_boundaries(graph: torch.fx.Graph) -> list[str]:
    """``"lookup <- view op"`` for each lookup whose boundaries come out of a view op."""
    found = []
    for node in graph.nodes:
        position = LOOKUPS.get(node.target)
        if position is None:
            continue
        source = node.args[position]
        if source.op == "call_function" and getattr(source.target, "is_view", False):
            found.append(f"{node.name} <- {source.target}")
    return found


def _inspecting_backend(seen: dict[str, list[str]]):
    """An AOTAutograd backend that records, per compiled graph, the lookups fed by views (and runs it)."""

    def inspect(gm: torch.fx.GraphModule, _example_inputs):
        lookups = [n for n in gm.graph.nodes if n.target in LOOKUPS]
        seen[f"graph{len(seen)}"] = _viewed_boundaries(gm.graph) + [f"lookups={len(lookups)}"]
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=inspect, bw_compiler=inspect, decompositions=select_decomp_table())


def _offset_view(offsets: torch.Tensor) -> torch.Tensor:
    """The same values as a view 3 elements into a tensor whose other elements are wrong offsets."""
    big = torch.cat([torch.full((3,), 999, dtype=offsets.dtype), offsets, torch.full((2,), -7, dtype=offsets.dtype)])
    return big[3 : 3 + offsets.numel()]


def _sliced_packing() -> tuple[PackedSeqs, PackedSeqs]:
    """``(packed, the same offsets as storage-offset views)``: empty documents, padding, a padded tail."""
    packed = PackedSeqs.from_lengths([5, 0, 37, 0, 21], pad_to_multiple=4, total=96)
    sliced = dataclasses.replace(packed, cu_seqlens=_offset_view(packed.cu_seqlens),
                                 cu_seqlens_padded=_offset_view(packed.cu_seqlens_padded))
    assert sliced.cu_seqlens_padded.storage_offset() == 3
    return packed, sliced


def _lookup_report(seen: dict[str, list[str]]) -> tuple[list[str], int]:
    """``(every view-fed lookup, how many lookups the graphs hold)``."""
    viewed = [entry for entries in seen.values() for entry in entries if not entry.startswith("lookups=")]
    count = sum(int(e.split("=")[1]) for entries in seen.values() for e in entries if e.startswith("lookups="))
    return viewed, count


@pytest.mark.parametrize("ratio", [0, 4])
def test_no_lookup_of_the_compiled_layer_reads_a_view(ratio, seed):
    layer, packed, x, weight = build_case(Case(lengths=(5, 60, 0, 31), total=96, ratio=ratio, seed=seed),
                                          torch.device("cpu"))
    seen: dict[str, list[str]] = {}
    torch._dynamo.reset()
    result = torch.compile(layer, backend=_inspecting_backend(seen))(x.clone().requires_grad_(), packed)
    objective = (result.out * weight).sum() + (0 if result.indexer_loss is None else result.indexer_loss)
    objective.backward()
    viewed, count = _lookup_report(seen)
    assert count >= (1 if ratio == 0 else 4), seen  # the document of every row; entries' documents and owners
    assert viewed == [], viewed


def test_no_lookup_of_the_compiled_layout_or_roll_reads_a_view():
    _, sliced = _sliced_packing()
    seen: dict[str, list[str]] = {}
    torch._dynamo.reset()
    for rank in range(2):
        torch.compile(build_layout, backend=_inspecting_backend(seen), dynamic=False)(sliced, CFG, 4, rank, 2)
    torch.compile(rolled_source_valid, backend=_inspecting_backend(seen), dynamic=False)(sliced, 2, 1, 32)
    viewed, count = _lookup_report(seen)
    assert count >= 2 * 4 + 1 and viewed == [], seen


def test_compiled_source_rows_of_the_roll_match_eager():
    packed, sliced = _sliced_packing()
    torch._dynamo.reset()
    compiled = torch.compile(rolled_source_valid, dynamic=False)  # the default backend: Inductor
    for depth, rank in ((1, 0), (3, 2)):
        want = rolled_source_valid(packed, depth, rank, 32)
        assert 0 < int(want.sum()) < want.numel()  # rows with and without a source
        assert torch.equal(compiled(sliced, depth, rank, 32), want), (depth, rank)


def test_compiled_key_ranges_match_eager(seed):
    gen = torch.Generator().manual_seed(seed)
    key_doc = torch.randint(-1, 3, (40,), generator=gen)
    key_j = torch.randint(0, 12, (40,), generator=gen)
    query_doc = torch.randint(-1, 3, (25,), generator=gen)
    query_limit = torch.randint(0, 14, (25,), generator=gen)
    want = key_ranges(query_doc, query_limit, key_doc, key_j)
    assert int((want[1] > want[0]).sum()) > 0 and int((want[1] == 0).sum()) > 0  # windows and empty ones
    torch._dynamo.reset()
    got = torch.compile(key_ranges, dynamic=False)(query_doc, query_limit, key_doc, key_j)
    for name, a, b in zip(("lo", "hi"), got, want):
        assert torch.equal(a, b), name
