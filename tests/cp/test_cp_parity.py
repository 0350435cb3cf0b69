"""CP = cp results equal CP = 1 results (DESIGN 3.8): every layer type, loss variant, overlap mode and
recompute setting, on packings that put documents, groups and windows across rank boundaries."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from conftest import assert_parity_passes, seed_of
from dsv4cp.config import DSv4Config
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.case import Case
from dsv4cp.harness.parity import run_cases

# (ratio, indexer-loss variant): W, C sparse, C dense, H (tiny preset: window 8 covers ratio 8).
LAYER_TYPES = [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse")]
MODES = list(itertools.product(("none", "async"), (False, True)))  # (overlap, recompute)


def packings(cp: int) -> dict[str, tuple[tuple[int, ...], int | None, int]]:
    """name -> (lengths, total, pad_to_multiple); rows per rank L = 30 (not a multiple of 4 or 8,
    so compressed groups and their overlap predecessors straddle rank boundaries)."""
    rows = 30
    total = rows * cp
    return {
        "one_long": ((total,), None, 1),
        "many_short": (tuple(([7, 3, 12, 5, 9, 1] * total)[: total // 7]), total, 1),
        "empty_docs": ((0, rows - 3, 0, 0, total - rows + 3 - 20, 0), total, 1),
        "shorter_than_r": ((1, 2, 3, 1, 2, 3, 5, 7, total - 24), total, 1),
        "padded_docs": ((13, 22, 9), total, 8),
        "tail_padding": ((rows + 5, 17), total, 1),
        "starts_at_boundary": (tuple([rows] * cp), None, 1),
        "halo_sized_ranks": ((5 * cp, 3 * cp), 8 * cp, 1),  # L = 8 = the smallest legal (the halo)
    }


def cases_for(cp: int) -> list[Case]:
    cases = []
    for i, ((ratio, loss), (_name, (lengths, total, pad))) in enumerate(
        itertools.product(LAYER_TYPES, packings(cp).items())
    ):
        overlap, recompute = MODES[i % len(MODES)]
        cases.append(Case(ratio=ratio, lengths=lengths, total=total, pad_to_multiple=pad, overlap=overlap,
                               recompute=recompute, seed=i, cfg=DSv4Config.preset("tiny", indexer_loss=loss)))
    # every mode on the packing with the most boundary crossings
    lengths, total, pad = packings(cp)["many_short"]
    for ratio, loss in LAYER_TYPES:
        for overlap, recompute in MODES:
            cases.append(Case(ratio=ratio, lengths=lengths, total=total, overlap=overlap, recompute=recompute,
                                   cfg=DSv4Config.preset("tiny", indexer_loss=loss)))
    return cases


def fp64_cases() -> list[Case]:
    return [Case(ratio=r, lengths=(5, 70, 0, 41), total=120, dtype="fp64", overlap=overlap,
                      recompute=recompute, cfg=DSv4Config.preset("tiny", indexer_loss=loss))
            for r, loss in LAYER_TYPES for overlap, recompute in MODES]


def random_cases(rng: random.Random, cp: int) -> list[Case]:
    """Random documents (empty ones included) with a random padding tail, one case per layer ratio.

    Drawn from a seeded generator rather than by Hypothesis: they share their CP size's spawn, and a batch
    Hypothesis draws as one example is its minimal one first (a single empty document)."""
    cases = []
    for ratio in (0, 4, 8):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 8))]
        padded_end = sum(lengths) + rng.randint(0, 12)
        total = max(-(-padded_end // cp) * cp, 8 * cp)
        cases.append(Case(ratio=ratio, lengths=tuple(lengths), total=total, overlap="async",
                               seed=rng.randrange(100)))
    return cases


FP64_CP = 3


def _groups(cp: int) -> dict[str, list[Case]]:
    """Every test's cases at ``cp``, by test."""
    groups = {"packings": cases_for(cp), "random": random_cases(random.Random(seed_of("random packings", cp)), cp)}
    if cp == FP64_CP:
        groups["fp64"] = fp64_cases()
    return groups


@functools.cache
def _parity(cp: int) -> dict[str, tuple[list[Case], list[list[list[dict]]]]]:
    """Test -> (its cases at ``cp``, per rank their results): ONE spawn per CP size runs every test's cases
    (a spawn costs seconds, a case a fraction of one)."""
    groups = _groups(cp)
    per_rank = spawn(run_cases, cp, [case for cases in groups.values() for case in cases])
    out, start = {}, 0
    for name, cases in groups.items():
        out[name] = (cases, [results[start : start + len(cases)] for results in per_rank])
        start += len(cases)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_matches_cp1(cp: int) -> None:
    assert_parity_passes(*_parity(cp)["packings"])


@pytest.mark.slow
def test_cp8_matches_cp1() -> None:
    cases = cases_for(8)[: len(LAYER_TYPES) * 3]
    assert_parity_passes(cases, spawn(run_cases, 8, cases))


def test_fp64_parity_is_tight() -> None:
    """In fp64 the CP computation is the CP = 1 computation up to summation order."""
    assert_parity_passes(*_parity(FP64_CP)["fp64"])


@pytest.mark.parametrize("cp", [2, 3])
def test_random_packings_match_cp1(cp: int) -> None:
    assert_parity_passes(*_parity(cp)["random"])
