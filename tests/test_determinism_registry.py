"""The determinism registry's verdicts, what a whole step claims from them, and check-determinism's exit code
when a claimed configuration differs between replays."""

from __future__ import annotations

import argparse

import pytest
import torch

from dsv4cp.cli import check_determinism
from dsv4cp.harness.case import Case
from dsv4cp.harness.replay import Replay
from dsv4cp.ops.determinism import (
    NEVER,
    REGISTRY,
    UNDER_MODE,
    Direction,
    attention_replays_bitwise,
    deterministic_algorithms,
    lookup,
)
from dsv4cp.ops.sparse_attention import backend_names

CUDA = torch.device("cuda")


def test_every_sparse_attention_backend_has_an_entry():
    for name in backend_names():
        entry = lookup("sparse_attention", name)
        assert entry.forward.reason and entry.backward.reason


def test_atomics_are_recorded_as_not_deterministic():
    assert lookup("indexer_scores", "triton").backward.verdict == UNDER_MODE
    assert "fp32 atomics" in lookup("indexer_scores", "triton").backward.reason
    assert lookup("sparse_attention", "cudnn").backward.verdict == NEVER
    assert lookup("sparse_attention", "triton").backward.verdict == UNDER_MODE
    assert all(e.forward.verdict != NEVER for e in REGISTRY)


@pytest.mark.parametrize("backend,mode,claims", [
    ("triton-deterministic", True, True), ("triton", True, True), ("torch", True, True),
    ("triton-deterministic", False, False), ("flashmla+triton", True, True), ("flashmla+cudnn", True, False),
    ("triton+cudnn", True, False),
])
def test_a_step_claims_bitwise_replay_on_cuda_only_in_the_mode(backend, mode, claims):
    assert attention_replays_bitwise(backend, CUDA, mode) is claims


def test_cpu_always_claims_and_unknown_backends_fail():
    assert attention_replays_bitwise("triton", torch.device("cpu"), False)
    with pytest.raises(ValueError, match="^backend: no determinism entry"):
        lookup("sparse_attention", "nope")
    with pytest.raises(ValueError, match="^verdict:"):
        Direction("sometimes", "why")


def test_deterministic_algorithms_restores_the_setting():
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_claimed_configuration_that_differs_exits_1(capsys):
    case = Replay(Case(lengths=(8,), ratio=0, backend="torch"), replays=2)
    first = {"out": torch.ones(2, 3), "x_grad": torch.zeros(2, 3)}
    changed = {"out": first["out"].clone(), "x_grad": first["x_grad"]}
    changed["out"][1, 2] = 1.5
    runs = {1: [[first, changed]]}
    fresh = {1: [first]}
    code = check_determinism._report(argparse.Namespace(), case, torch.device("cpu"), runs, fresh)
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out
    assert "max |diff| 5.000e-01, first at [1, 2] (replay 2)" in out
    assert check_determinism._report(argparse.Namespace(), case, torch.device("cpu"), {1: [[first, first]]},
                                     fresh) == 0
