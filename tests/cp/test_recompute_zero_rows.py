"""Selective recompute on a rank holding no query rows: forward and backward run and give what the
plain (non-recompute) path gives, for the op alone (keys present, as on a CP rank) and for the layer."""

from __future__ import annotations

import pytest
import torch

from conftest import randn, randomize_parameters_, seed_of
from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.recompute import recomputed_attention
from dsv4cp.ops.sparse_attention import resolve_backend, sparse_attention

R, H, D, E, G, K = 6, 3, 8, 15, 5, 7  # latent width, heads, head dim, ext rows, compressed rows, slots


def _queries(latent: torch.Tensor, weight: torch.Tensor, rows: slice) -> torch.Tensor:
    q = torch.nn.functional.linear(latent, weight).view(latent.shape[0], H, D)
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)


def test_op_with_no_query_rows_matches_plain_autograd() -> None:
    seed = seed_of("recompute zero rows op")
    latent = randn(0, R, seed=seed).requires_grad_()
    weight = randn(H * D, R, seed=seed + 1, scale=R**-0.5).requires_grad_()
    kv_ext = randn(E, D, seed=seed + 2).requires_grad_()
    compressed = randn(G, D, seed=seed + 3).requires_grad_()
    sink = randn(H, seed=seed + 4).requires_grad_()
    leaves = (latent, weight, kv_ext, compressed, sink)
    idx = torch.zeros(0, K, dtype=torch.int32)
    scale = D**-0.5

    out_ref, lse_ref = sparse_attention(_queries(latent, weight, slice(None)), torch.cat((kv_ext, compressed)),
                                        idx, sink, scale, backend="torch")
    want = torch.autograd.grad(out_ref.sum(), leaves, allow_unused=True, materialize_grads=True)

    handed: list[torch.Tensor] = []
    out, lse, q, keys = recomputed_attention(latent, weight, _queries, kv_ext, compressed, idx, sink, scale,
                                             resolve_backend("torch", latent.device), on_compressed_grad=handed.append)
    assert out.shape == out_ref.shape == (0, H, D) and lse.shape == lse_ref.shape and q.shape == (0, H, D)
    assert torch.equal(keys, torch.cat((kv_ext, compressed)).detach())
    got = torch.autograd.grad(out.sum(), leaves, allow_unused=True, materialize_grads=True)
    for name, a, b in zip(("latent", "weight", "kv_ext", "compressed", "sink"), got, want):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert len(handed) == 1 and handed[0].shape == compressed.shape


@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_layer_on_an_empty_batch_matches_the_plain_path(ratio: int) -> None:
    """CP = 1 with no rows (empty documents only): the recompute step equals the plain one, gradients
    included (every parameter gets its, all-zero, gradient)."""
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([0, 0], total=0)
    results = []
    for recompute in (False, True):
        layer = DSv4Attention(cfg, ratio, recompute=recompute)
        randomize_parameters_(layer, seed_of("recompute zero rows layer", ratio))
        x = torch.zeros(0, cfg.hidden, requires_grad=True)
        res = layer(x, packed)
        loss = res.out.sum() + (res.indexer_loss if res.indexer_loss is not None else 0)
        loss.backward()
        grads = {name: p.grad for name, p in layer.named_parameters()}
        results.append((res.out.detach(), None if res.indexer_loss is None else res.indexer_loss.detach(),
                        x.grad, grads))
    (out, loss, dx, grads), (out_rc, loss_rc, dx_rc, grads_rc) = results
    assert out.shape == out_rc.shape == (0, cfg.hidden) and torch.equal(dx, dx_rc)
    assert (loss is None and loss_rc is None) or torch.equal(loss, loss_rc)
    for name, grad in grads.items():
        other = grads_rc[name]
        assert (grad is None and other is None) or torch.equal(grad, other), name
