"""Own GPU kernels (Triton). Importing this package registers the sparse-attention backends
"triton" (fp32 atomics for the kv gradient unless deterministic mode is on) and "triton-deterministic"
(DESIGN 4.2) WITHOUT importing triton: the kernels module is imported on first use. That matters on
CPU, where Triton's interpreter needs ``TRITON_INTERPRET=1`` set before triton's first import.

Public API (the kernel wrappers load triton lazily on attribute access):

* :func:`sparse_attention_fwd`, :func:`sparse_attention_bwd`, :class:`KernelConfig`, :class:`DkvConfig`
  (``dsv4cp.kernels.sparse_attention_triton``);
* :func:`set_deterministic`, :func:`is_deterministic`, :func:`triton_available`,
  :func:`triton_interpreting`.

Availability: CUDA devices; CPU when ``TRITON_INTERPRET=1`` and triton is (or will be) imported in
interpreter mode. "auto" tries "triton" first only when CUDA is present at import, so CPU runs of
"auto" keep using the torch oracle even when the interpreter is enabled for the kernel tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from dsv4cp.ops.sparse_attention import SparseAttentionBackend, register_backend
from dsv4cp.ops.sparse_attention_torch import sparse_attention_backward as _torch_backward
from dsv4cp.ops.sparse_attention_torch import sparse_attention_forward as _torch_forward

HAS_TRITON = importlib.util.find_spec("triton") is not None

_LAZY = {"sparse_attention_fwd", "sparse_attention_bwd", "KernelConfig", "DkvConfig", "MAX_HEAD_DIM",
         "BWD_SCRATCH_BYTES"}

__all__ = [
    "BWD_SCRATCH_BYTES",
    "HAS_TRITON",
    "MAX_HEAD_DIM",
    "DkvConfig",
    "KernelConfig",
    "is_deterministic",
    "set_deterministic",
    "sparse_attention_bwd",
    "sparse_attention_fwd",
    "triton_available",
    "triton_interpreting",
]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module("dsv4cp.kernels.sparse_attention_triton")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------ modes
_DETERMINISTIC = False


def set_deterministic(flag: bool) -> None:
    """Make the "triton" backend's backward use the deterministic (atomic-free) kv-gradient reduction.

    ``torch.use_deterministic_algorithms(True)`` selects it too; "triton-deterministic" always uses it."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(flag)


def is_deterministic() -> bool:
    """Whether the "triton" backend's backward currently runs deterministically."""
    return _DETERMINISTIC or torch.are_deterministic_algorithms_enabled()


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_interpreting() -> bool | None:
    """Whether the imported triton built its language library for the interpreter; None before import."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return None
    return type(getattr(standard, "zeros", None)).__name__ == "InterpretedFunction"


def triton_available(device: torch.device | str) -> bool:
    """CUDA devices (compiled kernels); CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
    triton's first import)."""
    if not HAS_TRITON:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        interpreting = triton_interpreting()
        return interpreting if interpreting is not None else _env_interpret()
    return False


triton_available.missing_hint = (  # type: ignore[attr-defined]  (shown by resolve_backend)
    "needs the triton package and a CUDA device, or on CPU TRITON_INTERPRET=1 set before triton's first import"
)


# ------------------------------------------------------------------------------------------ backends
def _forward(q, kv, idx, sink, scale, topk_length=None):
    if q.dtype == torch.float64:  # tl.dot has no fp64 matrix-unit path: the oracle serves fp64 (tests)
        return _torch_forward(q, kv, idx, sink, scale, topk_length)
    from dsv4cp.kernels.sparse_attention_triton import sparse_attention_fwd

    return sparse_attention_fwd(q, kv, idx, sink, scale, topk_length)


def _make_backward(deterministic: bool | None):
    def backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None):
        if q.dtype == torch.float64:
            return _torch_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length)
        from dsv4cp.kernels.sparse_attention_triton import sparse_attention_bwd

        return sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, topk_length,
                                    deterministic=deterministic)

    return backward


def _register() -> None:
    from dsv4cp.ops.sparse_attention import AUTO_ORDER, backend_names

    if "triton" in backend_names():  # already registered (module reloaded)
        return
    prefer = HAS_TRITON and torch.cuda.is_available()
    register_backend(SparseAttentionBackend("triton", _forward, _make_backward(None), triton_available),
                     auto_rank=0 if prefer and "triton" not in AUTO_ORDER else None)
    register_backend(SparseAttentionBackend("triton-deterministic", _forward, _make_backward(True),
                                            triton_available))


_register()
from dsv4cp.kernels import optional as _optional  # noqa: E402,F401  (FlashMLA / cuDNN adapters)
