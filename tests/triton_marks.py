"""What every Triton kernel test module shares: whether a CUDA device is here, the mark of a test that
needs one, and the module-level skip where Triton cannot run (on CPU its interpreter must be switched on
before triton's first import, which ``tests/conftest.py`` does)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels import triton_available

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def skip_module_without_triton() -> None:
    """Skip the calling test module where Triton cannot run on this machine's device."""
    if not triton_available(DEVICE):  # pragma: no cover - triton imported without the interpreter on CPU
        pytest.skip("triton cannot run here (CPU needs TRITON_INTERPRET=1 before triton's import)",
                    allow_module_level=True)
