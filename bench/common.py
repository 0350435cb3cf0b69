"""What every benchmark module shares: where it runs, in which dtype, and the GPU-only marks."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")]
"""Marks for a GPU-size parameter: it runs only on a CUDA device (and under ``-m gpu``)."""


def bench_device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def device_label(device: torch.device) -> str:
    """What ``extra_info["device"]`` holds and ``dsv4cp compare`` matches: the GPU's name, or
    ``cpu-<cores>core`` (the CPU label of the sweeps' records)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{os.cpu_count()}core"


def bench_dtype() -> torch.dtype:
    """bf16 on the GPU (what the model runs in); fp32 for the tiny CPU cases under the interpreter."""
    return torch.bfloat16 if HAS_CUDA else torch.float32
