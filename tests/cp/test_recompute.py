"""Selective recompute (DESIGN 3.6): same results, and neither the query up-projection nor the key
buffer is kept for backward."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.harness.build import randomize_


def _saved_bytes_and_grads(ratio: int, recompute: bool):
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([40, 3, 77], total=128)
    generator = torch.Generator().manual_seed(3)
    layer = DSv4Attention(cfg, ratio, recompute=recompute)
    randomize_(layer, generator)
    x = torch.randn(packed.total, cfg.hidden, generator=generator, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = layer(x, packed)
    loss = res.out.square().sum() + (res.indexer_loss if res.indexer_loss is not None else 0)
    loss.backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return sum(seen.values()), grads, cfg, packed


@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_recompute_keeps_less_and_changes_nothing(ratio: int) -> None:
    kept, grads, cfg, packed = _saved_bytes_and_grads(ratio, recompute=False)
    kept_rc, grads_rc, _, _ = _saved_bytes_and_grads(ratio, recompute=True)
    for a, b in zip(grads, grads_rc):
        assert (a is None and b is None) or torch.equal(a, b)
    # at least the fp32 queries [T, H, D] and the T window-kv rows of the key buffer are no longer kept
    q_bytes = packed.total * cfg.n_heads * cfg.head_dim * 4
    keys_bytes = packed.total * cfg.head_dim * 4
    assert kept_rc <= kept - q_bytes - keys_bytes, (kept, kept_rc)
