"""The attention-probability kernels (:mod:`dsv4cp.kernels.attention_probs_triton`) as ``torch.library``
custom ops, what ``torch.compile`` calls in place of :mod:`dsv4cp.ops.attention_probs`' Triton paths.

Both are no-grad (the indexer loss's target), with the kernel options in force as text
(:mod:`.custom_op_library`) and the kernel (``whole_d`` / ``d_chunks``) and the probabilities' operand order
resolved before the call:

* ``dsv4cp::logsumexp_over(q [T, H, D], keys [N, D], idx [T, K], scale, kernel, options) -> [T, H]`` fp32;
* ``dsv4cp::head_summed_probs(q, keys, idx, scale, log_denominator [T, H], slots_on_m, kernel, options)
  -> [T, K]`` in ``log_denominator``'s dtype.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.ops.custom_op_library import options_from


@torch.library.custom_op("dsv4cp::logsumexp_over", mutates_args=())
def logsumexp_over(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, kernel: str,
                   options: str) -> torch.Tensor:
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    kernel_options.note_backend("attention_probs.lse", "triton")
    with options_from(options):
        return attention_probs_triton.logsumexp_over_triton(q, keys, idx, scale, kernel=kernel)


@logsumexp_over.register_fake
def _(q, keys, idx, scale, kernel, options):
    return q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4cp::head_summed_probs", mutates_args=())
def head_summed_probs(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float,
                      log_denominator: torch.Tensor, slots_on_m: bool, kernel: str, options: str) -> torch.Tensor:
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    kernel_options.note_backend("attention_probs", "triton")
    with options_from(options):
        out = attention_probs_triton.head_summed_probs_triton(q, keys, idx, scale, log_denominator,
                                                              slots_on_m=slots_on_m, kernel=kernel)
    return out.to(log_denominator.dtype)


@head_summed_probs.register_fake
def _(q, keys, idx, scale, log_denominator, slots_on_m, kernel, options):
    return q.new_empty(idx.shape, dtype=log_denominator.dtype)
