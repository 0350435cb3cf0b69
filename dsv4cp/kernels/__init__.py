"""Own GPU kernels (Triton) and the optional library adapters, below :mod:`dsv4cp.ops` (which chooses
and registers them as backends of its functional ops; nothing here imports ``dsv4cp.ops``).

Importing this package imports no triton: kernel modules are imported on first use. That matters on
CPU, where Triton's interpreter needs ``TRITON_INTERPRET=1`` set before triton's first import.

Public API (the kernel wrappers load triton lazily on attribute access):

* :func:`sparse_attention_fwd`, :func:`sparse_attention_bwd`, :class:`KernelConfig`, :class:`DkvConfig`
  (``dsv4cp.kernels.sparse_attention_triton``);
* ``dsv4cp.kernels.compress_pool_triton``: the compressor's pooling (forward and an atomic-free backward,
  deterministic), used by :func:`dsv4cp.ops.compress_pool.compress_pool`;
* :func:`set_deterministic`, :func:`is_deterministic`, :func:`triton_available`,
  :func:`triton_interpreting`, :func:`interpreted`, :func:`triton_serves`.

Kernel choices and launch pins are keyword arguments of the wrappers: the ops hand them the values of
the caller's :class:`~dsv4cp.kernel_options.KernelOptions`; one left out takes its option's default (a pin:
the ladder). Nothing here reads the environment or a global option.

Availability: CUDA devices; CPU when ``TRITON_INTERPRET=1`` and triton is (or will be) imported in
interpreter mode.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from dsv4cp.kernel_options import triton_interpret_requested

HAS_TRITON = importlib.util.find_spec("triton") is not None

_LAZY = {"sparse_attention_fwd", "sparse_attention_bwd", "KernelConfig", "DkvConfig", "MAX_HEAD_DIM",
         "BWD_SCRATCH_BYTES"}

__all__ = [
    "BWD_SCRATCH_BYTES",
    "HAS_TRITON",
    "MAX_HEAD_DIM",
    "DkvConfig",
    "KernelConfig",
    "interpreted",
    "is_deterministic",
    "set_deterministic",
    "sparse_attention_bwd",
    "sparse_attention_fwd",
    "triton_available",
    "triton_interpreting",
    "triton_serves",
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


def triton_interpreting() -> bool | None:
    """Whether the imported triton built its language library for the interpreter; None before import."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return None
    return type(getattr(standard, "zeros", None)).__name__ == "InterpretedFunction"


def interpreted(device: torch.device) -> bool:
    """Whether Triton kernels for tensors on ``device`` run on Triton's interpreter (CPU tensors, and
    every tensor when triton was imported under ``TRITON_INTERPRET=1``)."""
    return device.type != "cuda" or bool(triton_interpreting())


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
        return interpreting if interpreting is not None else triton_interpret_requested()
    return False


triton_available.missing_hint = (  # type: ignore[attr-defined]  (shown by resolve_backend)
    "needs the triton package and a CUDA device, or on CPU TRITON_INTERPRET=1 set before triton's first import"
)


def triton_serves(x: torch.Tensor) -> bool:
    """Whether the compiled Triton kernels of the indexer ops serve ``x [..., D]``: a CUDA tensor, not fp64
    (no fp64 matrix-unit path), ``D`` a multiple of 16, triton installed. CPU tensors stay on the torch
    references even under the interpreter (the kernel tests call the kernels directly)."""
    return x.is_cuda and x.dtype != torch.float64 and x.shape[-1] % 16 == 0 and HAS_TRITON
