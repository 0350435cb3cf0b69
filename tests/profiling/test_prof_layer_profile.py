"""A real CPU profile of the layer itself: tiny C layer, CP = 2 over gloo, async overlap, fwd+bwd.
Its per-phase table carries the documented phase names, forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.build import randomize_
from dsv4cp.profiling import nvtx
from dsv4cp.profiling.nvtx import RANGE_NAMES
from dsv4cp.profiling.overlap import TOTAL
from dsv4cp.profiling.trace import capture_trace, kineto_overlap_table


def _profile_layer(rank: int, world: int, device: torch.device, out_dir: str) -> None:
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([50, 0, 94], total=160)
    layer = DSv4Attention(cfg, 4, overlap="async")
    randomize_(layer, torch.Generator().manual_seed(0))
    rows = packed.total // world
    x = torch.randn(rows, cfg.hidden, requires_grad=True)

    def step() -> None:
        res = layer(x, packed, dist.group.WORLD)
        (res.out.square().sum() + res.indexer_loss).backward()

    capture_trace(step, out_dir, steps=1, warmup=1, rank=rank)


def test_layer_profile_has_the_documented_phases(tmp_path) -> None:
    spawn(_profile_layer, 2, str(tmp_path))
    table = kineto_overlap_table(tmp_path)
    assert set(table["phase"]) <= set(RANGE_NAMES) | {TOTAL}
    # no indexer.score.fwd: the loss takes the selection's scores (kernel option indexer_loss_scores=selection)
    expected = {f"dsv4cp.{p}" for p in (
        "halo.fwd", "halo.bwd", "kv_proj.fwd", "kv_proj.bwd", "compress.fwd", "compress.bwd",
        "indexer.compress.fwd", "indexer.q_proj.fwd", "indexer.topk.fwd",
        "indexer.score.bwd", "indexer.loss.fwd", "indexer.loss.bwd", "q_proj.fwd", "q_proj.bwd",
        "allgather.kv.launch", "allgather.kv.wait", "allgather.index_k.launch", "allgather.index_k.wait",
        "sparse_attn.fwd", "sparse_attn.bwd", "reducescatter.kv.launch", "reducescatter.kv.wait",
        "out_proj.fwd", "out_proj.bwd", "layout.fwd", "step")}
    for rank in (0, 1):
        phases = set(table[table["rank"] == rank]["phase"])
        assert expected <= phases, sorted(expected - phases)


def test_ranges_off_give_identical_numerics() -> None:
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([40, 31], total=80)
    results = []
    for enabled in (True, False):
        nvtx.set_enabled(enabled)
        try:
            layer = DSv4Attention(cfg, 4)
            randomize_(layer, torch.Generator().manual_seed(1))
            x = torch.randn(packed.total, cfg.hidden, generator=torch.Generator().manual_seed(2), requires_grad=True)
            res = layer(x, packed)
            (res.out.square().sum() + res.indexer_loss).backward()
            results.append([res.out, res.indexer_loss, x.grad] + [p.grad for p in layer.parameters()])
        finally:
            nvtx.set_enabled(True)
    for a, b in zip(*results):
        assert torch.equal(a, b)
