"""What every benchmark module shares: where it runs, in which dtype, and the GPU-only marks."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
T = TypeVar("T")

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")]
"""Marks for a GPU-size parameter: it runs only on a CUDA device (and under ``-m gpu``)."""


def bench_device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def bench_dtype() -> torch.dtype:
    """bf16 on the GPU (what the model runs in); fp32 for the tiny CPU cases under the interpreter."""
    return torch.bfloat16 if HAS_CUDA else torch.float32


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``tokens`` query rows of ``heads`` heads of width ``dim``, each reading ``topk``
    selected compressed entries out of ``n_compressed`` (ratio 4), plus ``window`` sliding-window slots
    (sparse attention) and an indexer of ``index_heads`` heads of width ``index_dim`` (indexer loss)."""

    name: str
    tokens: int
    heads: int
    dim: int
    topk: int
    window: int = 0
    index_heads: int = 0
    index_dim: int = 0

    @property
    def n_compressed(self) -> int:
        """Compressed entries of a ratio-4 layer over ``tokens`` rows, at least ``topk`` (tiny shapes)."""
        return max(self.tokens // 4, self.topk)

    @property
    def kt(self) -> int:
        """Slots per query of the sparse attention: the window's, then the selected entries'."""
        return self.window + self.topk


def one_shape_at_a_time(build: Callable[..., T]) -> Callable[..., T]:
    """``build(shape)`` cached for the last shape it built on this run's device: a new shape drops the
    previous one's tensors first (a GPU-size shape holds several GiB), so the benchmarks of one shape share
    one set of inputs."""
    cache: dict = {}

    @functools.wraps(build)
    def cached(shape) -> T:
        key = (shape.name, bench_device().type)
        if key not in cache:
            cache.clear()
            gc.collect()
            cache[key] = build(shape)
        return cache[key]

    return cached
