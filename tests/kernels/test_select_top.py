"""The indexer's top-k tie rule (:func:`dsv4cp.kernels.contracts.select_top`) against a plain Python
ranking, on random scores with forced ties, signed zeros, -inf (invisible) entries and rows with fewer
finite scores than ``keep``."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.contracts import select_top


def _python_select(row: list[float], keep: int) -> list[int]:
    """Columns of the ``keep`` best finite scores, best first by (higher score, lower column), returned
    in increasing column order and padded with -1."""
    finite = [(score, col) for col, score in enumerate(row) if score != float("-inf")]
    best = sorted(finite, key=lambda sc: (-sc[0], sc[1]))[:keep]
    chosen = sorted(col for _, col in best)
    return chosen + [-1] * (keep - len(chosen))


@pytest.mark.parametrize("case", range(6))
def test_matches_python_ranking(case, seed):
    g = torch.Generator().manual_seed(seed + case)
    rows, cols, keep = 7, 53 + 17 * case, 1 + 5 * case
    scores = torch.randn(rows, cols, generator=g)
    scores = torch.where(torch.rand(rows, cols, generator=g) < 0.4, scores.round(), scores)  # many exact ties
    scores = torch.where(torch.rand(rows, cols, generator=g) < 0.2, torch.zeros(()), scores)  # +0.0 ties
    scores = torch.where(torch.rand(rows, cols, generator=g) < 0.1, -torch.zeros(()), scores)  # -0.0 == +0.0
    scores = torch.where(torch.rand(rows, cols, generator=g) < 0.3, float("-inf"), scores)
    scores[0, keep // 2:] = float("-inf")  # fewer finite scores than keep
    scores[1] = float("-inf")  # nothing visible
    expected = torch.tensor([_python_select(row, keep) for row in scores.tolist()])
    assert torch.equal(select_top(scores, keep), expected), f"seed {seed + case}"


def test_negative_scores_rank_below_zero_and_above_minus_inf(seed):
    scores = torch.tensor([[-3.0, float("-inf"), -0.5, 0.0, -1e-30, 2.0]])
    assert select_top(scores, 4).tolist() == [[2, 3, 4, 5]]
    assert select_top(scores, 6).tolist() == [[0, 2, 3, 4, 5, -1]]


def test_fp64_scores_are_ranked_exactly():
    """fp64 (the reference path) must not round to fp32: 1 + 1e-10 beats 1."""
    scores = torch.tensor([[1.0, 1.0 + 1e-10, 1.0, -0.0, 0.0]], dtype=torch.float64)
    assert select_top(scores, 1).tolist() == [[1]]
    assert select_top(scores, 4).tolist() == [[0, 1, 2, 3]]  # -0.0 ties +0.0: the lower column wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_scores_are_never_chosen(dtype):
    scores = torch.tensor([[1.0, float("inf"), 2.0, float("nan"), 0.5, -float("nan")]], dtype=dtype)
    assert select_top(scores, 3).tolist() == [[0, 2, 4]]
    assert select_top(scores, 5).tolist() == [[0, 2, 4, -1, -1]]


@pytest.mark.parametrize("keep", [-1, 7, 2.0, True])
def test_bad_keep_is_named(keep):
    with pytest.raises(ValueError, match="keep"):
        select_top(torch.zeros(2, 6), keep)
