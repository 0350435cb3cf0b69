"""What every benchmark module shares: where it runs, in which dtype, and the GPU-only marks."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")]
"""Marks for a GPU-size parameter: it runs only on a CUDA device (and under ``-m gpu``)."""


def bench_device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def bench_dtype() -> torch.dtype:
    """bf16 on the GPU (what the model runs in); fp32 for the tiny CPU cases under the interpreter."""
    return torch.bfloat16 if HAS_CUDA else torch.float32
