"""The recomputed attention's backward (DESIGN 3.5, 3.6): the queries are rebuilt ONCE, gradients
equal plain autograd's, and the compressed keys' gradient is handed out (for its reduce-scatter)
before the query backward starts."""

from __future__ import annotations

import torch

from conftest import randn, seed_of
from dsv4cp.cp.recompute import recomputed_attention
from dsv4cp.ops.sparse_attention import resolve_backend, sparse_attention

L, R, H, D, E, G, K = 12, 6, 3, 8, 15, 5, 7  # rows, latent width, heads, head dim, ext rows, compressed rows, slots


def _inputs(seed: int):
    latent = randn(L, R, seed=seed)
    weight = randn(H * D, R, seed=seed + 1, scale=R**-0.5)
    kv_ext = randn(E, D, seed=seed + 2)
    compressed = randn(G, D, seed=seed + 3)
    sink = randn(H, seed=seed + 4)
    g = torch.Generator().manual_seed(seed + 5)
    idx = torch.randint(-1, E + G, (L, K), generator=g, dtype=torch.int32)
    idx[:, 0] = torch.randint(E, E + G, (L,), generator=g, dtype=torch.int32)  # every row sees a compressed key
    weight_out = randn(L, H, D, seed=seed + 6)
    return [t.requires_grad_() for t in (latent, weight, kv_ext, compressed, sink)], idx, weight_out


def _query_fn(events: list[str]):
    def queries(latent: torch.Tensor, weight: torch.Tensor, rows: slice) -> torch.Tensor:
        """A projection with a nonlinear norm, so its backward needs its intermediates."""
        events.append("build")
        q = torch.nn.functional.linear(latent, weight).view(latent.shape[0], H, D)
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)
        if q.requires_grad:
            q.register_hook(lambda grad: events.append("query backward"))
        return q

    return queries


def test_backward_builds_queries_once_and_matches_autograd() -> None:
    (latent, weight, kv_ext, compressed, sink), idx, weight_out = _inputs(seed_of("recompute_backward"))
    scale = D**-0.5

    plain_events: list[str] = []
    q = _query_fn(plain_events)(latent, weight, slice(None))
    out_ref, _ = sparse_attention(q, torch.cat((kv_ext, compressed)), idx, sink, scale, backend="torch")
    want = torch.autograd.grad((out_ref * weight_out).sum(), (latent, weight, kv_ext, compressed, sink))

    events: list[str] = []
    handed: list[torch.Tensor] = []

    def on_compressed_grad(grad: torch.Tensor) -> None:
        events.append("compressed grad")
        handed.append(grad.clone())

    backend = resolve_backend("torch", latent.device)
    out, _, _, _ = recomputed_attention(
        latent, weight, _query_fn(events), kv_ext, compressed, idx, sink, scale, backend,
        on_compressed_grad=on_compressed_grad,
    )
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    forward_builds = events.count("build")
    events.clear()
    got = torch.autograd.grad((out * weight_out).sum(), (latent, weight, kv_ext, compressed, sink))

    assert forward_builds >= 1
    assert events == ["build", "compressed grad", "query backward"], events
    torch.testing.assert_close(handed[0], want[3], rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("latent", "weight", "kv_ext", "compressed", "sink"), got, want):
        assert b.abs().max() > 0, name  # every gradient is exercised
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
