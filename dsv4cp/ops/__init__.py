"""Functional ops, each with its torch reference beside it; every kernel is reached through one of them.

* :mod:`.sparse_attention`: the attention op and its backend registry (torch, triton, flashmla, cudnn);
* :mod:`.indexer`: the lightning indexer's top-k selection and differentiable scores;
* :mod:`.indexer_kl`: the indexer loss's KL terms (torch reference, fused Triton pass);
* :mod:`.attention_probs`: the attention's probabilities at given keys (the indexer loss's target);
* :mod:`.norm_rope`: RMS norm and RoPE, fused on CUDA for the attention's queries and outputs;
* :mod:`.compress_pool`: the compressor's gated pooling of r-token groups (torch reference, Triton on CUDA);
* :mod:`.grouped_linear`: the output projection's per-group map, without the copies a batched einsum makes;
* :mod:`.sparse_attention_library`: the attention op as ``torch.library`` custom ops, what ``torch.compile`` traces;
  likewise :mod:`.indexer_library`, :mod:`.indexer_kl_library`, :mod:`.attention_probs_library`,
  :mod:`.norm_rope_library` and :mod:`.compress_pool_library` for the other Triton kernels
  (:mod:`.custom_op_library`: how their dispatch notes what ran);
* :mod:`.determinism`: which backends replay bitwise, per op and direction, and deterministic mode.

The ops take the caller's kernel options as an argument (``options``, a
:class:`~dsv4cp.kernel_options.KernelOptions`: nothing here reads them from a global), pass the values each
kernel needs as its keyword arguments (the custom ops take them as typed inputs), keep them in their autograd
functions for backward and note what ran (:func:`dsv4cp.kernel_options.note_backend`, an explicit recorder).

``dsv4cp.ops`` imports ``dsv4cp.kernels`` and chooses among them; kernels never import ops.
"""

# Importing the libraries registers the custom ops torch.compile calls (none imports triton).
from dsv4cp.ops import (  # noqa: F401
    attention_probs_library,
    compress_pool_library,
    indexer_kl_library,
    indexer_library,
    norm_rope_library,
    sparse_attention_library,
)
from dsv4cp.ops.sparse_attention import backend_names, register_backend, resolve_backend, sparse_attention

__all__ = ["sparse_attention", "register_backend", "resolve_backend", "backend_names"]
