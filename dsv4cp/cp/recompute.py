"""Selective recompute with KV reconstruction (docs/design.md §3.6).

The attention core normally keeps, for backward, the query up-projection ``q [L, H, D]`` with its
intermediates and the concatenated key buffer ``[halo kv | local kv | gathered compressed kv]``.
With recompute on, it keeps only the parts those are made of (the query latent, the ext kv rows and
the gathered compressed rows) and rebuilds both in backward: the key buffer by concatenating the
saved parts again, the queries by re-running their projection once, with autograd on, so the same
graph serves the attention backward (its values) and the query backward (its gradient). The
attention itself is not recomputed: its output and lse are saved as usual.

The attention runs through its custom ops (:mod:`dsv4cp.ops.sparse_attention_library`: the backend by
name, the forward's kernel options passed to both directions, the ``sparse_attn.*`` ranges opened
inside), the same opaque nodes a compiled layer without recompute holds.

Backward order inside the node (docs/design.md §3.5): KV reconstruction, attention backward, then, the
gathered keys' gradient being complete, ``on_compressed_grad`` (the CP layer launches its
reduce-scatter there), then the query backward, which runs while the reduce-scatter flies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.ops.sparse_attention import SparseAttentionBackend, option_values
from dsv4cp.profiling.nvtx import nvtx_range

QueryFn = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``query_fn(latent_rows, q_weight, rows)``: the queries of rows ``rows`` from their latents."""

GradHook = Callable[[torch.Tensor], None]
"""Called with a gradient as soon as it is complete."""

CHUNK_BYTES = 1 << 30
"""Bound on the fp32 intermediates of one chunk of the forward's (graph-free) query rows."""


def _row_chunks(rows: int, q_weight: torch.Tensor) -> list[slice]:
    """Slices covering ``rows``; one empty slice when there are none (a rank may hold no rows), so the
    queries still come out of ``query_fn`` with their ``[0, H, D]`` shape and dtype."""
    per_row = q_weight.shape[0] * 4 * 4  # the projection's width, fp32, a few live intermediates
    step = max(1, CHUNK_BYTES // per_row)
    return [slice(s, min(s + step, rows)) for s in range(0, max(rows, 1), step)]


@torch.no_grad()
def _queries(query_fn: QueryFn, latent: torch.Tensor, q_weight: torch.Tensor) -> torch.Tensor:
    """All queries, built chunk by chunk so only one chunk's intermediates exist at a time."""
    return torch.cat([query_fn(latent[rows], q_weight, rows) for rows in _row_chunks(latent.shape[0], q_weight)])


def _key_buffer(kv_ext: torch.Tensor, compressed: torch.Tensor | None) -> torch.Tensor:
    return kv_ext if compressed is None else torch.cat((kv_ext, compressed), dim=0)


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, latent, q_weight, kv_ext, compressed, idx, sink, query_fn, scale, backend, on_compressed_grad,
                options):
        with nvtx_range("q_proj.fwd"):
            q = _queries(query_fn, latent, q_weight)
        keys = _key_buffer(kv_ext, compressed)
        options = option_values(options)  # the forward's kernel options, for the backward too
        out, lse = torch.ops.dsv4cp.sparse_attention_fwd(q, keys, idx, sink, scale, None, backend.name, *options)
        ctx.save_for_backward(latent, q_weight, kv_ext, compressed, idx, sink, out, lse)
        ctx.query_fn, ctx.scale, ctx.backend, ctx.on_compressed_grad = query_fn, scale, backend, on_compressed_grad
        ctx.options = options
        ctx.mark_non_differentiable(lse, q, keys)
        return out, lse, q, keys

    @staticmethod
    def backward(ctx, dout, _dlse, _dq, _dkeys):
        latent, q_weight, kv_ext, compressed, idx, sink, out, lse = ctx.saved_tensors
        with nvtx_range("kv_rebuild.bwd"):
            keys = _key_buffer(kv_ext, compressed)  # KV reconstruction
            # Built once: its values feed the attention backward, its graph the query backward.
            with torch.enable_grad():
                latent_in = latent.detach().requires_grad_()
                weight_in = q_weight.detach().requires_grad_()
                q = ctx.query_fn(latent_in, weight_in, slice(None))
        dq, dkeys, dsink = torch.ops.dsv4cp.sparse_attention_bwd(
            dout, q.detach(), keys, idx, sink, ctx.scale, out, lse, None, ctx.backend.name, *ctx.options
        )
        del keys
        dkv_ext = dkeys[: kv_ext.shape[0]]
        dcompressed = None if compressed is None else dkeys[kv_ext.shape[0] :]
        if dcompressed is not None and ctx.on_compressed_grad is not None:
            ctx.on_compressed_grad(dcompressed)  # complete here: its reduce-scatter flies during the query backward
        with nvtx_range("q_proj.bwd"):
            dlatent, dweight = torch.autograd.grad(q, (latent_in, weight_in), dq)
        return dlatent, dweight, dkv_ext, dcompressed, None, dsink, None, None, None, None, None


def recomputed_attention(
    latent: torch.Tensor, q_weight: torch.Tensor, query_fn: QueryFn, kv_ext: torch.Tensor,
    compressed: torch.Tensor | None, idx: torch.Tensor, sink: torch.Tensor, scale: float,
    backend: SparseAttentionBackend, on_compressed_grad: GradHook | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention of ``query_fn(latent, q_weight)`` over ``[kv_ext | compressed]`` rows.

    Returns ``(out, lse, q, key_buffer)``; ``q`` and ``key_buffer`` are detached views for
    forward-only consumers (the indexer loss) and are not kept for backward. In backward,
    ``on_compressed_grad`` receives the gradient of ``compressed`` (complete, since the attention
    is its only differentiable consumer) before the query backward starts. ``options``: the kernel
    options of both directions.
    """
    return _RecomputedAttention.apply(
        latent, q_weight, kv_ext, compressed, idx, sink, query_fn, scale, backend, on_compressed_grad, options
    )
