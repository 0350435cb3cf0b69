"""Sparse attention with a sink, in plain PyTorch: the oracle every other backend is tested against.

Queries are processed in chunks whose gathered key block ``[chunk, Kt, D]`` stays under a byte budget,
so the full ``[T, Kt, D]`` gather never exists, in the forward nor in the (explicit, recomputing)
backward. Math in fp32 (fp64 stays fp64); outputs in the input dtype; ``lse`` in fp32 (fp64 for fp64).
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 * 2**20
"""Budget for one chunk's gathered keys plus its logits, in bytes."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(kt: int, heads: int, dim: int) -> int:
    per_query = kt * (dim + 3 * heads) * 4
    return max(1, CHUNK_BYTES // max(per_query, 1))


def _valid_mask(idx: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    valid = idx >= 0
    if topk_length is not None:
        slots = torch.arange(idx.shape[1], device=idx.device)
        valid &= slots[None, :] < topk_length[:, None]
    return valid


def _gather_rows(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``kv[idx]`` with empty slots reading row 0 (masked later); a kv of no rows reads zeros."""
    if kv.shape[0] == 0:  # legal when every slot is empty
        return kv.new_zeros(*idx.shape, kv.shape[1])
    return kv[idx.clamp_min(0).long()]


def _chunk_probs(q, kv, idx, valid, sink, scale, lse=None):
    """Gather the chunk's keys and return (keys, probs over keys, sink prob, lse without sink).

    With ``lse`` given (backward) the probabilities are recomputed from it instead of re-reduced.
    """
    keys = _gather_rows(kv, idx)  # [c, Kt, D]
    logits = torch.einsum("chd,ckd->chk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)  # -inf on rows with no key
    total = torch.logaddexp(lse, sink[None, :])  # denominator including the sink
    # No valid key and a -inf sink: an empty denominator. Any finite stand-in makes every probability
    # exp(-inf) = 0, so the row outputs 0 and back-propagates 0 (the contract), instead of -inf - -inf = NaN.
    total = total.masked_fill(total == float("-inf"), 0.0)
    probs = torch.exp(logits - total[..., None])
    sink_prob = torch.exp(sink[None, :] - total)
    return keys, probs, sink_prob, lse


def sparse_attention_forward(q, kv, idx, sink, scale, topk_length=None):
    """Returns ``(out [T,H,D] in q.dtype, lse [T,H] fp32/fp64)``; see :func:`dsv4cp.ops.sparse_attention`."""
    cdt = _compute_dtype(q.dtype)
    t, h, d = q.shape
    out = torch.empty(t, h, kv.shape[1], dtype=q.dtype, device=q.device)
    lse = torch.empty(t, h, dtype=cdt, device=q.device)
    kv_c, sink_c = kv.to(cdt), sink.to(cdt)
    step = _chunk_rows(idx.shape[1], h, d)
    for s in range(0, t, step):
        e = min(s + step, t)
        valid = _valid_mask(idx[s:e], None if topk_length is None else topk_length[s:e])
        keys, probs, _, lse_c = _chunk_probs(q[s:e].to(cdt), kv_c, idx[s:e], valid, sink_c, scale)
        out[s:e] = torch.einsum("chk,ckd->chd", probs, keys).to(q.dtype)
        lse[s:e] = lse_c
    return out, lse


def sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None):
    """Gradients ``(dq, dkv, dsink)`` of :func:`sparse_attention_forward`, recomputing chunk by chunk.

    With p_j = exp(l_j) / (Z + e^s) and delta = <dO, O>: dl_j = p_j (<dO, v_j> - delta),
    dq = scale sum_j dl_j k_j, dkv[j] += scale dl_j q + p_j dO (K = V, both roles add),
    dsink = -sum_t p_sink delta.
    """
    cdt = _compute_dtype(q.dtype)
    t, h, d = q.shape
    kv_c, sink_c = kv.to(cdt), sink.to(cdt)
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
    dsink = torch.zeros(h, dtype=cdt, device=q.device)
    step = _chunk_rows(idx.shape[1], h, d)
    for s in range(0, t, step):
        e = min(s + step, t)
        valid = _valid_mask(idx[s:e], None if topk_length is None else topk_length[s:e])
        q_c, do_c = q[s:e].to(cdt), dout[s:e].to(cdt)
        keys, probs, sink_prob, _ = _chunk_probs(q_c, kv_c, idx[s:e], valid, sink_c, scale, lse=lse[s:e].to(cdt))
        delta = (do_c * out[s:e].to(cdt)).sum(-1)  # [c, H]
        dprobs = torch.einsum("chd,ckd->chk", do_c, keys)
        dlogits = probs * (dprobs - delta[..., None])
        dq[s:e] = (torch.einsum("chk,ckd->chd", dlogits, keys) * scale).to(q.dtype)
        dkeys = torch.einsum("chk,chd->ckd", dlogits, q_c) * scale + torch.einsum("chk,chd->ckd", probs, do_c)
        if kv.shape[0]:
            rows = idx[s:e].clamp_min(0).long()
            dkeys = dkeys * valid[..., None]  # invalid slots read row 0: drop their (zero) contribution
            dkv.index_add_(0, rows.reshape(-1), dkeys.reshape(-1, dkeys.shape[-1]))
        dsink -= (sink_prob * delta).sum(0)
    return dq, dkv.to(kv.dtype), dsink.to(sink.dtype)
