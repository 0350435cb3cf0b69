"""The lightning indexer's Triton ops (:mod:`dsv4cp.ops.indexer`) as ``torch.library`` custom ops.

Under ``torch.compile`` the indexer ops call these opaque ops where they would run the Triton kernels
(Dynamo cannot trace the kernels' launch ladders and host-side plans), with the values of the kernel
options they read as typed inputs (``<topk options>``: :data:`~dsv4cp.ops.indexer.TOPK_OPTION_NAMES`;
``<scores options>``: :data:`~dsv4cp.ops.indexer.SCORES_OPTION_NAMES`; a tile as ``int[]``, ``[]`` for
``auto``), so the compiled step picks the eager step's path and tiles:

* ``dsv4cp::indexer_topk(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit, <topk
  options>) -> [T, k]`` int64, no gradient: :func:`dsv4cp.ops.indexer.fused_indexer_topk`;
* ``dsv4cp::indexer_topk_scores(...)`` (the same arguments) ``-> ([T, k] int64, [T, k] fp32)``: the rows and
  their scores (``return_scores=True``), no gradient;
* ``dsv4cp::indexer_scores_fwd(q [T, Hi, Di], w [T, Hi], keys [G, Di], idx [T, K], <scores options>) ->
  [T, K]`` fp32, differentiable in q, w and keys through ``dsv4cp::indexer_scores_bwd(grad, q, w, keys, idx,
  <scores options>) -> (dq, dw, dkeys)`` (the kernels of :mod:`dsv4cp.kernels.indexer_scores_triton`; the
  backward takes its key-gradient reduction from the options and deterministic mode when it runs, as the
  eager one does).

The implementations open the ops' phase ranges (``indexer.score.fwd`` / ``.bwd``) themselves: a compiled
graph runs them eagerly, so the profiler still attributes their kernels.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import is_deterministic
from dsv4cp.ops.indexer import SCORES_OPTION_NAMES, TOPK_OPTION_NAMES, fused_indexer_topk, scores_backward_keywords
from dsv4cp.profiling.nvtx import nvtx_range


def _fused_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, query_doc: torch.Tensor,
                query_limit: torch.Tensor, key_doc: torch.Tensor, key_j: torch.Tensor, k: int,
                key_row_limit: list[int] | None, option_values: tuple, *,
                return_scores: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What both top-k ops run: :func:`~dsv4cp.ops.indexer.fused_indexer_topk` with the options and the key-row
    limit read back from the ops' typed arguments (``option_values`` in :data:`TOPK_OPTION_NAMES` order)."""
    limit = None if key_row_limit is None else (int(key_row_limit[0]), int(key_row_limit[1]))
    options = KernelOptions.from_op_values(TOPK_OPTION_NAMES, option_values)
    return fused_indexer_topk(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit=limit,
                              return_scores=return_scores, options=options)


@torch.library.custom_op("dsv4cp::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, query_doc: torch.Tensor, query_limit: torch.Tensor,
    key_doc: torch.Tensor, key_j: torch.Tensor, k: int, key_row_limit: list[int] | None,
    topk_impl: str, topk_select: str, topk_keys: str, topk_select_variant: str,
    indexer_config: list[int], stream_config: list[int], select_config: list[int], indexer_head_pairs: bool,
) -> torch.Tensor:
    return _fused_topk(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit,
                       (topk_impl, topk_select, topk_keys, topk_select_variant, indexer_config, stream_config,
                        select_config, indexer_head_pairs), return_scores=False)


@indexer_topk.register_fake
def _(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit, *options):
    return q.new_empty((q.shape[0], k), dtype=torch.int64)


@torch.library.custom_op("dsv4cp::indexer_topk_scores", mutates_args=())
def indexer_topk_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, query_doc: torch.Tensor, query_limit: torch.Tensor,
    key_doc: torch.Tensor, key_j: torch.Tensor, k: int, key_row_limit: list[int] | None,
    topk_impl: str, topk_select: str, topk_keys: str, topk_select_variant: str,
    indexer_config: list[int], stream_config: list[int], select_config: list[int], indexer_head_pairs: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_topk(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit,
                       (topk_impl, topk_select, topk_keys, topk_select_variant, indexer_config, stream_config,
                        select_config, indexer_head_pairs), return_scores=True)



@indexer_topk_scores.register_fake
def _(q, w, keys, query_doc, query_limit, key_doc, key_j, k, key_row_limit, *options):
    return q.new_empty((q.shape[0], k), dtype=torch.int64), q.new_empty((q.shape[0], k), dtype=torch.float32)


@torch.library.custom_op("dsv4cp::indexer_scores_fwd", mutates_args=())
def indexer_scores_fwd(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor,
                       gather_bwd_config: list[int], scores_bwd_reduce: str,
                       scores_bwd_scratch: list[int], scores_bwd_layout: str,
                       scores_bwd_index_ahead: bool) -> torch.Tensor:
    from dsv4cp.kernels import indexer_scores_triton as kernels  # lazy: imports triton
    from dsv4cp.kernels.indexer_triton import _check_qwk

    _check_qwk(q, w, keys)
    kernels._check_idx(q, idx)
    kernel_options.note_backend("indexer_scores.fwd", "triton")
    with nvtx_range("indexer.score.fwd"):
        return kernels._gather_forward(q.contiguous(), w.contiguous(), keys.contiguous(), idx.contiguous())


@indexer_scores_fwd.register_fake
def _(q, w, keys, idx, *options):
    return q.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4cp::indexer_scores_bwd", mutates_args=())
def indexer_scores_bwd(grad: torch.Tensor, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                       idx: torch.Tensor, gather_bwd_config: list[int], scores_bwd_reduce: str,
                       scores_bwd_scratch: list[int], scores_bwd_layout: str,
                       scores_bwd_index_ahead: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from dsv4cp.kernels import indexer_scores_triton as kernels  # lazy: imports triton

    options = KernelOptions.from_op_values(SCORES_OPTION_NAMES,
                                           (gather_bwd_config, scores_bwd_reduce, scores_bwd_scratch,
                                            scores_bwd_layout, scores_bwd_index_ahead))
    with nvtx_range("indexer.score.bwd"):
        # as the eager autograd function: the options' launch pin, reduction, scratch and layout, and
        # deterministic mode as it stands when the backward runs
        pinned, reduction, scratch, layout, ahead = kernels.check_settings(q, w, keys, idx,
                                                                           **scores_backward_keywords(options))
        reduction = kernels.resolve_reduction(reduction, is_deterministic())
        kernel_options.note_backend("indexer_scores.bwd", f"triton/{reduction}")
        dq, dw, dkeys = kernels._gather_backward(q.contiguous(), w.contiguous(), keys.contiguous(), idx.contiguous(),
                                                 grad.to(torch.float32).contiguous(), reduction, pinned, scratch,
                                                 layout, ahead)
    return dq, dw.to(w.dtype), dkeys.to(keys.dtype)


@indexer_scores_bwd.register_fake
def _(grad, q, w, keys, idx, *options):
    return q.new_empty(q.shape), w.new_empty(w.shape), keys.new_empty(keys.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, w, keys, idx, *options = inputs
    ctx.save_for_backward(q, w, keys, idx)
    ctx.options = options


def _backward(ctx, grad):
    q, w, keys, idx = ctx.saved_tensors
    dq, dw, dkeys = indexer_scores_bwd(grad, q, w, keys, idx, *ctx.options)
    return dq, dw, dkeys, None, *(None,) * len(ctx.options)


indexer_scores_fwd.register_autograd(_backward, setup_context=_setup_context)
