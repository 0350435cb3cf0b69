"""Deterministic behaviour: the same inputs give bitwise-identical results across runs on CPU (CP = 2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.build import randomize_


def _run_twice(rank: int, world: int, device: torch.device, ratios: list[int]) -> list[bool]:
    return [_same_twice(rank, world, ratio) for ratio in ratios]


def _same_twice(rank: int, world: int, ratio: int) -> bool:
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([17, 0, 90, 41], total=160)
    results = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(7)
        layer = DSv4Attention(cfg, ratio, overlap="async")
        randomize_(layer, generator)
        x = torch.randn(packed.total, cfg.hidden, generator=generator)
        rows = packed.total // world
        x_local = x[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        res = layer(x_local, packed, dist.group.WORLD)
        loss = res.out.square().sum() + (res.indexer_loss if res.indexer_loss is not None else 0)
        loss.backward()
        results.append([res.out, x_local.grad] + [p.grad for p in layer.parameters() if p.grad is not None])
    first, second = results
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_two_runs_are_bitwise_identical() -> None:
    ratios = [0, 4, 8]
    for rank, same in enumerate(spawn(_run_twice, 2, ratios)):
        assert all(same), f"rank {rank}: results differ between runs for ratios {ratios}: {same}"
