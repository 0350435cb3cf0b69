"""Deterministic behaviour: the same inputs give bitwise-identical results across runs on CPU (CP = 2)."""

from __future__ import annotations

import torch

from cp_steps import seeded_cp_forward
from dsv4cp import PackedSeqs
from dsv4cp.cp.launch import spawn


def _run_twice(rank: int, world: int, device: torch.device, ratios: list[int]) -> list[bool]:
    return [_same_twice(rank, world, ratio) for ratio in ratios]


def _same_twice(rank: int, world: int, ratio: int) -> bool:
    packed = PackedSeqs.from_lengths([17, 0, 90, 41], total=160)
    results = []
    for _ in range(2):
        layer, x_local, res, loss = seeded_cp_forward(rank, world, packed, ratio, 7, overlap="async")
        loss.backward()
        results.append([res.out, x_local.grad] + [p.grad for p in layer.parameters() if p.grad is not None])
    first, second = results
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_two_runs_are_bitwise_identical() -> None:
    ratios = [0, 4, 8]
    for rank, same in enumerate(spawn(_run_twice, 2, ratios)):
        assert all(same), f"rank {rank}: results differ between runs for ratios {ratios}: {same}"
