"""The Triton top-k's host planning (:mod:`dsv4cp.kernels.indexer_plan`) on CPU, without Triton or its
interpreter: key ranges against a brute-force scan of the visibility, both planners' chunks against
their contract (cover every row in order, hold every visible key, respect the budget), and their
limits' errors. A subprocess proves none of it imports triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4cp.kernels.indexer_plan import (
    TOPK_BYTES_PER_SCORE,
    aligned_columns,
    check_chunking,
    key_ranges,
    plan_chunks,
    plan_static_chunks,
    query_limits,
)

ROOT = Path(__file__).resolve().parents[2]


def random_visibility(seed: int, t: int, docs: int, per_doc: int):
    """Queries in random documents (some none) at random positions; keys of each document in entry
    order, interleaved across documents with empty slots (a CP rank-major gathered buffer)."""
    gen = torch.Generator().manual_seed(seed)
    key_doc = torch.arange(docs).repeat_interleave(per_doc)
    key_j = torch.arange(per_doc).repeat(docs)
    order = torch.argsort(torch.rand(key_doc.numel(), generator=gen) + key_j * 1.0, stable=True)  # j-sorted
    key_doc, key_j = key_doc[order], key_j[order]
    empty = torch.rand(key_doc.numel(), generator=gen) < 0.2
    key_doc[empty] = -1
    qdoc = torch.randint(-1, docs, (t,), generator=gen)
    pos = torch.randint(0, 4 * per_doc + 8, (t,), generator=gen)
    return qdoc, query_limits(qdoc, pos), key_doc, key_j


def visible(qdoc, qlim, key_doc, key_j) -> torch.Tensor:
    return (qdoc[:, None] >= 0) & (key_doc[None, :] == qdoc[:, None]) & (key_j[None, :] < qlim[:, None])


def test_query_limits():
    doc = torch.tensor([0, 0, -1, 2, 1])
    pos = torch.tensor([0, 3, 40, 8, 11])
    assert query_limits(doc, pos).tolist() == [0, 1, 0, 2, 3]
    assert query_limits(doc, pos, ratio=2).tolist() == [0, 2, 0, 4, 6]


def test_key_ranges_hold_exactly_the_visible_rows(seed):
    qdoc, qlim, key_doc, key_j = random_visibility(seed, 70, 3, 15)
    lo, hi = key_ranges(qdoc, qlim, key_doc, key_j)
    mask = visible(qdoc, qlim, key_doc, key_j)
    rows = torch.arange(key_doc.numel())
    for t in range(qdoc.numel()):
        seen = rows[mask[t]]
        want = (0, 0) if seen.numel() == 0 else (int(seen.min()), int(seen.max()) + 1)
        assert (int(lo[t]), int(hi[t])) == want, f"seed={seed} query {t}"


@pytest.mark.parametrize("budget,max_rows", [(2**30, None), (TOPK_BYTES_PER_SCORE * 40, None), (2**30, 7)])
def test_exact_plan_covers_every_row_and_visible_key_within_budget(seed, budget, max_rows):
    qdoc, qlim, key_doc, key_j = random_visibility(seed, 150, 4, 12)
    lo, hi = key_ranges(qdoc, qlim, key_doc, key_j)
    plan = plan_chunks(lo, hi, budget, max_rows)
    assert [c[0] for c in plan] == [0] + [c[1] for c in plan[:-1]] and plan[-1][1] == qdoc.numel()
    mask = visible(qdoc, qlim, key_doc, key_j)
    for start, stop, col0, width in plan:
        rows = stop - start
        assert rows * width * TOPK_BYTES_PER_SCORE <= budget or rows == 1, (start, stop, width)
        assert max_rows is None or rows <= max_rows
        outside = mask[start:stop].clone()
        outside[:, col0:col0 + width] = False
        assert not outside.any(), f"seed={seed}: chunk {start}:{stop} misses a visible key"


def test_static_plan_contains_the_causal_window(seed):
    t, g, base, ratio = 200, 60, 3, 4
    for budget in (2**30, TOPK_BYTES_PER_SCORE * 300):
        plan = plan_static_chunks(t, g, (base, ratio), budget)
        assert [c[0] for c in plan] == [0] + [c[1] for c in plan[:-1]] and plan[-1][1] == t
        for start, stop, col0, width in plan:
            assert col0 == 0 and width == min(g, base + (stop - 1) // ratio + 1)
            assert (stop - start) * width * TOPK_BYTES_PER_SCORE <= budget or stop - start == 1
    assert plan_static_chunks(t, g)[0][3] == g  # no causal bound: every key row
    assert plan_static_chunks(0, g) == [] and plan_static_chunks(t, 0) == []


def test_aligned_columns_and_limits():
    for col0, width, g in ((5, 3, 100), (80, 20, 100), (0, 0, 40), (37, 16, 53)):
        start, padded = aligned_columns(col0, width, g)
        assert padded % 16 == 0 or padded == g
        assert 0 <= start <= col0 and start + padded >= col0 + width and start + padded <= g
    assert check_chunking(None, None) == 2**30 and check_chunking(3, 100) == 100
    with pytest.raises(ValueError, match="^chunk:"):
        check_chunking(0, None)
    with pytest.raises(ValueError, match="^budget_bytes:"):
        check_chunking(None, 0)
    with pytest.raises(ValueError, match="^key_row_limit:"):
        plan_static_chunks(4, 4, (0, 0))


def test_planning_runs_without_triton():
    code = ("import sys, torch; from dsv4cp.kernels import indexer_plan as p; "
            "lo, hi = p.key_ranges(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([0, 0]), "
            "torch.tensor([0, 1])); print(p.plan_chunks(lo, hi), 'triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(0, 2, 0, 2)] False"
