"""The attention's own probabilities at given key rows: the indexer loss's target (docs/design.md §1.5).

Two no-grad ops over queries ``q [T, H, D]``, a key buffer ``keys [N, D]`` and per-query key rows
``idx [T, K]`` (``-1`` = empty slot), logits ``l[t, h, k] = scale * <q[t, h], keys[idx[t, k]]>``:

* :func:`logsumexp_over`: ``[T, H]`` log-sum-exp of the logits over the valid slots;
* :func:`head_summed_probs`: ``[T, K]`` ``sum_h exp(l[t, h, k] - log_denominator[t, h])``.

On CUDA (not fp64, D a multiple of 16 up to the kernels' maximum) they run the Triton kernels of
:mod:`dsv4cp.kernels.attention_probs_triton`; elsewhere the chunked torch gathers below, the references
the kernels are tested against. Neither materialises ``[T, H, K]`` beyond a bounded chunk. Both take the
call's kernel options (``options``: the kernels' choice, layout and launch pins).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dsv4cp.kernel_options import DEFAULT_OPTIONS, OPTIONS, KernelOptions
from dsv4cp.kernels import triton_serves
from dsv4cp.ops.custom_op_library import note_eager

__all__ = ["head_summed_probs", "head_summed_probs_torch", "logsumexp_over", "logsumexp_over_torch"]

CHUNK_ELEMENTS = 32 * 2**20
"""Elements of one chunk's gathered keys plus logits, ``[chunk, K, H + D]``, of the torch references."""


def _triton_kernels(q: torch.Tensor):
    """The Triton target kernels' module when they serve ``q``, else None (the torch references)."""
    if not triton_serves(q):
        return None
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    return attention_probs_triton if q.shape[-1] <= attention_probs_triton.MAX_HEAD_DIM else None


def _whole_d_pins(tile: tuple[int, ...] | None) -> dict[str, int]:
    """A pinned ``whole_d`` launch as the kernels' keyword arguments (none: the ladder)."""
    return dict(zip(OPTIONS["triton_probs_config"].fields, tile)) if tile is not None else {}


def _chunked_logits(
    q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float
) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(rows, logits [c, H, K])`` with ``-inf`` at empty slots, chunk by chunk (fp32, fp64 for fp64)."""
    t, h, d = q.shape
    step = max(1, CHUNK_ELEMENTS // max(idx.shape[1] * (h + d), 1))
    work = torch.promote_types(q.dtype, torch.float32)
    for s in range(0, t, step):
        rows = slice(s, min(s + step, t))
        gathered = keys[idx[rows].clamp_min(0)].to(work)
        logits = torch.einsum("chd,ckd->chk", q[rows].to(work), gathered) * scale
        yield rows, logits.masked_fill(idx[rows][:, None, :] < 0, float("-inf"))


@torch.no_grad()
def logsumexp_over(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, *,
                   options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``[T, H]`` log-sum-exp of the logits of ``q [T, H, D]`` against ``keys[idx]`` (``-inf`` for no key);
    fp32 (fp64 for fp64 inputs)."""
    kernels = _triton_kernels(q)
    note_eager("attention_probs.lse", "torch" if kernels is None else "triton")
    if kernels is not None and torch.compiler.is_compiling():  # one opaque node: .attention_probs_library
        return torch.ops.dsv4cp.logsumexp_over(q, keys, idx, float(scale), options.triton_lse_kernel,
                                               list(options.triton_lse_config or ()),
                                               list(options.triton_lse_chunk_config or ()))
    if kernels is not None:
        return kernels.logsumexp_over_triton(q, keys, idx, scale, kernel=options.triton_lse_kernel,
                                             chunk_config=options.triton_lse_chunk_config,
                                             **_whole_d_pins(options.triton_lse_config))
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
    q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, log_denominator: torch.Tensor, *,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """``[T, K]``: ``sum_h exp(l[t, h, k] - log_denominator[t, h])`` (zero at empty slots), in
    ``log_denominator``'s dtype; ``log_denominator`` is ``[T, H]``."""
    kernels = _triton_kernels(q)
    note_eager("attention_probs", "torch" if kernels is None else "triton")
    if kernels is not None:
        slots_on_m, kernel = options.triton_probs_slots_on_m, options.triton_probs_kernel
        if torch.compiler.is_compiling():  # one opaque node: .attention_probs_library
            return torch.ops.dsv4cp.head_summed_probs(q, keys, idx, float(scale), log_denominator, slots_on_m,
                                                      kernel, list(options.triton_probs_config or ()),
                                                      list(options.triton_probs_chunk_config or ()))
        out = kernels.head_summed_probs_triton(q, keys, idx, scale, log_denominator, slots_on_m=slots_on_m,
                                               kernel=kernel, chunk_config=options.triton_probs_chunk_config,
                                               **_whole_d_pins(options.triton_probs_config))
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
