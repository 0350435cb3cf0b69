"""Unequal row slices (DESIGN 3.1): CP results on balanced and arbitrary splits equal CP = 1 results
(fp64), for W/C/H layers, both loss variants, overlap and recompute; MTP rolls on unequal slices equal
the single-rank roll, and the layer rejects a bad split on every rank before any collective."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.check import CheckCase, merge_ranks, run_cases
from dsv4cp.cp.launch import spawn
from dsv4cp.cp.mtp import roll_hidden_left, roll_left
from dsv4cp.cp.partition import RowSplit, halo_rows, partition

# (ratio, indexer-loss variant): W, C sparse, C dense, H (tiny preset: window 8 covers ratio 8).
LAYER_TYPES = [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse")]
MODES = list(itertools.product(("none", "async"), (False, True)))  # (overlap, recompute)
HALO = halo_rows(DSv4Config.preset("tiny"), 4, 2)
"""8 rows: the tiny preset's halo for every layer type (window 8; ratio 4 reaches 2 x 4, ratio 8 reaches 8)."""


def _assert_all_pass(cases: list[CheckCase], per_rank) -> None:
    failures = []
    for i, case in enumerate(cases):
        for c in merge_ranks([rank_results[i] for rank_results in per_rank]):
            if not c.passed:
                failures.append(f"{case}: {c.quantity} rel error {c.max_rel_error:.2e}")
    assert not failures, "\n".join(failures)


def _packings(cp: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (lengths, total); totals NOT divisible by cp where the balanced policy allows it."""
    total = 37 * cp + 1
    return {
        "one_long": ((total,), total),
        "long_last": ((9, 4, 0, total - 13), total),  # the costly end of a document on the last rank
        "empty_and_short": ((0, 3, 1, 0, 22, 2, 5, total - 40, 0), total),
        "tail_padding": ((total - 25, 6), total),
    }


def balanced_cases(cp: int) -> list[CheckCase]:
    cases = []
    for i, ((ratio, loss), (name, (lengths, total))) in enumerate(
        itertools.product(LAYER_TYPES, _packings(cp).items())
    ):
        overlap, recompute = MODES[i % len(MODES)]
        cases.append(CheckCase(ratio=ratio, lengths=lengths, total=total, dtype="fp64", overlap=overlap,
                               recompute=recompute, seed=i, partition="balanced",
                               config_overrides={"indexer_loss": loss}))
    return cases


@pytest.mark.parametrize("cp", [2, 3])
def test_balanced_split_matches_cp1(cp: int) -> None:
    cases = balanced_cases(cp)
    # the tiny long documents must actually give unequal slices, or this test proves nothing new
    assert any(not c.row_split(cp).is_equal for c in cases)
    _assert_all_pass(cases, spawn(run_cases, cp, cases))


@pytest.mark.slow
@pytest.mark.parametrize("cp", [4, 8])
def test_balanced_split_matches_cp1_more_ranks(cp: int) -> None:
    cases = balanced_cases(cp)
    _assert_all_pass(cases, spawn(run_cases, cp, cases))


def test_tiny_and_straddling_slices_match_cp1() -> None:
    """Hand-placed splits: a slice of exactly the halo, boundaries inside compressed groups and inside
    their overlap predecessors, a boundary at a document start, every layer type and mode."""
    lengths, total = (5, 30, 0, 17, 60), 120
    splits = [(0, HALO, 64, 120), (0, 50, 50 + HALO, 120), (0, 35, 103, 120), (0, 41, 62, 120)]
    cases = [
        CheckCase(ratio=ratio, lengths=lengths, total=total, dtype="fp64", overlap=overlap, recompute=recompute,
                  split=split, seed=j, config_overrides={"indexer_loss": loss})
        for j, (split, (ratio, loss), (overlap, recompute)) in enumerate(
            zip(itertools.cycle(splits), LAYER_TYPES * 2, MODES * 2)
        )
    ]
    _assert_all_pass(cases, spawn(run_cases, 3, cases))


@st.composite
def _split_cases(draw) -> CheckCase:
    cp = 2
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    total = max(sum(lengths) + draw(st.integers(0, 9)), cp * HALO)
    cut = draw(st.integers(HALO, total - HALO))
    ratio, loss = draw(st.sampled_from(LAYER_TYPES))
    overlap, recompute = draw(st.sampled_from(MODES))
    return CheckCase(ratio=ratio, lengths=tuple(lengths), total=total, dtype="fp64", overlap=overlap,
                     recompute=recompute, split=(0, cut, total), seed=draw(st.integers(0, 99)),
                     config_overrides={"indexer_loss": loss})


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_split_cases(), min_size=6, max_size=6))
def test_random_splits_match_cp1(cases: list[CheckCase]) -> None:
    """Random documents (empty ones included) cut at a random point: one spawn runs all six."""
    _assert_all_pass(cases, spawn(run_cases, 2, cases))


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


@pytest.mark.parametrize(("bounds", "depth"), [((0, 3, 40, 52), 3), ((0, 30, 33, 52), 2)])
def test_mtp_rolls_on_unequal_slices(bounds: tuple[int, ...], depth: int) -> None:
    """Slices of 3 rows (the depth) and boundaries inside documents: rolled fields, rolled hidden
    states and their gradients equal the single-rank roll's rows."""
    for rank, checks in enumerate(spawn(_rolls, 3, bounds, depth)):
        assert all(checks), (rank, checks)


# ---------------------------------------------------------------------------------- errors
def _bad_split_messages(rank: int, world: int, device: torch.device) -> list[tuple[str, list[str]]]:
    issued: list[str] = []
    for name in ("all_gather_into_tensor", "all_gather_single", "batch_isend_irecv", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            original = getattr(dist, name)
            setattr(dist, name, lambda *a, _n=name, _o=original, **k: (issued.append(_n), _o(*a, **k))[1])
    cfg = DSv4Config.preset("tiny")
    layer = DSv4Attention(cfg, 4)
    packed = PackedSeqs.from_lengths([60])
    results = []
    for bounds, rows in [((0, 40, 50), 30), ((0, 55, 60), 55 if rank == 0 else 5), ((0, 30, 60), 20)]:
        issued.clear()
        try:
            layer(torch.randn(rows, cfg.hidden), packed, dist.group.WORLD, split=RowSplit(bounds))
            message = "no error"
        except ValueError as err:
            message = str(err)
        results.append((message, list(issued)))
    return results


def test_bad_split_raises_on_every_rank_before_any_collective() -> None:
    expected = ["split.bounds: must run from 0 to packed.total=60", "split: rank 1 holds 5 rows, fewer than the 8",
                "x: holds 20 rows but rank"]
    for rank_results in spawn(_bad_split_messages, 2):
        for want, (message, issued) in zip(expected, rank_results):
            assert message.startswith(want) and not issued, (message, issued)


def test_balanced_partition_is_valid_for_the_layer() -> None:
    """The balanced split respects the layer's halo for every layer type of the tiny preset."""
    cfg = DSv4Config.preset("tiny")
    for ratio in (0, 4, 8):
        split = partition([100, 3, 61], 4, cfg, ratio, policy="balanced")
        assert split.min_rows >= halo_rows(cfg, ratio, 4)
