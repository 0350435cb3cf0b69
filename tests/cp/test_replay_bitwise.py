"""Bitwise replay (:mod:`dsv4cp.harness.replay`): the torch and Triton-interpreter paths give the same bits
on every replay at CP = 1 and 2, the all-tie plateau selects by the earliest-entry rule at both, and the
comparison itself reports a one-ulp change."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.cp.launch import spawn
from dsv4cp.harness.case import Case
from dsv4cp.harness.replay import (
    Replay,
    compare_tensors,
    replay_differences,
    replay_rank,
    tie_rule_violations,
    whole_selection,
)
from dsv4cp.kernels import triton_available

LENGTHS = (37, 0, 70, 21)  # an empty document, documents straddling the CP = 2 boundary at row 64
BACKENDS = ["torch"] + (["triton"] if triton_available("cpu") else [])


def _cases(seed: int) -> list[Replay]:
    cases = []
    for backend in BACKENDS:
        cases.append(Replay(Case(lengths=LENGTHS, ratio=4, backend=backend, seed=seed, overlap="async",
                                 deterministic=backend == "torch"), replays=2))
        if backend == "torch":  # a W layer: the window path alone (the interpreter is slow: once is enough)
            cases.append(Replay(Case(lengths=LENGTHS, ratio=0, backend=backend, seed=seed), replays=2))
        cases.append(Replay(Case(lengths=LENGTHS, ratio=4, backend=backend, seed=seed), replays=1, ties=True))
    return cases


def _replay_all(rank: int, world: int, device: torch.device, cases: list[Replay]) -> list:
    return [replay_rank(rank, world, device, case) for case in cases]


@pytest.fixture(scope="module")
def runs(request) -> dict[int, list]:
    from conftest import seed_of

    cases = _cases(seed_of("replay-bitwise"))
    at_one = [[replay_rank(0, 1, torch.device("cpu"), case)] for case in cases]
    per_rank = spawn(_replay_all, 2, cases)  # [rank][case]
    at_two = [[per_rank[r][i] for r in range(2)] for i in range(len(cases))]
    return {"cases": cases, 1: at_one, 2: at_two}


@pytest.mark.parametrize("cp", [1, 2])
def test_every_replay_is_bitwise_identical(runs, cp):
    for case, per_rank in zip(runs["cases"], runs[cp]):
        if case.replays < 2:
            continue
        found = replay_differences(per_rank)
        assert "x_grad" in found and any(n.startswith("grad/") for n in found)
        assert case.case.ratio == 0 or "selected" in found
        differing = {n: d.describe() for n, d in found.items() if not d.identical}
        assert not differing, f"cp={cp} {case.case.backend} ratio={case.case.ratio}: {differing}"


def test_tie_plateau_selects_earliest_entries_at_every_cp(runs):
    tied = [i for i, case in enumerate(runs["cases"]) if case.ties]
    reference = whole_selection([s[0] for s in runs[1][tied[0]]])
    for i in tied:
        case = runs["cases"][i]
        for cp in (1, 2):
            selection = whole_selection([s[0] for s in runs[cp][i]])
            assert tie_rule_violations(selection, case.case) == 0, f"{case.case.backend} cp={cp}"
            assert torch.equal(selection, reference), f"{case.case.backend} cp={cp}: differs from torch cp=1"
    assert (reference >= 0).sum(dim=1).max() == case.case.cfg.index_topk  # some row has a full top-k


def test_without_ties_the_rule_check_fails(runs):
    """The rule check can fail: random keys select other entries than the earliest ones."""
    case = runs["cases"][0]
    assert not case.ties
    assert tie_rule_violations(whole_selection([s[0] for s in runs[1][0]]), case.case) > 0


def test_compare_reports_one_ulp_and_signed_zero():
    want = torch.tensor([[1.0, 2.0], [0.0, 4.0]])
    got = want.clone()
    got[1, 1] = torch.nextafter(got[1, 1], torch.tensor(5.0))
    d = compare_tensors("q", want, got, "replay 2")
    assert not d.identical and d.first_index == (1, 1) and d.max_abs == pytest.approx(2.0**-21)
    zero = want.clone()
    zero[1, 0] = -0.0
    assert compare_tensors("q", want, zero, "replay 2").first_index == (1, 0)
    assert compare_tensors("q", want, want.clone(), "replay 2").identical
