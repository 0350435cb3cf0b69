"""Kernels' functional interface: one op per file, backends registered by name."""

from dsv4cp.ops.sparse_attention import backend_names, register_backend, resolve_backend, sparse_attention

__all__ = ["sparse_attention", "register_backend", "resolve_backend", "backend_names"]
