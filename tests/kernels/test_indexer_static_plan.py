"""Static chunk planning of the Triton top-k: no device read, the same selection.

The layer passes :attr:`RankLayout.key_row_limit` to the Triton top-k, which then plans its chunks from
sizes alone (:func:`plan_static_chunks`) instead of reading the per-query key ranges to the host.

* the bound is sound: on random packings (empty, short, padded documents, tail padding), CP = 1-4,
  every rank, ratios 4 and 8 and an enlarged capacity, no query sees a gathered row at or past it,
  and it is attained (the tightest bound of its form);
* the static plan tiles the rows in order, keeps the budget and the row cap, and every chunk's columns
  contain the bound;
* on real CP layouts the static plan selects exactly what the exact plan and the torch op select
  (integer-valued inputs: every score exact in any summation order), also with tiny budgets and
  chunk caps; with normal inputs its chunk scores equal the full score matrix bitwise (the same tile
  geometry: both start at key row 0 and at query rows that are multiples of the tile);
* the static path reads no tensor data on the host; the exact path, which the layer used on CUDA
  before, does (recorded by :class:`host_reads.HostReads`);
* a malformed ``key_row_limit`` raises ``ValueError`` naming it.

CPU under Triton's interpreter at tiny sizes; inputs from the per-test ``seed``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout, entry_capacity, split_rows
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.contracts import pack_selection_keys
from dsv4cp.kernels.indexer_plan import (
    TOPK_BYTES_PER_SCORE,
    TOPK_SCORES_BYTES_PER_SCORE,
    plan_static_chunks,
    query_limits,
)
from dsv4cp.kernels.indexer_triton import indexer_score_matrix, iter_score_chunks
from dsv4cp.ops.indexer import fused_indexer_topk as indexer_topk_triton
from dsv4cp.ops.indexer import indexer_topk
from dsv4cp.packing import PackedSeqs
from host_reads import HostReads
from triton_marks import skip_module_without_triton

skip_module_without_triton()

CFG = DSv4Config.preset("tiny")


# ---------------------------------------------------------------------------------------- the bound
def random_packing(gen: torch.Generator, total: int) -> PackedSeqs:
    """Documents of 0-40 rows (many shorter than a group), padded to 1, 2 or 4, then tail padding."""
    pad = [1, 2, 4][int(torch.randint(0, 3, (), generator=gen))]
    lengths, used = [], 0
    while True:
        n = int(torch.randint(0, 41, (), generator=gen)) if torch.rand((), generator=gen) < 0.5 else \
            int(torch.randint(0, 6, (), generator=gen))
        padded = -(-n // pad) * pad
        if used + padded > total:
            break
        lengths.append(n)
        used += padded
    return PackedSeqs.from_lengths(lengths, pad_to_multiple=pad, total=total)


def test_layout_key_row_limit_bounds_every_visible_key(seed):
    gen = torch.Generator().manual_seed(seed)
    attained = 0
    for trial in range(24):
        cp = 1 + trial % 4
        ratio = (4, 8)[trial % 2]
        total = cp * int(torch.randint(8, 40, (), generator=gen))
        pk = random_packing(gen, total)
        rows, _ = split_rows(total, cp, CFG, ratio)
        extra = trial % 3  # an enlarged capacity moves every rank's block
        for rank in range(cp):
            lay = build_layout(pk, CFG, ratio, rank, cp, capacity=entry_capacity(rows, ratio) + extra)
            base, r = lay.key_row_limit
            assert (base, r) == (rank * lay.capacity, ratio)
            vis = lay.visible_mask(lay.local_doc, lay.local_pos)  # [rows, G]
            limit = base + torch.arange(lay.rows) // r + 1
            cols = torch.arange(lay.gathered_rows)
            beyond = vis & (cols[None, :] >= limit[:, None])
            assert not beyond.any(), f"seed={seed} trial={trial} rank={rank}/{cp}: {pk} sees past the bound"
            last = torch.where(vis, cols[None, :], -1).amax(1)
            attained += int((last == limit - 1).sum())
    assert attained > 0, f"seed={seed}: the bound was never attained (it could be tighter)"


# ------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("key_row_limit", [None, (0, 4), (37, 4), (5, 1)])
def test_static_plan_tiles_rows_keeps_the_budget_and_contains_the_bound(key_row_limit):
    for t in (1, 63, 64, 65, 300):
        for g in (1, 17, 200):
            for budget in (1, TOPK_BYTES_PER_SCORE * 64 * 16, TOPK_BYTES_PER_SCORE * 5000, 2**30):
                for max_rows in (None, 7, 64):
                    plan = plan_static_chunks(t, g, key_row_limit, budget, max_rows)
                    msg = f"t={t} g={g} limit={key_row_limit} budget={budget} max_rows={max_rows}"
                    assert plan and plan[0][0] == 0 and plan[-1][1] == t, msg
                    for (s, e, col0, width), nxt in zip(plan, plan[1:] + [(t, t, 0, 0)]):
                        assert e == nxt[0] and e > s, f"{msg}: chunks must tile the rows"
                        assert col0 == 0 and width <= g, msg
                        need = g
                        if key_row_limit is not None:
                            need = min(g, key_row_limit[0] + (e - 1) // key_row_limit[1] + 1)
                        assert width >= need, f"{msg}: chunk [{s}, {e}) misses key rows [{width}, {need})"
                        assert e - s == 1 or (e - s) * width * TOPK_BYTES_PER_SCORE <= budget, msg
                        assert max_rows is None or e - s <= max_rows, msg


def test_static_plan_narrows_early_causal_rows():
    """One long document at CP = 1: the first rows' chunks are narrow, as with the exact plan."""
    plan = plan_static_chunks(1024, 256, (0, 4), budget_bytes=TOPK_BYTES_PER_SCORE * 64 * 64)
    assert all(w == min(256, (e - 1) // 4 + 1) for _, e, _, w in plan), plan  # exactly the bound
    widths = [w for _, _, _, w in plan]
    assert widths == sorted(widths) and widths[0] <= 32 and widths[-1] == 256, widths


# -------------------------------------------------------------------------------------- the selection
CP_PACKINGS = [([9, 13, 2], 24), ([5, 0, 18, 1], 24), ([24], 24), ([3, 7, 4], 24), ([1, 2, 3, 1, 2], 24)]


def layout_case(lay, gen: torch.Generator, integer: bool):
    hi, di = 3, 16
    shape_q, shape_k = (lay.rows, hi, di), (lay.gathered_rows, di)
    if integer:  # exact scores in any summation order: selections must be identical, ties included
        values = torch.tensor([-2.0, -1.0, 1.0, 2.0])
        q = values[torch.randint(0, 4, shape_q, generator=gen)]
        keys = values[torch.randint(0, 4, shape_k, generator=gen)]
        w = torch.tensor([-0.5, 0.5, 1.0])[torch.randint(0, 3, (lay.rows, hi), generator=gen)]
    else:
        q, keys = torch.randn(shape_q, generator=gen), torch.randn(shape_k, generator=gen)
        w = torch.randn(lay.rows, hi, generator=gen)
    doc, pos = lay.local_doc, lay.local_pos
    return dict(q=q, w=w, keys=keys, query_doc=doc, query_limit=query_limits(doc, pos), key_doc=lay.gathered_doc,
                key_j=lay.gathered_j)


@pytest.mark.parametrize("keys_mode", ["packed", "scores"])
@pytest.mark.parametrize("lengths,total", CP_PACKINGS)
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_static_plan_selects_what_the_exact_plan_and_the_torch_op_select(lengths, total, cp, keys_mode, seed):
    options = KernelOptions(topk_keys=keys_mode)  # the kernel's packed keys or fp32 scores + select_top
    gen = torch.Generator().manual_seed(seed)
    pk = PackedSeqs.from_lengths(lengths, total=total)
    for rank in range(cp):
        lay = build_layout(pk, CFG, 4, rank, cp)
        case = layout_case(lay, gen, integer=True)
        vis = lay.visible_mask(lay.local_doc, lay.local_pos)
        for k in (2, 6):
            ref = indexer_topk(case["q"], case["w"], case["keys"], lambda sl, vis=vis: vis[sl], k)
            exact = indexer_topk_triton(**case, k=k, options=options)
            assert torch.equal(exact, ref), f"seed={seed} rank={rank}/{cp} k={k}: exact plan"
            for chunk, budget in ((None, None), (5, None), (None, TOPK_BYTES_PER_SCORE * 16 * 3)):
                static = indexer_topk_triton(**case, k=k, chunk=chunk, budget_bytes=budget,
                                             key_row_limit=lay.key_row_limit, impl="chunked", options=options)
                assert torch.equal(static, ref), f"seed={seed} rank={rank}/{cp} k={k} chunk={chunk} budget={budget}"


@pytest.mark.parametrize("packed", [False, True])
def test_static_chunk_scores_equal_the_full_score_matrix_bitwise(packed, seed):
    """Normal inputs, 160 rows over 2 ranks (so several 64-row chunks): same tiles, same bits; packed,
    the chunks hold exactly ``pack_selection_keys`` of the full matrix's columns."""
    gen = torch.Generator().manual_seed(seed)
    pk = PackedSeqs.from_lengths([37, 90, 3, 30], total=160)
    for rank in range(2):
        lay = build_layout(pk, CFG, 4, rank, 2)
        case = layout_case(lay, gen, integer=False)
        full = indexer_score_matrix(**case)
        base, r = lay.key_row_limit
        per_score = TOPK_BYTES_PER_SCORE if packed else TOPK_SCORES_BYTES_PER_SCORE
        budget = per_score * 64 * min(lay.gathered_rows, base + 64 // r)  # exactly the first 64 rows
        chunks = 0
        for s, e, col0, scores in iter_score_chunks(**case, budget_bytes=budget, key_row_limit=lay.key_row_limit,
                                                    packed=packed):
            assert col0 == 0 and s % 64 == 0, (s, col0)
            expect = full[s:e, : scores.shape[1]]
            expect = pack_selection_keys(expect) if packed else expect
            assert torch.equal(scores, expect), f"seed={seed} rank={rank} rows [{s}, {e}) packed={packed}"
            hidden = full[s:e, scores.shape[1]:]
            assert torch.isneginf(hidden).all(), f"seed={seed} rank={rank}: a visible key outside the chunk"
            chunks += 1
        assert chunks == 2, chunks


# --------------------------------------------------------------------------------------- host reads
def test_static_plan_reads_nothing_on_the_host_the_exact_plan_does(seed):
    gen = torch.Generator().manual_seed(seed)
    lay = build_layout(PackedSeqs.from_lengths([9, 13, 2], total=24), CFG, 4, 1, 2)
    case = layout_case(lay, gen, integer=True)
    with HostReads() as static:
        got = indexer_topk_triton(**case, k=3, key_row_limit=lay.key_row_limit, impl="chunked")
    assert not static.events, static.report()
    with HostReads() as exact:  # the layer's path before: key ranges read to plan the chunks
        want = indexer_topk_triton(**case, k=3, impl="chunked")
    assert exact.events, "control: the exact plan reads the key ranges on the host"
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [(-1, 4), (0, 0), [0, 4], (0, 4.0), (True, 4), (0, 4, 1)])
def test_bad_key_row_limit_raises_naming_it(bad, seed):
    lay = build_layout(PackedSeqs.from_lengths([24], total=24), CFG, 4, 0, 1)
    case = layout_case(lay, torch.Generator().manual_seed(seed), integer=True)
    with pytest.raises(ValueError, match="^key_row_limit:"):
        indexer_topk_triton(**case, k=2, key_row_limit=bad)
    with pytest.raises(ValueError, match="^key_row_limit:"):
        plan_static_chunks(24, 6, bad)
