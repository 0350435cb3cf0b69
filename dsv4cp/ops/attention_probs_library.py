"""The attention-probability kernels (:mod:`dsv4cp.kernels.attention_probs_triton`) as ``torch.library``
custom ops, what ``torch.compile`` calls in place of :mod:`dsv4cp.ops.attention_probs`' Triton paths.

Both are no-grad (the indexer loss's target), with the kernel (``whole_d`` / ``d_chunks``), the
probabilities' operand order and the launch pins (the kernel options ``triton_*_config`` and
``triton_*_chunk_config`` as ``int[]``, ``[]``: the ladder) as typed inputs:

* ``dsv4cp::logsumexp_over(q [T, H, D], keys [N, D], idx [T, K], scale, kernel, config, chunk_config)
  -> [T, H]`` fp32;
* ``dsv4cp::head_summed_probs(q, keys, idx, scale, log_denominator [T, H], slots_on_m, kernel, config,
  chunk_config) -> [T, K]`` in ``log_denominator``'s dtype.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.ops.attention_probs import _whole_d_pins


@torch.library.custom_op("dsv4cp::logsumexp_over", mutates_args=())
def logsumexp_over(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float, kernel: str,
                   config: list[int], chunk_config: list[int]) -> torch.Tensor:
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    kernel_options.note_backend("attention_probs.lse", "triton")
    return attention_probs_triton.logsumexp_over_triton(q, keys, idx, scale, kernel=kernel,
                                                        chunk_config=tuple(chunk_config) or None,
                                                        **_whole_d_pins(tuple(config) or None))


@logsumexp_over.register_fake
def _(q, keys, idx, scale, kernel, config, chunk_config):
    return q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4cp::head_summed_probs", mutates_args=())
def head_summed_probs(q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scale: float,
                      log_denominator: torch.Tensor, slots_on_m: bool, kernel: str, config: list[int],
                      chunk_config: list[int]) -> torch.Tensor:
    from dsv4cp.kernels import attention_probs_triton  # lazy: imports triton

    kernel_options.note_backend("attention_probs", "triton")
    out = attention_probs_triton.head_summed_probs_triton(q, keys, idx, scale, log_denominator,
                                                          slots_on_m=slots_on_m, kernel=kernel,
                                                          chunk_config=tuple(chunk_config) or None,
                                                          **_whole_d_pins(tuple(config) or None))
    return out.to(log_denominator.dtype)


@head_summed_probs.register_fake
def _(q, keys, idx, scale, log_denominator, slots_on_m, kernel, config, chunk_config):
    return q.new_empty(idx.shape, dtype=log_denominator.dtype)
