"""The indexer's KL distillation loss (DESIGN 1.6), sparse and dense variants.

Target: the attention's own probabilities of the scored compressed entries, summed over heads and
L1-normalised over the scored set (no gradient): on CUDA (not fp64, D a multiple of 16 up to 512) by the
Triton kernels of :mod:`dsv4cp.kernels.attention_probs_triton`, elsewhere by the chunked torch gathers
below (the reference the kernels are tested against). Prediction: the softmax of the indexer scores over
the same set (gradient to indexer parameters only). Each rank returns its share: the sum over its
real rows divided by the GLOBAL real-token count, so the CP ranks' shares add up to the full loss.
"""

from __future__ import annotations

import torch

from dsv4cp.ops.indexer import _use_triton, indexer_scores
from dsv4cp.profiling.autograd_ranges import BackwardRegion

_CHUNK_ELEMENTS = 32 * 2**20


def _triton_kernels(q: torch.Tensor):
    """The Triton target kernels' module when they serve ``q`` (CUDA, not fp64, D a multiple of 16 up to
    the kernels' maximum, triton installed), else None (the torch path)."""
    if not _use_triton(q):
        return None
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    return attention_probs_triton if q.shape[-1] <= attention_probs_triton.MAX_HEAD_DIM else None


def _chunked_logits(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float):
    """Yield ``(rows, logits [c, H, K])`` with ``-inf`` at empty slots, chunk by chunk."""
    t, h, d = q.shape
    step = max(1, _CHUNK_ELEMENTS // max(idx.shape[1] * (h + d), 1))
    work = torch.promote_types(q.dtype, torch.float32)
    for s in range(0, t, step):
        rows = slice(s, min(s + step, t))
        gathered = keys[idx[rows].clamp_min(0)].to(work)
        logits = torch.einsum("chd,ckd->chk", q[rows].to(work), gathered) * scale
        yield rows, logits.masked_fill(idx[rows][:, None, :] < 0, float("-inf"))


@torch.no_grad()
def logsumexp_over(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """``[T, H]`` log-sum-exp of the logits of ``q`` against ``keys[idx]`` (``-inf`` for no key)."""
    kernels = _triton_kernels(q)
    if kernels is not None:
        return kernels.logsumexp_over_triton(q, keys, idx, scale)
    return logsumexp_over_torch(q, keys, idx, scale)


@torch.no_grad()
def logsumexp_over_torch(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`logsumexp_over` by chunked torch gathers on any device (math in fp32, fp64 for fp64)."""
    out = torch.empty(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for rows, logits in _chunked_logits(q, keys, idx, scale):
        out[rows] = torch.logsumexp(logits, dim=-1)
    return out


@torch.no_grad()
def head_summed_probs(
    q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, log_denominator: torch.Tensor
) -> torch.Tensor:
    """``[T, K]``: ``sum_h exp(l[t, h, k] - log_denominator[t, h])`` (zero at empty slots)."""
    kernels = _triton_kernels(q)
    if kernels is not None:
        out = kernels.head_summed_probs_triton(q, keys, idx, scale, log_denominator)
        return out.to(log_denominator.dtype)
    return head_summed_probs_torch(q, keys, idx, scale, log_denominator)


@torch.no_grad()
def head_summed_probs_torch(
    q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, log_denominator: torch.Tensor
) -> torch.Tensor:
    """:func:`head_summed_probs` by chunked torch gathers on any device (in ``log_denominator``'s dtype)."""
    out = torch.empty(idx.shape, dtype=log_denominator.dtype, device=q.device)
    for rows, logits in _chunked_logits(q, keys, idx, scale):
        out[rows] = torch.exp(logits - log_denominator[rows, :, None]).sum(1)
    return out


def kl_distillation(
    target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, row_weight: torch.Tensor
) -> torch.Tensor:
    """``sum_t row_weight[t] * KL(normalise(target_mass[t]) || softmax(scores[t]))`` over valid slots.

    Rows without a valid slot contribute 0.
    """
    has_slot = valid.any(-1)
    mass = target_mass.masked_fill(~valid, 0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    log_pred = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    per_slot = torch.xlogy(target, target) - target * log_pred.masked_fill(~valid, 0)
    per_row = per_slot.masked_fill(~valid, 0).sum(-1)
    return (per_row * (row_weight * has_slot)).sum()


def indexer_loss(
    *,
    variant: str,
    q: torch.Tensor,
    key_buffer: torch.Tensor,
    window_idx: torch.Tensor,
    compressed_offset: int,
    scored_entries: torch.Tensor,
    attention_lse: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_keys: torch.Tensor,
    real: torch.Tensor,
    global_real_tokens: int,
    coeff: float,
) -> torch.Tensor:
    """This rank's share of ``coeff * mean_t KL`` over real tokens of the whole batch.

    Args:
        variant: "sparse" (``scored_entries`` = the selected entries, denominator = the attention's
            full one incl. the sink) or "dense" (``scored_entries`` = every visible entry,
            denominator = logaddexp(window + sink, all visible compressed)).
        q, key_buffer: the attention's queries ``[L, H, D]`` and key rows (detached here).
        window_idx: ``[L, W]`` key-buffer rows of the window keys (dense denominator).
        compressed_offset: key-buffer row of gathered entry 0.
        scored_entries: ``[L, K]`` gathered-entry rows scored per query, ``-1`` empty.
        attention_lse: ``[L, H]`` lse of the attention over its keys (sink excluded).
        index_q, index_w, index_keys: indexer queries ``[L, Hi, Di]``, weights ``[L, Hi]``, all
            gathered indexer keys ``[G, Di]``; the loss differentiates through these.
        real: ``[L]`` bool, rows that count; ``global_real_tokens``: the normaliser.
    """
    q, key_buffer = q.detach(), key_buffer.detach()
    valid = scored_entries >= 0
    key_rows = torch.where(valid, scored_entries + compressed_offset, -1)
    sink = sink.detach().to(attention_lse.dtype)[None, :]
    if variant == "sparse":
        log_denominator = torch.logaddexp(attention_lse.detach(), sink)
    else:
        window_lse = torch.logaddexp(logsumexp_over(q, key_buffer, window_idx, scale), sink)
        log_denominator = torch.logaddexp(window_lse, logsumexp_over(q, key_buffer, key_rows, scale))
    target_mass = head_summed_probs(q, key_buffer, key_rows, scale, log_denominator)
    scores = indexer_scores(index_q, index_w, index_keys, scored_entries)
    region = BackwardRegion("indexer.loss.bwd")
    total = kl_distillation(target_mass, region.input(scores), valid, real.to(scores.dtype))
    return region.output(total * (coeff / max(global_real_tokens, 1)))
