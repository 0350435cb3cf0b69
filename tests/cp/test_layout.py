"""Per-rank metadata (DESIGN 3.3): lowered indices point at the right tokens, every compressed group
has exactly one owner, capacities hold."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout, entry_capacity
from dsv4cp.packing import PackedSeqs

CFG = DSv4Config.preset("tiny")


def random_packing(rng: random.Random, cp: int) -> PackedSeqs:
    lengths = [rng.choice([0, 1, 3, 4, 7, 9, 16, 33, 70]) for _ in range(rng.randint(1, 7))]
    pad = rng.choice([1, 1, 4])
    end = sum(-(-n // pad) * pad for n in lengths) + rng.randint(0, 9)
    total = max(-(-end // cp) * cp, 16 * cp)
    return PackedSeqs.from_lengths(lengths, pad_to_multiple=pad, total=total)


def doc_and_pos(packed: PackedSeqs, row: int) -> tuple[int, int]:
    """Independent host-side lookup: the (document, position) of a global row, (-1, 0) outside."""
    cu = packed.cu_seqlens_padded.tolist()
    for d in range(packed.num_docs):
        if cu[d] <= row < cu[d + 1]:
            return d, row - cu[d]
    return -1, 0


def entries_of(packed: PackedSeqs, ratio: int) -> list[tuple[int, int, int]]:
    """Every (document, j, last row) entry of the batch, in buffer order."""
    cu = packed.cu_seqlens_padded.tolist()
    out = []
    for d in range(packed.num_docs):
        for j in range((cu[d + 1] - cu[d]) // ratio):
            out.append((d, j, cu[d] + (j + 1) * ratio - 1))
    return out


CASES = [(seed, cp, ratio) for seed in range(6) for cp in (1, 2, 3, 4) for ratio in (0, 4, 8)]


@pytest.mark.parametrize("seed,cp,ratio", CASES)
def test_window_indices_map_to_previous_tokens_of_the_same_document(seed: int, cp: int, ratio: int) -> None:
    packed = random_packing(random.Random(seed), cp)
    for rank in range(cp):
        lay = build_layout(packed, CFG, ratio, rank, cp)
        first_ext = lay.start - lay.halo
        for i in range(lay.rows):
            row = lay.start + i
            doc, pos = doc_and_pos(packed, row)
            got = [int(e) + first_ext if e >= 0 else None for e in lay.window_idx[i]]
            want = [row - j if doc >= 0 and j <= pos else None for j in range(CFG.window)]
            assert got == want, (rank, row)
            assert (int(lay.local_doc[i]), int(lay.local_pos[i])) == (doc, pos)


@pytest.mark.parametrize("seed,cp,ratio", [c for c in CASES if c[2]])
def test_each_group_has_exactly_one_owner_holding_its_last_row(seed: int, cp: int, ratio: int) -> None:
    packed = random_packing(random.Random(seed), cp)
    entries = entries_of(packed, ratio)
    owned = []
    for rank in range(cp):
        lay = build_layout(packed, CFG, ratio, rank, cp)
        assert int(lay.group_valid.sum()) <= lay.capacity == entry_capacity(lay.rows, ratio)
        first_ext = lay.start - lay.halo
        for slot in torch.nonzero(lay.group_valid).flatten().tolist():
            rows = [int(r) + first_ext for r in lay.group_rows[slot] if r >= 0]
            last = rows[-1]
            assert lay.start <= last < lay.start + lay.rows  # owner holds the last row
            doc, pos = doc_and_pos(packed, last)
            j = pos // ratio
            assert int(lay.group_pos[slot]) == j * ratio
            span = 2 * ratio if ratio == 4 and j > 0 else ratio  # overlap reads group j-1 too
            assert rows == list(range(last - span + 1, last + 1))
            assert all(doc_and_pos(packed, r)[0] == doc for r in rows)
            owned.append((doc, j, last))
    assert sorted(owned) == entries


@pytest.mark.parametrize("seed,cp,ratio", [c for c in CASES if c[2]])
def test_gathered_rows_and_visibility_agree_with_entry_ids(seed: int, cp: int, ratio: int) -> None:
    packed = random_packing(random.Random(seed), cp)
    entries = entries_of(packed, ratio)
    for rank in range(cp):
        lay = build_layout(packed, CFG, ratio, rank, cp)
        for eid, (doc, j, _) in enumerate(entries):
            row = int(lay.entry_row[eid])
            assert (int(lay.gathered_doc[row]), int(lay.gathered_j[row])) == (doc, j)
        assert int((lay.gathered_doc >= 0).sum()) == len(entries)
        visible = lay.all_visible_idx()
        for i in range(lay.rows):
            doc, pos = doc_and_pos(packed, lay.start + i)
            want = [] if doc < 0 else [(doc, j) for j in range((pos + 1) // ratio)]
            got = [(int(lay.gathered_doc[g]), int(lay.gathered_j[g])) for g in visible[i] if g >= 0]
            assert got == want
            mask = lay.visible_mask(lay.local_doc[i : i + 1], lay.local_pos[i : i + 1])[0]
            assert sorted(torch.nonzero(mask).flatten().tolist()) == sorted(int(g) for g in visible[i] if g >= 0)


def test_capacity_override_too_small_is_a_clear_error() -> None:
    packed = PackedSeqs.from_lengths([64], total=64)
    with pytest.raises(ValueError, match="capacity"):
        build_layout(packed, CFG, 4, rank=0, cp=2, capacity=3)
    assert build_layout(packed, CFG, 4, rank=0, cp=2, capacity=8).capacity == 8


@pytest.mark.parametrize(
    "lengths,total,cp,field",
    [([30], 30, 4, "divisible"), ([12], 12, 2, "halo"), ([10], 10, 0, "cp"), ([10], 10, 1, "rank")],
)
def test_bad_layout_requests_name_the_problem(lengths, total, cp, field) -> None:
    packed = PackedSeqs.from_lengths(lengths, total=total)
    rank = 5 if field == "rank" else 0
    with pytest.raises(ValueError, match=field):
        build_layout(packed, CFG, 4, rank=rank, cp=cp)
