"""Exact-tie plateaus in the indexer's scores: every backend and every CP layout selects the same entries,
the ones the documented rule gives (higher score first, then the earlier entry).

Queries, head weights and keys hold small integers, so every score is an exact sum in fp32 whatever the
order of the additions; keys drawn from a palette of three vectors (one scoring ReLU-zero for most
queries) make each query's visible entries fall into a few plateaus of exactly equal scores.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.harness.selection import global_entries
from dsv4cp.kernels import triton_available
from dsv4cp.kernels.contracts import select_top
from dsv4cp.ops.indexer import indexer_topk
from dsv4cp.packing import PackedSeqs

CFG = DSv4Config.preset("tiny")
LENGTHS = (37, 0, 70, 21)
HEADS, DIM, K = 2, 16, 5
needs_triton = pytest.mark.skipif(not triton_available("cpu") and not torch.cuda.is_available(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 on CPU")


def plateau_inputs(seed: int, total: int, n_entries: int):
    """``q [T, Hi, Di]``, ``w [T, Hi]`` and per-entry keys ``[n_entries, Di]``, integer valued."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (total, HEADS, DIM), generator=gen).float()
    w = torch.randint(1, 3, (total, HEADS), generator=gen).float()
    palette = torch.randint(-1, 2, (3, DIM), generator=gen).float()
    palette[2] = -palette[0]  # where one key scores > 0 the other is ReLU-zero: a zero plateau
    keys = palette[torch.randint(0, 3, (n_entries,), generator=gen)]
    return q, w, keys


def expected_selection(q, w, keys, packed: PackedSeqs) -> torch.Tensor:
    """``[T, K]`` entry numbers by the rule, from the dense score matrix (fp64, exact here)."""
    layout = build_layout(packed, CFG, 4)
    scores = torch.einsum("thd,ed->the", q.double(), keys.double()).relu().mul(w.double()[..., None]).sum(1)
    visible = layout.visible_mask(layout.local_doc, layout.local_pos)  # CP = 1: gathered row == entry number
    return select_top(scores.masked_fill(~visible, float("-inf")), K)


def rank_inputs(q, w, keys, packed, rank, cp, gen):
    """This rank's queries and its layout's gathered key buffer (empty slots hold random keys)."""
    layout = build_layout(packed, CFG, 4, rank, cp)
    buf = torch.randn(layout.gathered_rows, DIM, generator=gen) * 100
    filled = layout.gathered_doc >= 0
    eid = layout.doc_first_eid[layout.gathered_doc.clamp_min(0)] + layout.gathered_j
    buf[filled] = keys[eid[filled]]
    rows = slice(layout.start, layout.start + layout.rows)
    return layout, q[rows], w[rows], buf


def selection_of(select, q, w, keys, packed, cp, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    parts = []
    for rank in range(cp):
        layout, q_r, w_r, buf = rank_inputs(q, w, keys, packed, rank, cp, gen)
        parts.append(global_entries(select(layout, q_r, w_r, buf), layout))
    return torch.cat(parts)


def torch_select(layout, q, w, buf):
    return indexer_topk(q, w, buf, lambda sl: layout.visible_mask(layout.local_doc[sl], layout.local_pos[sl]), K)


TRITON_PATHS = {  # the chunked path with each selection, and the streaming kernel
    "radix": {"select": "radix"}, "torch-packed": {"select": "torch", "keys_mode": "packed"},
    "torch-scores": {"select": "torch", "keys_mode": "scores"}, "stream": None,
}


def triton_select(path: str):
    def select(layout, q, w, buf):
        from dsv4cp.kernels.indexer_topk_triton import indexer_topk_stream
        from dsv4cp.kernels.indexer_triton import indexer_topk_triton

        device = "cuda" if torch.cuda.is_available() else "cpu"
        args = [t.to(device) for t in (q, w, buf, layout.local_doc, layout.visible_entries(), layout.gathered_doc,
                                       layout.gathered_j)]
        if TRITON_PATHS[path] is None:
            return indexer_topk_stream(*args, K).cpu()
        return indexer_topk_triton(*args, K, **TRITON_PATHS[path]).cpu()
    return select


@pytest.fixture
def case(seed):
    packed = PackedSeqs.from_lengths(LENGTHS, total=128)
    n_entries = build_layout(packed, CFG, 4).gathered_rows
    q, w, keys = plateau_inputs(seed, packed.total, n_entries)
    want = expected_selection(q, w, keys, packed)
    return packed, q, w, keys, want


def test_plateaus_are_large(case):
    """The inputs really tie at the cut: most rows with more visible entries than K have an exact tie
    between the K-th best score and the best one left out."""
    packed, q, w, keys, want = case
    layout = build_layout(packed, CFG, 4)
    scores = torch.einsum("thd,ed->the", q, keys).relu().mul(w[..., None]).sum(1)
    visible = layout.visible_mask(layout.local_doc, layout.local_pos)
    crowded = visible.sum(1) > K
    top = scores.masked_fill(~visible, float("-inf")).sort(dim=1, descending=True).values
    tied_at_cut = (top[:, K - 1] == top[:, K]) & crowded
    assert int(crowded.sum()) >= 40 and int(tied_at_cut.sum()) >= int(crowded.sum()) // 2


@pytest.mark.parametrize("cp", [1, 2])
def test_torch_selection_follows_the_rule(case, cp, seed):
    packed, q, w, keys, want = case
    assert torch.equal(selection_of(torch_select, q, w, keys, packed, cp, seed), want)


@needs_triton
@pytest.mark.parametrize("path", list(TRITON_PATHS))
@pytest.mark.parametrize("cp", [1, 2])
def test_triton_selection_follows_the_rule(case, cp, path, seed):
    packed, q, w, keys, want = case
    assert torch.equal(selection_of(triton_select(path), q, w, keys, packed, cp, seed), want)


@needs_triton
def test_radix_select_follows_the_rule_on_plateaus(case):
    from dsv4cp.kernels.select_top_triton import select_top_triton

    packed, q, w, keys, want = case
    layout = build_layout(packed, CFG, 4)
    scores = torch.einsum("thd,ed->the", q, keys).relu().mul(w[..., None]).sum(1)
    scores = scores.masked_fill(~layout.visible_mask(layout.local_doc, layout.local_pos), float("-inf"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(select_top_triton(scores.to(device), K).cpu(), want)
