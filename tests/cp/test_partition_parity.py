"""Unequal row slices (DESIGN 3.1): CP results on balanced and arbitrary splits equal CP = 1 results
(fp64), for W/C/H layers, both loss variants, overlap and recompute; MTP rolls on unequal slices equal
the single-rank roll, and the layer rejects a bad split on every rank before any collective."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from conftest import assert_parity_passes
from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn
from dsv4cp.cp.mtp import roll_hidden_left, roll_left
from dsv4cp.cp.partition import RowSplit, halo_rows
from dsv4cp.harness.case import Case
from dsv4cp.harness.parity import run_cases
from dsv4cp.model.partition import partition

# (ratio, indexer-loss variant): W, C sparse, C dense, H (tiny preset: window 8 covers ratio 8).
LAYER_TYPES = [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse")]
MODES = list(itertools.product(("none", "async"), (False, True)))  # (overlap, recompute)
HALO = halo_rows(DSv4Config.preset("tiny"), 4, 2)
"""8 rows: the tiny preset's halo for every layer type (window 8; ratio 4 reaches 2 x 4, ratio 8 reaches 8)."""


def _packings(cp: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (lengths, total); totals NOT divisible by cp where the balanced policy allows it."""
    total = 37 * cp + 1
    return {
        "one_long": ((total,), total),
        "long_last": ((9, 4, 0, total - 13), total),  # the costly end of a document on the last rank
        "empty_and_short": ((0, 3, 1, 0, 22, 2, 5, total - 40, 0), total),
        "tail_padding": ((total - 25, 6), total),
    }


def balanced_cases(cp: int) -> list[Case]:
    cases = []
    for i, ((ratio, loss), (lengths, total)) in enumerate(
        itertools.product(LAYER_TYPES, _packings(cp).values())
    ):
        overlap, recompute = MODES[i % len(MODES)]
        cfg = DSv4Config.preset("tiny", indexer_loss=loss)
        split = partition(lengths, cp, cfg, ratio, policy="balanced", total=total).bounds
        cases.append(Case(ratio=ratio, lengths=lengths, total=total, dtype="fp64", overlap=overlap,
                               recompute=recompute, seed=i, split=split,
                               cfg=DSv4Config.preset("tiny", indexer_loss=loss)))
    return cases


def straddling_cases() -> list[Case]:
    """Hand-placed splits over 3 ranks: a slice of exactly the halo, boundaries inside compressed
    groups and inside their overlap predecessors, a boundary at a document start."""
    lengths, total = (5, 30, 0, 17, 60), 120
    splits = [(0, HALO, 64, 120), (0, 50, 50 + HALO, 120), (0, 35, 103, 120), (0, 41, 62, 120)]
    return [
        Case(ratio=ratio, lengths=lengths, total=total, dtype="fp64", overlap=overlap, recompute=recompute,
                  split=split, seed=j, cfg=DSv4Config.preset("tiny", indexer_loss=loss))
        for j, (split, (ratio, loss), (overlap, recompute)) in enumerate(
            zip(itertools.cycle(splits), LAYER_TYPES * 2, MODES[::-1] + MODES)
        )
    ]


def _cp3_checks(rank: int, world: int, device: torch.device, cases: list[Case]) -> dict:
    """Everything of the default run that needs 3 ranks, in ONE spawn (each costs seconds)."""
    return {
        "parity": run_cases(rank, world, device, cases),
        "rolls": [_rolls(rank, world, device, bounds, depth) for bounds, depth in ROLL_SPLITS],
        "bad_splits": _bad_split_messages(rank, world, device),
    }


def test_unequal_slices_on_three_ranks() -> None:
    """Balanced splits (W, C sparse/dense, H; one per packing and mode) and the hand-placed ones
    (first four) match CP = 1; MTP rolls match the single-rank roll; bad splits raise before any
    collective."""
    balanced = balanced_cases(3)
    cases = straddling_cases()[:4] + [balanced[i] for i in (0, 5, 10, 15)]  # each layer type, packing, mode
    assert all(not c.row_split(3).is_equal for c in cases)  # unequal slices, or this proves nothing new
    per_rank = spawn(_cp3_checks, 3, cases)
    assert_parity_passes(cases, [r["parity"] for r in per_rank])
    for rank, result in enumerate(per_rank):
        for (bounds, depth), checks in zip(ROLL_SPLITS, result["rolls"]):
            assert all(checks), (rank, bounds, depth, checks)
        *bad, control = result["bad_splits"]
        assert control[0] == "no error" and control[1], control  # the recorder sees the layer's collectives
        for want, (message, issued) in zip(BAD_SPLIT_MESSAGES, bad, strict=True):
            assert message.startswith(want) and not issued, (rank, message, issued)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_balanced_split_matches_cp1(cp: int) -> None:
    cases = balanced_cases(cp) + (straddling_cases()[4:] if cp == 3 else [])
    assert_parity_passes(cases, spawn(run_cases, cp, cases))


@pytest.mark.slow
def test_balanced_split_cp8_matches_cp1() -> None:
    cases = balanced_cases(8)[::4]  # one case per layer type
    assert_parity_passes(cases, spawn(run_cases, 8, cases))


def _split_cases(rng: random.Random) -> list[Case]:
    """Random documents (empty ones included) cut at a random point, every layer type and mode among them.

    Drawn from the test's seed: a batch Hypothesis draws as one example is its minimal one first (a single
    empty document cut in the middle), and one spawn should run them all (a spawn costs seconds)."""
    cp = 2
    cases = []
    for (ratio, loss), (overlap, recompute) in zip(LAYER_TYPES, rng.sample(MODES, len(MODES))):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 6))]
        total = max(sum(lengths) + rng.randint(0, 9), cp * HALO)
        cut = rng.randint(HALO, total - HALO)
        cases.append(Case(ratio=ratio, lengths=tuple(lengths), total=total, dtype="fp64", overlap=overlap,
                               recompute=recompute, split=(0, cut, total), seed=rng.randrange(100),
                               cfg=DSv4Config.preset("tiny", indexer_loss=loss)))
    return cases


def test_random_splits_match_cp1(seed: int) -> None:
    """Random documents (empty ones included) cut at a random point: one spawn runs all four."""
    cases = _split_cases(random.Random(seed))
    assert_parity_passes(cases, spawn(run_cases, 2, cases))


# ---------------------------------------------------------------------------------- MTP rolls
def _rolls(rank: int, world: int, device: torch.device, bounds: tuple[int, ...], depth: int):
    packed = PackedSeqs.from_lengths([7, 0, 2, 30, 9], total=52)
    split = RowSplit(bounds)
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 1000, (packed.total,), generator=generator)
    hidden = torch.randn(packed.total, 3, generator=generator, dtype=torch.float64)
    weight = torch.randn(packed.total, 3, generator=generator, dtype=torch.float64)
    mine = slice(split.start(rank), split.start(rank) + split.rows(rank))
    fields = {"tokens": tokens[mine], "padding_mask": torch.zeros(split.rows(rank), dtype=torch.bool)}
    rolled = roll_left(fields, packed, depth, dist.group.WORLD, split=split)
    h = hidden[mine].clone().requires_grad_()
    out = roll_hidden_left(h, packed, depth, dist.group.WORLD, split=split)
    (out * weight[mine]).sum().backward()

    full_fields = {"tokens": tokens, "padding_mask": torch.zeros(packed.total, dtype=torch.bool)}
    want = roll_left(full_fields, packed, depth)
    h_full = hidden.clone().requires_grad_()
    out_full = roll_hidden_left(h_full, packed, depth)
    (out_full * weight).sum().backward()
    return (
        all(torch.equal(rolled[n], want[n][mine]) for n in fields),
        torch.equal(out.detach(), out_full.detach()[mine]),
        torch.allclose(h.grad, h_full.grad[mine], rtol=1e-12, atol=1e-12),
    )


ROLL_SPLITS = [((0, 3, 40, 52), 3), ((0, 30, 33, 52), 2)]
"""Slices of 3 rows (the depth) and boundaries inside documents."""


# ---------------------------------------------------------------------------------- errors
def _bad_split_messages(rank: int, world: int, device: torch.device) -> list[tuple[str, list[str]]]:
    """(error, collectives issued) of each bad call on 3 ranks, then of a valid control call."""
    issued: list[str] = []
    for name in ("all_gather_into_tensor", "all_gather_single", "batch_isend_irecv", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            original = getattr(dist, name)
            setattr(dist, name, lambda *a, _n=name, _o=original, **k: (issued.append(_n), _o(*a, **k))[1])
    cfg = DSv4Config.preset("tiny")
    layer = DSv4Attention(cfg, 4)
    packed = PackedSeqs.from_lengths([60])
    calls = [((0, 40, 50, 55), 20), ((0, 25, 30, 60), (25, 5, 30)[rank]), ((0, 20, 40, 60), 21), ((0, 20, 40, 60), 20)]
    results = []
    for bounds, rows in calls:
        issued.clear()
        try:
            layer(torch.randn(rows, cfg.hidden), packed, dist.group.WORLD, split=RowSplit(bounds))
            message = "no error"
        except ValueError as err:
            message = str(err)
        results.append((message, list(issued)))
    return results


BAD_SPLIT_MESSAGES = [
    "split.bounds: must run from 0 to packed.total=60", "split: rank 1 holds 5 rows, fewer than the 8",
    "x: holds 21 rows but rank",
]


def test_balanced_partition_is_valid_for_the_layer() -> None:
    """The balanced split respects the layer's halo for every layer type of the tiny preset."""
    cfg = DSv4Config.preset("tiny")
    for ratio in (0, 4, 8):
        split = partition([100, 3, 61], 4, cfg, ratio, policy="balanced")
        assert split.min_rows >= halo_rows(cfg, ratio, 4)
