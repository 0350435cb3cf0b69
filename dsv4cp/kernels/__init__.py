"""Own GPU kernels (Triton). Importing this package registers the "triton" and "triton-deterministic"
sparse-attention backends (DESIGN 4.2).

When Triton is not installed the two names are still registered, as never-available backends, so that
asking for them by name says "not available" instead of "unknown backend".
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False
else:
    HAS_TRITON = True

if HAS_TRITON:
    from dsv4cp.kernels.sparse_attention_triton import (  # noqa: F401
        KernelConfig,
        is_deterministic,
        register,
        set_deterministic,
        sparse_attention_bwd,
        sparse_attention_fwd,
        triton_available,
    )

    register()
else:  # pragma: no cover
    from dsv4cp.ops.sparse_attention import SparseAttentionBackend, register_backend

    def _missing(*args, **kwargs):
        raise RuntimeError("the triton backend needs the `triton` package")

    for _name in ("triton", "triton-deterministic"):
        register_backend(SparseAttentionBackend(_name, _missing, _missing, available=lambda device: False))

__all__ = ["HAS_TRITON"] + (
    ["KernelConfig", "sparse_attention_fwd", "sparse_attention_bwd", "set_deterministic", "is_deterministic",
     "triton_available"] if HAS_TRITON else []
)
