"""Selective recompute with KV reconstruction (DESIGN 3.6).

The attention core normally keeps, for backward, the query up-projection ``q [L, H, D]`` with its
intermediates and the concatenated key buffer ``[halo kv | local kv | gathered compressed kv]``.
With recompute on, it keeps only the parts those are made of (the query latent, the ext kv rows and
the gathered compressed rows) and rebuilds both in backward: the key buffer by concatenating the
saved parts again, the queries by re-running their projection, whose gradient is then propagated
by hand. The attention itself is not recomputed: its output and lse are saved as usual.
"""

from __future__ import annotations

from typing import Callable

import torch

from dsv4cp.ops.sparse_attention import SparseAttentionBackend
from dsv4cp.profiling.nvtx import nvtx_range

QueryFn = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``query_fn(latent_rows, q_weight, rows)``: the queries of rows ``rows`` from their latents."""

CHUNK_BYTES = 1 << 30
"""Bound on the fp32 intermediates of one chunk of recomputed query rows."""


def _row_chunks(rows: int, q_weight: torch.Tensor) -> list[slice]:
    per_row = q_weight.shape[0] * 4 * 4  # the projection's width, fp32, a few live intermediates
    step = max(1, CHUNK_BYTES // per_row)
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


@torch.no_grad()
def _queries(query_fn: QueryFn, latent: torch.Tensor, q_weight: torch.Tensor) -> torch.Tensor:
    """All queries, built chunk by chunk so only one chunk's intermediates exist at a time."""
    return torch.cat([query_fn(latent[rows], q_weight, rows) for rows in _row_chunks(latent.shape[0], q_weight)])


def _key_buffer(kv_ext: torch.Tensor, compressed: torch.Tensor | None) -> torch.Tensor:
    return kv_ext if compressed is None else torch.cat((kv_ext, compressed), dim=0)


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, latent, q_weight, kv_ext, compressed, idx, sink, query_fn, scale, backend):
        with nvtx_range("q_proj.fwd"):
            q = _queries(query_fn, latent, q_weight)
        keys = _key_buffer(kv_ext, compressed)
        with nvtx_range("sparse_attn.fwd"):
            out, lse = backend.forward(q, keys, idx, sink, scale, None)
        ctx.save_for_backward(latent, q_weight, kv_ext, compressed, idx, sink, out, lse)
        ctx.query_fn, ctx.scale, ctx.backend = query_fn, scale, backend
        ctx.mark_non_differentiable(lse, q, keys)
        return out, lse, q, keys

    @staticmethod
    def backward(ctx, dout, _dlse, _dq, _dkeys):
        latent, q_weight, kv_ext, compressed, idx, sink, out, lse = ctx.saved_tensors
        with nvtx_range("kv_rebuild.bwd"):
            keys = _key_buffer(kv_ext, compressed)  # KV reconstruction
            q = _queries(ctx.query_fn, latent, q_weight)
        with nvtx_range("sparse_attn.bwd"):
            dq, dkeys, dsink = ctx.backend.backward(dout.contiguous(), q, keys, idx, sink, ctx.scale, out, lse, None)
        del q, keys
        with nvtx_range("q_proj.bwd"):  # back through the query projection, one chunk of rows at a time
            dlatent = torch.empty_like(latent)
            dweight = torch.zeros(q_weight.shape, dtype=torch.promote_types(q_weight.dtype, torch.float32),
                                  device=q_weight.device)  # fp32 sums for bf16 weights; fp64 stays fp64
            for rows in _row_chunks(latent.shape[0], q_weight):
                with torch.enable_grad():
                    latent_r = latent[rows].detach().requires_grad_()
                    weight_r = q_weight.detach().requires_grad_()
                    q_rows = ctx.query_fn(latent_r, weight_r, rows)
                dlatent_r, dweight_r = torch.autograd.grad(q_rows, (latent_r, weight_r), dq[rows])
                dlatent[rows] = dlatent_r
                dweight += dweight_r
            dweight = dweight.to(q_weight.dtype)
        dkv_ext = dkeys[: kv_ext.shape[0]]
        dcompressed = None if compressed is None else dkeys[kv_ext.shape[0] :]
        return dlatent, dweight, dkv_ext, dcompressed, None, dsink, None, None, None


def recomputed_attention(
    latent: torch.Tensor, q_weight: torch.Tensor, query_fn: QueryFn, kv_ext: torch.Tensor,
    compressed: torch.Tensor | None, idx: torch.Tensor, sink: torch.Tensor, scale: float,
    backend: SparseAttentionBackend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention of ``query_fn(latent, q_weight)`` over ``[kv_ext | compressed]`` rows.

    Returns ``(out, lse, q, key_buffer)``; ``q`` and ``key_buffer`` are detached views for
    forward-only consumers (the indexer loss) and are not kept for backward.
    """
    return _RecomputedAttention.apply(latent, q_weight, kv_ext, compressed, idx, sink, query_fn, scale, backend)
