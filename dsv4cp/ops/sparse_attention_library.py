"""``sparse_attention`` as ``torch.library`` custom ops, the form ``torch.compile`` traces through.

Dynamo cannot trace the op's autograd function (it carries a backend object, and the backends launch
Triton or library kernels and read index ranges on the host). As custom ops with fake (shape-only)
implementations the forward and the backward are single opaque nodes of the graph instead: no graph
break, and AOTAutograd places the backward op through :func:`torch.library.register_autograd`.

``dsv4cp::sparse_attention_fwd(q, kv, idx, sink, scale, topk_length, backend, <options>) -> (out, lse)`` and
``dsv4cp::sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, topk_length, backend, <options>) ->
(dq, dkv, dsink)`` take the backend by its registered name (or pair of names) and check index ranges inside
(the eager op checks them before its autograd function; in a graph the check would be a host read).
``<options>`` are the values of the kernel options the backends read (:data:`.sparse_attention.OPTION_NAMES`,
one typed argument each: a tile as ``int[]``, ``[]`` for ``auto``), so a compiled graph holds them as
constants; the forward hands its own to the backward.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.ops.sparse_attention import _check_index_values, options_of, resolve_backend
from dsv4cp.profiling.nvtx import nvtx_range


@torch.library.custom_op("dsv4cp::sparse_attention_fwd", mutates_args=())
def sparse_attention_fwd(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
    topk_length: torch.Tensor | None, backend: str,
    fwd_config: list[int], fwd_logits: str, fwd_index_ahead: bool, fwd_lazy_rescale: bool,
    bwd_config: list[int], dkv_config: list[int], dq_in_dkv: bool, dkv_one_product: bool, bwd_index_ahead: bool,
    compact_slots: bool, bwd_dq_pass: bool, kv_pass_config: list[int], dq_pass_config: list[int],
    fwd_warp_specialize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_index_values(kv.shape[0], idx, topk_length)
    chosen = resolve_backend(backend, q.device, head_dim=q.shape[-1])
    options = options_of((fwd_config, fwd_logits, fwd_index_ahead, fwd_lazy_rescale, bwd_config, dkv_config, dq_in_dkv,
                          dkv_one_product, bwd_index_ahead, compact_slots, bwd_dq_pass, kv_pass_config,
                          dq_pass_config, fwd_warp_specialize))
    kernel_options.note_backend("sparse_attention.fwd", chosen.direction_names[0])
    with nvtx_range("sparse_attn.fwd"):
        out, lse = chosen.forward(q, kv, idx, sink, scale, topk_length, options=options)
    return out.clone() if out is q else out, lse  # a custom op's outputs must not alias its inputs


@sparse_attention_fwd.register_fake
def _(q, kv, idx, sink, scale, topk_length, backend, *options):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype)


@torch.library.custom_op("dsv4cp::sparse_attention_bwd", mutates_args=())
def sparse_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
    out: torch.Tensor, lse: torch.Tensor, topk_length: torch.Tensor | None, backend: str,
    fwd_config: list[int], fwd_logits: str, fwd_index_ahead: bool, fwd_lazy_rescale: bool,
    bwd_config: list[int], dkv_config: list[int], dq_in_dkv: bool, dkv_one_product: bool, bwd_index_ahead: bool,
    compact_slots: bool, bwd_dq_pass: bool, kv_pass_config: list[int], dq_pass_config: list[int],
    fwd_warp_specialize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = resolve_backend(backend, q.device, head_dim=q.shape[-1])
    options = options_of((fwd_config, fwd_logits, fwd_index_ahead, fwd_lazy_rescale, bwd_config, dkv_config, dq_in_dkv,
                          dkv_one_product, bwd_index_ahead, compact_slots, bwd_dq_pass, kv_pass_config,
                          dq_pass_config, fwd_warp_specialize))
    kernel_options.note_backend("sparse_attention.bwd", chosen.direction_names[1])
    with nvtx_range("sparse_attn.bwd"):
        dq, dkv, dsink = chosen.backward(dout.contiguous(), q, kv, idx, sink, scale, out, lse, topk_length,
                                         options=options)
    return dq, dkv, dsink.to(sink.dtype)


@sparse_attention_bwd.register_fake
def _(dout, q, kv, idx, sink, scale, out, lse, topk_length, backend, *options):
    return torch.empty_like(q), torch.empty_like(kv), torch.empty_like(sink)


def _setup_context(ctx, inputs, output) -> None:
    q, kv, idx, sink, scale, topk_length, backend, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, idx, sink, out, lse, *(() if topk_length is None else (topk_length,)))
    ctx.scale, ctx.backend, ctx.options, ctx.has_length = scale, backend, options, topk_length is not None
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, kv, idx, sink, out, lse, *length = ctx.saved_tensors
    dq, dkv, dsink = sparse_attention_bwd(dout, q, kv, idx, sink, ctx.scale, out, lse,
                                          length[0] if ctx.has_length else None, ctx.backend, *ctx.options)
    return dq, dkv, None, dsink, None, None, None, *(None,) * len(ctx.options)


sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
