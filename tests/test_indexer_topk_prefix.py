"""The torch top-k's causal-prefix scan (:func:`dsv4cp.ops.indexer.indexer_topk` with ``key_row_limit``).

With ``key_row_limit = (base, r)`` (:attr:`RankLayout.key_row_limit`) the torch path scores each chunk
of query rows ``[s, e)`` against key rows ``[0, min(G, base + (e - 1) // r + 1))`` only, so its work
follows the rows' position like the Triton static plan's and the model's ``prefix`` indexer scan.

* on real CP layouts (cp 1, 2, 4; one document, several documents with empty ones and tail padding)
  the selection is identical to the full scan's for every rank, with small-integer inputs (exact scores
  in any summation order, so ties at the cut are common and must break the same way), at the default
  chunk and at chunks of a few rows (early chunks narrower than ``k``);
* the scored width shrinks: every chunk's columns (recorded at ``select_top``) are exactly the bound of
  its last row and never more than :data:`PREFIX_ROWS` rows; with one-row chunks the scanned slots
  equal the model's ``prefix`` count (:func:`dsv4cp.model.row_costs.scanned_slots` plus the earlier
  ranks' slots), and they are well below the full scan's;
* a malformed ``key_row_limit`` raises ``ValueError`` naming it before any scoring.

CPU, tiny sizes; inputs from the per-test ``seed``.
"""

from __future__ import annotations

import pytest
import torch

import dsv4cp.ops.indexer as indexer_ops
from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import RankLayout, build_layout
from dsv4cp.model.row_costs import scanned_slots
from dsv4cp.ops.indexer import indexer_topk
from dsv4cp.packing import PackedSeqs

CFG = DSv4Config.preset("tiny")
RATIO = 4
PACKINGS = {
    "one document": ([96], 96),
    "several documents": ([37, 0, 9, 30, 3], 96),  # an empty document and 17 rows of tail padding
}


def layout_inputs(lay: RankLayout, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``q [rows, 3, 16]``, ``w [rows, 3]``, ``keys [G, 16]`` of small integers and halves: every score
    is exact in fp32 whatever the summation order, and many are equal (ties) or zero (ReLU off)."""
    hi, di = 3, 16
    values = torch.tensor([-2.0, -1.0, 1.0, 2.0])
    q = values[torch.randint(0, 4, (lay.rows, hi, di), generator=gen)]
    keys = values[torch.randint(0, 4, (lay.gathered_rows, di), generator=gen)]
    w = torch.tensor([-0.5, 0.5, 1.0])[torch.randint(0, 3, (lay.rows, hi), generator=gen)]
    return q, w, keys


def visible_of(lay: RankLayout):
    """The layer's visibility callable: own rows of a slice -> ``[len, G]`` bool."""
    return lambda rows: lay.visible_mask(lay.local_doc[rows], lay.local_pos[rows])


@pytest.mark.parametrize("prefix_rows", [indexer_ops.PREFIX_ROWS, 5])
@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_prefix_scan_selects_what_the_full_scan_selects(cp, packing, prefix_rows, seed, monkeypatch):
    monkeypatch.setattr(indexer_ops, "PREFIX_ROWS", prefix_rows)
    gen = torch.Generator().manual_seed(seed)
    lengths, total = PACKINGS[packing]
    pk = PackedSeqs.from_lengths(lengths, total=total)
    found = 0
    for rank in range(cp):
        lay = build_layout(pk, CFG, RATIO, rank, cp)
        q, w, keys = layout_inputs(lay, gen)
        visible = visible_of(lay)
        full = indexer_topk(q, w, keys, visible, CFG.index_topk)
        prefix = indexer_topk(q, w, keys, visible, CFG.index_topk, key_row_limit=lay.key_row_limit)
        assert torch.equal(prefix, full), f"seed={seed} cp={cp} rank={rank} {packing}"
        found += int((full >= 0).sum())
    assert found > 0, "control: some entries are selected"


def recorded_chunks(monkeypatch) -> list[tuple[int, int]]:
    """``(rows, columns)`` of every score block the torch top-k hands to ``select_top``."""
    shapes: list[tuple[int, int]] = []
    select = indexer_ops.select_top

    def recording(scores: torch.Tensor, keep: int) -> torch.Tensor:
        shapes.append(tuple(scores.shape))
        return select(scores, keep)

    monkeypatch.setattr(indexer_ops, "select_top", recording)
    return shapes


@pytest.mark.parametrize("prefix_rows", [1, 4, 7])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_chunk_scores_only_its_causal_prefix(cp, prefix_rows, seed, monkeypatch):
    monkeypatch.setattr(indexer_ops, "PREFIX_ROWS", prefix_rows)
    gen = torch.Generator().manual_seed(seed)
    pk = PackedSeqs.from_lengths(*PACKINGS["several documents"])
    for rank in range(cp):
        lay = build_layout(pk, CFG, RATIO, rank, cp)
        q, w, keys = layout_inputs(lay, gen)
        shapes = recorded_chunks(monkeypatch)
        indexer_topk(q, w, keys, visible_of(lay), CFG.index_topk, key_row_limit=lay.key_row_limit)
        base, r = lay.key_row_limit
        g, stop = lay.gathered_rows, 0
        for rows, columns in shapes:
            stop += rows
            assert rows <= prefix_rows, (rows, prefix_rows)
            assert columns == min(g, base + (stop - 1) // r + 1), f"seed={seed} rank={rank} rows to {stop}"
        assert stop == lay.rows
        if rank == 0:  # its first chunks see fewer key rows than k: the -1 tail must stay
            assert any(columns < CFG.index_topk for _, columns in shapes), shapes
        # the model's prefix count (exact for one-row chunks); a longer chunk adds to each row at most
        # the entries that complete within the chunk's rows after it
        scanned = sum(rows * columns for rows, columns in shapes)
        model = lay.rows * base + int(scanned_slots(lay.rows, r))
        assert model <= scanned <= model + lay.rows * -(-(prefix_rows - 1) // r), (rank, scanned, model)
        assert scanned < lay.rows * g, "control: fewer scores than the full scan"


def test_without_a_limit_every_chunk_scores_every_key_row(seed, monkeypatch):
    lay = build_layout(PackedSeqs.from_lengths(*PACKINGS["one document"]), CFG, RATIO, 1, 2)
    q, w, keys = layout_inputs(lay, torch.Generator().manual_seed(seed))
    shapes = recorded_chunks(monkeypatch)
    indexer_topk(q, w, keys, visible_of(lay), CFG.index_topk)
    assert shapes == [(lay.rows, lay.gathered_rows)]


@pytest.mark.parametrize("bad", [(-1, 4), (0, 0), [0, 4], (0, 4.0), (True, 4), (0, 4, 1), "0,4"])
def test_bad_key_row_limit_raises_naming_it_before_scoring(bad, seed):
    lay = build_layout(PackedSeqs.from_lengths([24], total=24), CFG, RATIO, 0, 1)
    q, w, keys = layout_inputs(lay, torch.Generator().manual_seed(seed))

    def visible(rows: slice) -> torch.Tensor:
        raise AssertionError("scored before the argument was checked")

    with pytest.raises(ValueError, match="^key_row_limit:"):
        indexer_topk(q, w, keys, visible, 2, key_row_limit=bad)
