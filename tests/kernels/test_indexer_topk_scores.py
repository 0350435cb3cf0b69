"""The indexer top-k's scores by-product (``indexer_topk(..., return_scores=True)``): the chosen rows'
scores returned with them, so the indexer loss need not score them again.

CPU (Triton's interpreter, tiny multi-document CP layouts from :func:`test_indexer_triton.make_case`):

* the Triton chunked path, every selection (``radix`` with each kernel variant, ``torch`` over packed
  keys or fp32 scores) and both planners: the rows are the ones selected without ``return_scores`` and
  the scores are BITWISE the score buffer's values at them (the same chunks re-scored by
  :func:`~dsv4cp.kernels.indexer_triton.iter_score_chunks`), 0.0 in the ``-1`` slots;
* the torch reference path: the same rows as without the flag, scores matching the differentiable
  :func:`~dsv4cp.ops.indexer.indexer_scores` at them (another summation order: to fp32 rounding);
* the streaming path runs chunked when scores are asked for; a non-bool flag is refused.

GPU (marked ``gpu``): bf16 at T = 8192 with flash head sizes, the radix selection of both kernels.
Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp import kernel_options
from dsv4cp.kernels.indexer_plan import (
    TOPK_BYTES_PER_SCORE,
    TOPK_RADIX_BYTES_PER_SCORE,
    TOPK_SCORES_BYTES_PER_SCORE,
)
from dsv4cp.kernels.indexer_triton import iter_score_chunks
from dsv4cp.ops.indexer import fused_indexer_topk, indexer_scores, indexer_topk
from triton_marks import HAS_CUDA, skip_module_without_triton

skip_module_without_triton()

from tests.kernels.test_indexer_triton import make_case, visible_of  # noqa: E402  (after the skip)

VIS = ("query_doc", "query_limit", "key_doc", "key_j")


def buffer_scores(case, chosen: torch.Tensor, per_score: int, **plan) -> torch.Tensor:
    """``[T, k]`` fp32: each chunk's fp32 score buffer (re-scored with the same plan: ``per_score``
    plans the path's chunks; a packed-key buffer holds these scores' bits) at the chosen rows, 0.0 at
    ``-1``."""
    expected = torch.zeros(chosen.shape, dtype=torch.float32, device=chosen.device)
    for s, e, col0, block in iter_score_chunks(case["q"], case["w"], case["keys"], *(case[n] for n in VIS),
                                               bytes_per_score=per_score, **plan):
        rows = chosen[s:e]
        cols = (rows - col0).clamp(0, block.shape[1] - 1)
        picked = block.gather(1, cols)
        inside = (rows >= col0) & (rows < col0 + block.shape[1])
        expected[s:e] = torch.where(inside & (rows >= 0), picked, expected[s:e])
    return expected


CASES = [
    ("radix", "bounded", "packed", TOPK_RADIX_BYTES_PER_SCORE),
    ("radix", "plain", "packed", TOPK_RADIX_BYTES_PER_SCORE),
    ("torch", "plain", "scores", TOPK_SCORES_BYTES_PER_SCORE),
    ("torch", "plain", "packed", TOPK_BYTES_PER_SCORE),
]


@pytest.mark.parametrize("select,variant,keys_mode,per_score", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("key_row_limit", [None, (0, 4)], ids=["exact-plan", "static-plan"])
def test_chunked_scores_are_the_buffer_values_bitwise(select, variant, keys_mode, per_score, key_row_limit, seed):
    """Normal inputs (distinct scores) on a 3-document layout, small chunks and budget: the rows equal
    the flagless call's and the scores are the buffers' bits at them."""
    if key_row_limit is not None:  # the static bound holds for one causal document (CP = 1)
        case = make_case(seed, 40, 3, 16, [10], 1, integer=False)
        pos = torch.arange(40)
        case.update(query_doc=torch.zeros(40, dtype=torch.int64), query_limit=(pos + 1) // 4,
                    key_doc=torch.zeros(10, dtype=torch.int64), key_j=torch.arange(10), keys=case["keys"][:10])
    else:
        case = make_case(seed, 40, 3, 16, [9, 14, 6], 2, integer=False)
    k = 5
    plan = {"chunk": 16, "budget_bytes": per_score * 16 * 24, "key_row_limit": key_row_limit}
    args = (case["q"], case["w"], case["keys"], *(case[n] for n in VIS), k)
    kwargs = {"impl": "chunked", "select": select, "keys_mode": keys_mode, "select_variant": variant, **plan}
    rows = fused_indexer_topk(*args, **kwargs)
    got_rows, scores = fused_indexer_topk(*args, return_scores=True, **kwargs)
    assert torch.equal(got_rows, rows), f"seed={seed}"
    assert (rows == -1).any() and (rows >= 0).any(), f"seed={seed}: both kinds of slot"
    expected = buffer_scores(case, rows, per_score, **plan)
    assert scores.dtype == torch.float32 and scores.shape == rows.shape
    assert torch.equal(scores.view(torch.int32), expected.view(torch.int32)), f"seed={seed}\n{scores}\n{expected}"
    assert torch.isfinite(scores).all() and (scores[rows < 0] == 0).all()


@pytest.mark.parametrize("variant", ["bounded", "plain"])
def test_radix_on_packed_documents_selects_what_torch_selects(variant, seed):
    """Integer inputs (exact scores, many ties) on a 4-document layout split over 3 ranks with empty
    slots: each row's radix select scans its own key range only (``row_range``) and still chooses what
    ``torch.topk`` over the packed keys chooses."""
    case = make_case(seed, 48, 3, 16, [7, 12, 5, 9], 3, integer=True)
    args = (case["q"], case["w"], case["keys"], *(case[n] for n in VIS), 6)
    expected = fused_indexer_topk(*args, impl="chunked", select="torch", keys_mode="packed", chunk=16)
    got = fused_indexer_topk(*args, impl="chunked", select="radix", select_variant=variant, chunk=16)
    assert (expected == -1).any() and (expected >= 0).any()
    assert torch.equal(got, expected), f"seed={seed}\n{got}\n{expected}"


def test_torch_reference_scores_match_the_differentiable_scores(seed):
    """The torch path (no visibility tensors): the same rows as without the flag, and scores equal to
    :func:`indexer_scores` at them within fp32 rounding (each sums in its own order)."""
    case = make_case(seed, 24, 3, 16, [8, 12], 2, integer=False)
    vis = visible_of(case)
    q, w, keys = case["q"], case["w"], case["keys"]
    rows = indexer_topk(q, w, keys, lambda sl: vis[sl], 6)
    got_rows, scores = indexer_topk(q, w, keys, lambda sl: vis[sl], 6, return_scores=True)
    assert torch.equal(got_rows, rows)
    again = indexer_scores(q, w, keys, rows).detach()
    mask = rows >= 0
    assert mask.any() and (~mask).any()
    torch.testing.assert_close(scores[mask], again[mask], rtol=1e-5, atol=1e-5)
    assert (scores[~mask] == 0).all()


def test_stream_runs_chunked_for_scores_and_bad_flag_is_named(seed, monkeypatch):
    case = make_case(seed, 24, 2, 16, [10], 1, integer=False)
    args = (case["q"], case["w"], case["keys"], *(case[n] for n in VIS), 4)
    kernel_options.reset_backends_ran()
    rows, scores = fused_indexer_topk(*args, impl="stream", return_scores=True)
    assert kernel_options.backends_ran()["indexer_topk"].startswith("triton/chunked/")
    assert torch.equal(rows, fused_indexer_topk(*args, impl="stream"))
    with pytest.raises(ValueError, match="return_scores"):
        fused_indexer_topk(*args, impl="chunked", return_scores=1)
    vis = visible_of(case)
    with pytest.raises(ValueError, match="return_scores"):
        indexer_topk(case["q"], case["w"], case["keys"], lambda sl: vis[sl], 4, return_scores="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["bounded", "plain"])
def test_gpu_radix_scores_are_the_buffer_values(variant, seed):
    """bf16 at T = 8192 (Hi = 64, Di = 128, k = 512), static plan as in the layer: bitwise the buffers'."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, hi, di = 8192, 64, 128
    pos = torch.arange(t, device="cuda")
    case = {"q": torch.randn(t, hi, di, device="cuda", generator=gen).bfloat16(),
            "w": torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5,
            "keys": torch.randn(t // 4, di, device="cuda", generator=gen).bfloat16(),
            "query_doc": torch.zeros_like(pos), "query_limit": (pos + 1) // 4,
            "key_doc": torch.zeros(t // 4, dtype=torch.int64, device="cuda"),
            "key_j": torch.arange(t // 4, device="cuda")}
    args = (case["q"], case["w"], case["keys"], *(case[n] for n in VIS), 512)
    rows, scores = fused_indexer_topk(*args, impl="chunked", select="radix", select_variant=variant,
                                      key_row_limit=(0, 4), return_scores=True)
    expected = buffer_scores(case, rows, TOPK_RADIX_BYTES_PER_SCORE, key_row_limit=(0, 4))
    assert torch.equal(scores.view(torch.int32), expected.view(torch.int32)), f"seed={seed}"
