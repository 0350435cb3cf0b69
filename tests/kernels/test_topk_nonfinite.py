"""The indexer top-k's rule for non-finite scores on every path (CPU: Triton's interpreter, tiny sizes):
a NaN or infinite score is never selected, as if its entry were invisible, so the streaming kernel,
the chunked Triton path and the torch op select the same rows (docs/design.md §4.5)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from conftest import seed_of
from dsv4cp.kernels.indexer_topk_triton import indexer_topk_stream
from dsv4cp.kernels.indexer_triton import indexer_topk_triton
from dsv4cp.ops.indexer import indexer_topk
from kernels.test_indexer_triton import make_case
from triton_marks import skip_module_without_triton

skip_module_without_triton()

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN

K = 4
NAN, INF = float("nan"), float("inf")


def _poisoned(case: dict, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, w, keys = case["q"].clone(), case["w"].clone(), case["keys"].clone()
    if what == "nan head weights":  # rows 2, 5, 11: every score NaN
        w[[2, 5, 11]] = NAN
    elif what == "-inf head weight":  # -inf or NaN (-inf * 0) scores on those rows
        w[[2, 5, 11], 0] = -INF
    elif what == "+inf keys":  # positive queries and weights: +inf scores at key rows 1, 4, 10
        q, w = q.abs(), w.abs()
        keys[[1, 4, 10]] = INF
    else:
        raise AssertionError(what)
    return q, w, keys


@pytest.mark.parametrize("what", ["nan head weights", "-inf head weight", "+inf keys"])
def test_every_path_skips_nonfinite_scores(what: str) -> None:
    case = make_case(seed_of("topk nonfinite", what), 24, 2, 16, [9, 7], 1, integer=True)
    q, w, keys = _poisoned(case, what)
    layout = (case["query_doc"], case["query_limit"], case["key_doc"], case["key_j"])
    qdoc, qlim, kdoc, kj = layout

    def visible(rows: slice) -> torch.Tensor:
        return (kdoc[None] == qdoc[rows, None]) & (qdoc[rows, None] >= 0) & (kj[None] < qlim[rows, None])

    want = indexer_topk(q, w, keys, visible, K)
    assert (want >= 0).any()
    for select, keys_mode in (("torch", "packed"), ("torch", "scores"), ("radix", "packed")):  # every chunked path
        assert torch.equal(indexer_topk_triton(q, w, keys, *layout, K, select=select, keys_mode=keys_mode), want), \
            (select, keys_mode)
    assert torch.equal(indexer_topk_stream(q, w, keys, *layout, K), want)
