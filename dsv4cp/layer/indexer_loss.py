"""The indexer's KL distillation loss (docs/design.md §1.5), sparse and dense variants.

Target: the attention's own probabilities of the scored compressed entries, summed over heads and
L1-normalised over the scored set (no gradient), from :mod:`dsv4cp.ops.attention_probs`. Prediction:
the softmax of the indexer scores over the same set (gradient to indexer parameters only). Each rank
returns its share: the sum over its real rows divided by the GLOBAL real-token count, so the CP ranks'
shares add up to the full loss.

The sparse variant's scores. With the kernel option ``indexer_loss_scores=selection`` (the default) the
layer passes the scores its top-k selection saw at the chosen entries (``selection_scores``, each rank
its own rows' under CP) and the forward scores nothing again; the gradient reaches the indexer inputs
through :func:`~dsv4cp.ops.indexer.indexer_scores_given`, the scores' own backward. Those scores were
summed in the selection's order, so loss and gradients differ from ``recompute`` (the entries scored
again by :func:`~dsv4cp.ops.indexer.indexer_scores`) by that rounding only; handed the recomputed
scores, they are bit for bit the same (tests/test_indexer_loss_selection_scores.py). The KL terms:
:func:`~dsv4cp.ops.indexer_kl.indexer_kl` (the kernel option ``indexer_loss_kl``: torch ops, or one fused
Triton pass per row whose saved score gradient the backward only scales).

Non-finite values. The top-k never selects a non-finite indexer score (docs/design.md §4.5), so a NaN
or infinite indexer query, head weight or key would drop out of the selected set, and with it out of
this loss (an all-NaN input used to give a loss of exactly 0). The loss is therefore multiplied by its
normaliser when every value of ``index_q``, ``index_w`` and ``index_keys`` is finite and by NaN
otherwise (:func:`_scale_if_finite`): one device-side check (a sum per input), no host read, and bitwise
the same loss and gradients as ``(loss * normaliser) * 1`` for finite inputs. The backward scales by the
same factor, so the gradients of the entries still scored turn NaN too (a row whose scores were all
skipped has none). Non-finite values on the attention side
(queries, keys, lse, sink) need no factor: they reach the target of every row that scores an entry.

Memory. The sparse variant scores the ``K`` selected entries per query: ``[L, K]`` tensors. The
selection's scores (``[L, K]`` fp32: 128 MiB at L = 65536, K = 512) live from the top-k to this loss's
forward (through the attention forward), in place of the scores the forward would compute; nothing more
is kept for the backward (the scores' backward saves ``index_q``, ``index_w``, ``index_keys`` and the
selection either way; the fused KL keeps its ``[L, K]`` fp32 score gradient instead of the torch ops'
saved tensors). Selective recompute rebuilds the attention side only: the scores are not recomputed
nor kept by it. The dense
variant scores every visible entry, up to ``M = max_seqlen_padded / 4`` per query (a 64K-token document
makes ``[L, M]`` 1e9 elements), so it runs over chunks of query rows sized from :data:`DENSE_CHUNK_BYTES`
and holds one chunk's ``[c, M]`` tensors at a time. Its forward computes each chunk's loss and, when the
indexer inputs need a gradient, that chunk's gradient too (the loss is a scalar, so its backward only
scales the saved gradients by the incoming one): no ``[L, M]`` tensor is kept for, nor rebuilt in, the
backward. The indexer-score backward of the dense variant therefore runs inside ``indexer.loss.fwd``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.ops.attention_probs import head_summed_probs, logsumexp_over
from dsv4cp.ops.indexer import indexer_scores, indexer_scores_given
from dsv4cp.ops.indexer_kl import indexer_kl, kl_distillation
from dsv4cp.profiling.autograd_ranges import BackwardRegion
from dsv4cp.profiling.nvtx import nvtx_range

__all__ = ["DENSE_CHUNK_BYTES", "VARIANTS", "dense_chunk_rows", "indexer_loss", "kl_distillation",
           "selection_scores_wanted"]

VARIANTS = ("sparse", "dense")

DENSE_CHUNK_BYTES = 256 * 2**20
"""Budget for one chunk of query rows of the dense variant: its ``[c, M]`` tensors (entries, key rows,
target, scores, KL terms and their gradients) and the torch references' per-entry gathers."""

_DENSE_BYTES_PER_ENTRY = 64
"""Bytes per (query, entry) of the dense chunk's own tensors besides the gathers: two int64 index
tensors, a bool mask and about ten fp32 target / score / KL tensors and gradients."""


def dense_chunk_rows(entries: int, heads: int, head_dim: int, index_heads: int, index_dim: int) -> int:
    """Query rows per chunk of the dense variant: :data:`DENSE_CHUNK_BYTES` over the bytes of one row's
    ``entries`` scored entries (the attention gather ``heads + head_dim`` and the indexer gather
    ``index_heads + index_dim`` fp32 values per entry, plus the chunk's own tensors)."""
    per_entry = 4 * (heads + head_dim + index_heads + index_dim) + _DENSE_BYTES_PER_ENTRY
    return max(1, DENSE_CHUNK_BYTES // max(entries * per_entry, 1))


class _ChunkedKL(torch.autograd.Function):
    """``sum`` over row chunks of ``chunk_loss(rows, q_rows, w_rows, keys)``, differentiable in
    ``index_q [L, Hi, Di]``, ``index_w [L, Hi]`` and ``index_keys [G, Di]``; gradients are computed chunk by
    chunk in the forward and saved (the output is a scalar), only when ``grad_enabled`` (the caller's grad
    mode: ``needs_input_grad`` ignores it, so under ``no_grad`` the gradients would be computed for nothing)."""

    @staticmethod
    def forward(ctx, index_q, index_w, index_keys, chunk_loss: Callable, step: int, grad_enabled: bool):
        needs = tuple(need and grad_enabled for need in ctx.needs_input_grad[:3])
        work = torch.promote_types(index_q.dtype, torch.float32)
        total = torch.zeros((), dtype=work, device=index_q.device)
        dq = torch.zeros_like(index_q) if needs[0] else None
        dw = torch.zeros_like(index_w) if needs[1] else None
        dkeys = torch.zeros(index_keys.shape, dtype=work, device=index_keys.device) if needs[2] else None
        for s in range(0, index_q.shape[0], step):
            rows = slice(s, min(s + step, index_q.shape[0]))
            leaves = (index_q[rows].detach().requires_grad_(needs[0]),
                      index_w[rows].detach().requires_grad_(needs[1]), index_keys.detach().requires_grad_(needs[2]))
            with torch.set_grad_enabled(any(needs)):  # forward runs without grad: the chunk's graph needs it
                loss = chunk_loss(rows, *leaves)
            if any(needs):
                wanted = [leaf for leaf, need in zip(leaves, needs) if need]
                grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True, materialize_grads=True))
                if needs[0]:
                    dq[rows] = next(grads)
                if needs[1]:
                    dw[rows] = next(grads)
                if needs[2]:
                    dkeys += next(grads)
            total += loss.detach()
        ctx.save_for_backward(dq, dw, dkeys)
        ctx.key_dtype = index_keys.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        with nvtx_range("indexer.loss.bwd"):
            dq, dw, dkeys = ctx.saved_tensors
            dq = None if dq is None else grad.to(dq.dtype) * dq
            dw = None if dw is None else grad.to(dw.dtype) * dw
            dkeys = None if dkeys is None else (grad * dkeys).to(ctx.key_dtype)
            return dq, dw, dkeys, None, None, None


def indexer_loss(
    *,
    variant: str,
    q: torch.Tensor,
    key_buffer: torch.Tensor,
    window_idx: torch.Tensor,
    compressed_offset: int,
    scored_entries: torch.Tensor | Callable[[slice], torch.Tensor],
    attention_lse: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_keys: torch.Tensor,
    real: torch.Tensor,
    global_real_tokens: int,
    coeff: float,
    selection_scores: torch.Tensor | None = None,
    scored_key_rows: torch.Tensor | None = None,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """This rank's share of ``coeff * mean_t KL`` over real tokens of the whole batch.

    Args:
        variant: "sparse" (``scored_entries`` = the selected entries, denominator = the attention's
            full one incl. the sink) or "dense" (``scored_entries`` = every visible entry,
            denominator = logaddexp(window + sink, all visible compressed)).
        q, key_buffer: the attention's queries ``[L, H, D]`` and key rows (detached here).
        window_idx: ``[L, W]`` key-buffer rows of the window keys (dense denominator).
        compressed_offset: key-buffer row of gathered entry 0.
        scored_entries: gathered-entry rows scored per query, ``-1`` empty. Sparse: the ``[L, K]``
            tensor. Dense: a function from a slice of the ``L`` rows to their ``[rows, M]`` entries
            (e.g. ``RankLayout.all_visible_idx``), called one chunk of rows at a time.
        attention_lse: ``[L, H]`` lse of the attention over its keys (sink excluded).
        index_q, index_w, index_keys: indexer queries ``[L, Hi, Di]``, weights ``[L, Hi]``, all
            gathered indexer keys ``[G, Di]``; the loss differentiates through these.
        real: ``[L]`` bool, rows that count; ``global_real_tokens``: the normaliser.
        selection_scores: sparse only: the ``[L, K]`` scores the top-k selection saw at ``scored_entries``
            (``indexer_topk(..., return_scores=True)``, when :func:`selection_scores_wanted`): the
            prediction without scoring the entries again (the gradient still flows to the indexer
            inputs, :func:`~dsv4cp.ops.indexer.indexer_scores_given`). None: the entries are scored here.
        scored_key_rows: sparse only: ``scored_entries``' key-buffer rows (``entry + compressed_offset``,
            ``-1`` empty; ``[L, K]`` int32 / int64) when the caller has them (the layer's attention index):
            the target is computed at them, not at rows rebuilt here (the same rows: the same bits).
        options: the layer's kernel options (the target's, the scores' and the KL pass's kernels).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {variant!r}")
    if (variant == "sparse") != isinstance(scored_entries, torch.Tensor):
        expected = "an [L, K] tensor" if variant == "sparse" else "a function of a row slice"
        raise ValueError(f"scored_entries: the {variant} variant takes {expected}, got {type(scored_entries).__name__}")
    for name, given in (("selection_scores", selection_scores), ("scored_key_rows", scored_key_rows)):
        if given is not None and variant != "sparse":
            raise ValueError(f"{name}: only the sparse variant takes them, got variant {variant!r}")
    if scored_key_rows is not None and scored_key_rows.shape != scored_entries.shape:
        raise ValueError(f"scored_key_rows: must be scored_entries' shape {list(scored_entries.shape)}, got "
                         f"{list(scored_key_rows.shape)}")
    q, key_buffer = q.detach(), key_buffer.detach()
    sink = sink.detach().to(attention_lse.dtype)[None, :]
    weight = real.to(torch.promote_types(index_q.dtype, torch.float32))
    normaliser = coeff / max(global_real_tokens, 1)
    if variant == "sparse":
        log_denominator = torch.logaddexp(attention_lse.detach(), sink)
        total = _sparse_loss(q, key_buffer, compressed_offset, scored_entries, log_denominator, scale, index_q,
                             index_w, index_keys, weight, selection_scores, scored_key_rows, options)
        return total * _scale_if_finite(index_q, index_w, index_keys, normaliser, total)
    window_lse = torch.logaddexp(logsumexp_over(q, key_buffer, window_idx, scale, options=options), sink)

    def chunk_loss(rows: slice, q_rows: torch.Tensor, w_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        entries = scored_entries(rows)
        key_rows = torch.where(entries >= 0, entries + compressed_offset, -1)
        log_denominator = torch.logaddexp(window_lse[rows], logsumexp_over(q[rows], key_buffer, key_rows, scale,
                                                                           options=options))
        target_mass = head_summed_probs(q[rows], key_buffer, key_rows, scale, log_denominator, options=options)
        scores = indexer_scores(q_rows, w_rows, keys, entries, options=options)
        return kl_distillation(target_mass, scores, entries >= 0, weight[rows])

    m = scored_entries(slice(0, 0)).shape[1]  # M from a call on no rows
    step = dense_chunk_rows(m, q.shape[1], q.shape[2], index_q.shape[1], index_q.shape[2])
    total = _ChunkedKL.apply(index_q, index_w, index_keys, chunk_loss, step, torch.is_grad_enabled())
    return total * _scale_if_finite(index_q, index_w, index_keys, normaliser, total)


def selection_scores_wanted(variant: str, options: KernelOptions) -> bool:
    """Whether the layer hands :func:`indexer_loss` the selection's scores: the sparse variant, with the
    kernel option ``indexer_loss_scores`` of ``options`` at ``selection`` (``recompute``: the loss scores the
    entries)."""
    return variant == "sparse" and options.indexer_loss_scores == "selection"


def _scale_if_finite(index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor, scale: float,
                     like: torch.Tensor) -> torch.Tensor:
    """0-d tensor of ``like``'s dtype: ``scale`` when every indexer input is finite, else NaN (the selection
    skips non-finite scores, so without this factor they would vanish from the loss).

    Checked through the inputs' summed sums: a NaN or infinity anywhere makes the sum non-finite, whatever
    the order of the additions, and finite values overflow an fp32 sum only far beyond any score the
    indexer could rank. One read per input and no temporary of its size, unlike ``isfinite().all()``; the
    factor is then ``sum * 0 + scale``, which is ``scale`` rounded to ``like``'s dtype for a finite sum
    (``x * 0`` is a zero) and NaN otherwise: two scalar operations instead of a finiteness test, a
    ``where`` and a separate multiply by the normaliser. ``loss * factor`` has the bits of ``(loss * scale)
    * 1`` and so has its gradient (the scale is rounded to ``like``'s dtype either way)."""
    with torch.no_grad():
        work = torch.promote_types(like.dtype, torch.float32)
        total = index_q.sum(dtype=work).add_(index_w.sum(dtype=work)).add_(index_keys.sum(dtype=work))
        return total.mul_(0).add_(scale).to(like.dtype)


def _sparse_loss(q, key_buffer, compressed_offset, scored_entries, log_denominator, scale, index_q, index_w,
                 index_keys, weight, selection_scores: torch.Tensor | None = None,
                 key_rows: torch.Tensor | None = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """The sparse variant's unnormalised sum over rows (``[L, K]`` tensors throughout): the KL terms of
    :func:`~dsv4cp.ops.indexer_kl.indexer_kl` (the kernel option ``indexer_loss_kl``) at the selection's
    scores when given, else at the entries scored again; the target at ``key_rows`` (built from the
    entries when not given)."""
    valid = scored_entries >= 0
    if key_rows is None:
        key_rows = torch.where(valid, scored_entries + compressed_offset, -1)
    target_mass = head_summed_probs(q, key_buffer, key_rows, scale, log_denominator, options=options)
    if selection_scores is None:
        scores = indexer_scores(index_q, index_w, index_keys, scored_entries, options=options)
    else:
        scores = indexer_scores_given(index_q, index_w, index_keys, scored_entries, selection_scores,
                                      options=options)
    region = BackwardRegion("indexer.loss.bwd")
    return region.output(indexer_kl(target_mass, region.input(scores), valid, weight, impl=options.indexer_loss_kl))
