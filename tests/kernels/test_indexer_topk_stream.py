"""Streaming indexer top-k against the torch op :func:`dsv4cp.ops.indexer.indexer_topk`.

The streaming kernel scores and selects in one pass; its output must be IDENTICAL to the torch op's:
the same key rows, in increasing order, ``-1`` padding past a row's visible count, ties at the cut to
the lowest key rows. Exactness is checked where scores are exact in any summation order
(integer-valued inputs: many exact ties and exact-zero scores), so any difference is a selection bug.

CPU (Triton's interpreter, fp32, tiny sizes):

* random multi-document layouts with rank-major gathered keys and empty slots, k not a power of two,
  k above the visible count, k above the tile width (the running list longer than a tile);
* real CP layouts (``build_layout``, enlarged key capacity), with the static causal bound
  (``key_row_limit``) and with the device-side exact key ranges; neither reads tensor data on the host;
* launch tiles (multi-tile, wide tiles), Triton's own ``tl.sort`` path (what the GPU runs), strided
  inputs, normal (non-integer) inputs within rounding of the reference;
* the ``DSV4CP_TOPK_IMPL`` / ``impl`` switch and bad input raising ``ValueError`` naming the field.

GPU (marked ``gpu``): integer-valued fp32 inputs identical to the reference; bf16 flash shapes (Hi = 64,
Di = 128, k = 512) equivalent to the reference up to near-ties, and to the chunked Triton path.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout, entry_capacity, split_rows
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.indexer_plan import query_limits
from dsv4cp.kernels.indexer_topk_triton import MAX_STREAM_K, indexer_topk_stream
from dsv4cp.kernels.indexer_triton import IndexerConfig
from dsv4cp.ops.indexer import fused_indexer_topk as indexer_topk_triton
from dsv4cp.ops.indexer import indexer_topk
from dsv4cp.packing import PackedSeqs
from host_reads import HostReads
from kernels.test_indexer_triton import (
    assert_equivalent_selection,
    chunked_scores,
    gpu_case,
    make_case,
    reference_scores,
    reference_topk,
)
from test_indexer_topk_prefix import layout_inputs
from triton_marks import needs_cuda, skip_module_without_triton

CFG = DSv4Config.preset("tiny")

skip_module_without_triton()


def stream(case, k: int, **kw) -> torch.Tensor:
    return indexer_topk_stream(case["q"], case["w"], case["keys"], case["query_doc"], case["query_limit"],
                               case["key_doc"], case["key_j"], k, **kw)


# ---------------------------------------------------------------------------------------------- CPU tests
CASES = [  # (t, hi, di, entries per document, cp)
    (24, 4, 32, [9, 5, 14], 3),
    (17, 2, 16, [20, 3], 2),
    (40, 3, 16, [50], 1),
]


@pytest.mark.parametrize("t,hi,di,entries,cp", CASES)
def test_identical_to_torch_with_exact_ties(t, hi, di, entries, cp, seed):
    """k = 1, 3, 9, 17, 40: powers of two and not, below and above the 16-row tile (a running list
    of 16 or of 64 keys), and above most rows' visible counts (-1 padding)."""
    case = make_case(seed, t, hi, di, entries, cp, integer=True)
    scores = reference_scores(case)
    finite = scores[torch.isfinite(scores)]
    assert (finite == 0).any(), f"seed={seed}: the case must hold exact-zero scores"
    short = 0
    for k in (1, 3, 9, 17, 40):
        ref = reference_topk(case, k)
        got = stream(case, k)
        assert got.dtype == torch.int64 and got.shape == (t, k), f"seed={seed} k={k}"
        assert torch.equal(got, ref), f"seed={seed} k={k}: selections differ\n{got}\n{ref}"
        short += int(((ref == -1).any(1) & (ref[:, 0] >= 0)).sum())
    assert short > 0, f"seed={seed}: no row with fewer than k visible keys was tested"


def test_ties_across_tiles_go_to_the_lowest_key_rows(seed):
    """Every key duplicated 3 times over the buffer (rows far apart, in other tiles): the scores of the
    copies tie exactly, and the cut must keep the lowest rows, as the torch op does."""
    case = make_case(seed, 20, 2, 16, [30], 1, integer=True)
    keys = case["keys"]
    g = keys.shape[0]
    case["keys"] = keys[torch.arange(g) % (g // 3)].contiguous()
    case["key_doc"] = torch.zeros(g, dtype=torch.int64)
    case["key_j"] = torch.arange(g)
    case["query_limit"] = torch.full_like(case["query_limit"], g)  # every query sees every key
    case["query_doc"] = torch.zeros_like(case["query_doc"])
    for k in (2, 5, 16):
        ref = reference_topk(case, k)
        assert torch.equal(stream(case, k), ref), f"seed={seed} k={k}"


@pytest.mark.parametrize("cfg", [(16, 32, 4, 1), (32, 16, 4, 1), (16, 64, 4, 1)], ids=str)
def test_launch_tiles_do_not_change_the_selection(cfg, seed):
    case = make_case(seed, 40, 2, 16, [25, 30], 2, integer=True)
    for k in (5, 40):
        assert torch.equal(stream(case, k, config=IndexerConfig(*cfg)), reference_topk(case, k)), \
            f"seed={seed} cfg={cfg} k={k}"


def test_triton_sort_path_is_identical(seed):
    """``tl.sort`` / ``tl.bitonic_merge`` (what compiled kernels use; slow under the interpreter: one
    small case) against the vectorised network and the torch op."""
    case = make_case(seed, 16, 2, 16, [40], 1, integer=True)
    ref = reference_topk(case, 20)  # a 32-key running list over 16-key tiles: sort, both merges
    assert torch.equal(stream(case, 20, native_sort=True), ref), f"seed={seed}"
    assert torch.equal(stream(case, 20, native_sort=False), ref), f"seed={seed}"


def test_normal_inputs_within_rounding_of_the_reference(seed):
    case = make_case(seed, 24, 4, 32, [9, 5, 14], 3, integer=False)
    scores = reference_scores(case)
    for k in (3, 8):
        assert_equivalent_selection(stream(case, k), reference_topk(case, k), scores, 1e-5,
                                    f"seed={seed} k={k}", min_identical=0.8)


def test_strided_inputs_and_int32_metadata(seed):
    case = make_case(seed, 20, 3, 32, [9, 7], 2, integer=True)
    ref = reference_topk(case, 4)
    q = case["q"].permute(0, 2, 1).contiguous().permute(0, 2, 1)  # last dim strided
    ints = {n: case[n].to(torch.int32) for n in ("query_doc", "query_limit", "key_doc", "key_j")}
    got = stream(dict(case, q=q, w=case["w"].t().contiguous().t(), **ints), 4)
    assert torch.equal(got, ref), f"seed={seed}"


CP_PACKINGS = [([9, 13, 2], 24), ([5, 0, 18, 1], 24), ([24], 24), ([1, 2, 3, 1, 2], 24)]


def layout_case(lay, gen: torch.Generator) -> dict:
    """Integer-valued inputs on a CP rank's layout (exact scores: identical selections required)."""
    q, w, keys = layout_inputs(lay, gen)
    doc, pos = lay.local_doc, lay.local_pos
    return dict(q=q, w=w, keys=keys, query_doc=doc, query_limit=query_limits(doc, pos),
                key_doc=lay.gathered_doc, key_j=lay.gathered_j)


@pytest.mark.parametrize("lengths,total", CP_PACKINGS)
@pytest.mark.parametrize("cp,extra", [(1, 0), (2, 3), (3, 0)])
def test_cp_layouts_static_bound_and_device_ranges(lengths, total, cp, extra, seed):
    """Every rank of real CP layouts (rank-major gathered keys, capacity padding, enlarged by ``extra``
    rows): the static causal bound and the device-side key ranges both select what the torch op does,
    and neither reads tensor data on the host."""
    gen = torch.Generator().manual_seed(seed)
    pk = PackedSeqs.from_lengths(lengths, total=total)
    rows, _ = split_rows(total, cp, CFG, 4)
    for rank in range(cp):
        lay = build_layout(pk, CFG, 4, rank, cp, capacity=entry_capacity(rows, 4) + extra)
        case = layout_case(lay, gen)
        vis = lay.visible_mask(lay.local_doc, lay.local_pos)
        for k in (2, 7):
            ref = indexer_topk(case["q"], case["w"], case["keys"], lambda sl, vis=vis: vis[sl], k)
            with HostReads() as reads:
                static = stream(case, k, key_row_limit=lay.key_row_limit)
                ranged = stream(case, k)
            assert not reads.events, reads.report()
            msg = f"seed={seed} rank={rank}/{cp} k={k}"
            assert torch.equal(static, ref), f"{msg}: static bound"
            assert torch.equal(ranged, ref), f"{msg}: device key ranges"


def test_impl_switch_env_and_fallback(monkeypatch, seed):
    case = make_case(seed, 12, 2, 16, [14], 1, integer=True)
    args = [case[n] for n in ("q", "w", "keys", "query_doc", "query_limit", "key_doc", "key_j")]
    ref = reference_topk(case, 4)
    for impl in ("stream", "chunked"):
        assert torch.equal(indexer_topk_triton(*args, 4, impl=impl), ref), f"seed={seed} impl={impl}"
        monkeypatch.setenv("DSV4CP_TOPK_IMPL", impl)
        got = indexer_topk_triton(*args, 4, options=KernelOptions.resolve())
        assert torch.equal(got, ref), f"seed={seed} env={impl}"
    monkeypatch.setenv("DSV4CP_TOPK_IMPL", "radix")
    with pytest.raises(ValueError, match="^DSV4CP_TOPK_IMPL:.*'radix'"):
        KernelOptions.resolve()
    with pytest.raises(ValueError, match="^impl:.*'fast'"):
        indexer_topk_triton(*args, 4, impl="fast")
    monkeypatch.delenv("DSV4CP_TOPK_IMPL")
    big = MAX_STREAM_K + 1  # too long a running list for the stream kernel: the chunked path serves it
    got = indexer_topk_triton(*args, big)
    assert got.shape == (12, big) and torch.equal(got, reference_topk(case, big)), f"seed={seed}"


def test_invalid_arguments_raise_naming_the_field(monkeypatch, seed):
    case = make_case(seed, 6, 2, 16, [5], 1, integer=True)
    with pytest.raises(ValueError, match="^k:"):
        stream(case, 0)
    with pytest.raises(ValueError, match="^k:.*at most"):
        stream(case, MAX_STREAM_K + 1)
    with pytest.raises(ValueError, match="^q:"):
        stream(dict(case, q=case["q"].double()), 2)
    with pytest.raises(ValueError, match="^key_j:"):
        stream(dict(case, key_j=case["key_j"][1:]), 2)
    with pytest.raises(ValueError, match="^key_row_limit:"):
        stream(case, 2, key_row_limit=(0, 0))
    with pytest.raises(ValueError, match="block_n"):
        stream(case, 2, config=IndexerConfig(16, 24, 4, 1))
    monkeypatch.setenv("DSV4CP_TRITON_TOPK_STREAM_CONFIG", "16,16")
    with pytest.raises(ValueError, match="^DSV4CP_TRITON_TOPK_STREAM_CONFIG:"):
        KernelOptions.resolve()


# ---------------------------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_exact_ties_identical(seed):
    case = make_case(seed, 600, 8, 64, [40, 90, 10], 3, integer=True, device="cuda")
    k = 40  # one compile (a 64-key running list); the bf16 test runs the 512-key one
    assert torch.equal(stream(case, k), reference_topk(case, k)), f"seed={seed} k={k}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("docs", [[8192], [3000, 100, 5000, 92]], ids=["one-doc", "four-docs"])
def test_gpu_bf16_flash_shapes(docs, seed):
    """bf16, Hi = 64, Di = 128, k = 512: equivalent to the torch op up to near-ties (bf16 products
    rounded to fp32 in another order), and to the chunked Triton path."""
    case = gpu_case(seed, 8192, docs)
    k = 512
    got = stream(case, k)
    scores = chunked_scores(case)
    assert_equivalent_selection(got, reference_topk(case, k), scores, 1e-3, f"seed={seed}", min_identical=0.5)
    chunked = indexer_topk_triton(*(case[n] for n in ("q", "w", "keys", "query_doc", "query_limit",
                                                      "key_doc", "key_j")), k, impl="chunked")
    assert_equivalent_selection(got, chunked, scores, 1e-3, f"seed={seed} vs chunked", min_identical=0.5)
