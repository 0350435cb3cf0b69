"""Benchmarks of the optional library backends (DESIGN 4.2, 4.3, 5): FlashMLA's forward and cuDNN's DSA
backward at the ``flash`` (T = 16384, H = 64, D = 512, Kt = 640) and ``pro`` (H = 128, Kt = 1152) shapes,
N = T + T/4 kv rows, bf16.

Each is timed two ways: ``adapter`` (the registered backend, i.e. the op contract with its padding and
conversions; at these shapes nothing needs padding) and ``library`` (the raw library call on arguments
prepared outside the timing), so any adapter overhead shows side by side. Inputs, FLOP and byte counts
and the CUDA-event timing come from ``bench/test_bench_sparse_attention.py`` and ``bench/conftest.py``:
forward ``4 D`` FLOPs per (query, head, valid key), backward 2.5x; ``extra_info["tflops"]``.

Skipped unless the library imports on a CUDA device (``dsv4cp.kernels.{flashmla,cudnn_dsa}.available``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bench.common import HAS_CUDA
from bench.test_bench_sparse_attention import (
    SHAPES,
    _backward_inputs,
    _bytes,
    _flops_forward,
    _inputs,
    _rounds,
)
from dsv4cp.kernels import cudnn_dsa, flashmla

SHAPE_PARAMS = [pytest.param("flash", id="flash"), pytest.param("pro", id="pro")]
PATHS = ["adapter", "library"]
pytestmark = pytest.mark.gpu


def _require(module) -> torch.device:
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    problem = module.unavailable_reason(device)
    if problem:
        pytest.skip(f"{module.NAME}: {problem}")
    return device


def _describe(benchmark, shape, entry, backend: str, path: str, q: torch.Tensor) -> None:
    benchmark.extra_info.update(backend=backend, path=path, shape=shape.name, T=shape.tokens, H=shape.heads,
                                D=shape.dim, Kt=shape.kt, valid_keys=entry["valid"], dtype=str(q.dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_flashmla_forward(benchmark, measure, shape_name, path):
    _require(flashmla)
    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    benchmark.group = f"sparse_attention.fwd.{shape.name}"
    _describe(benchmark, shape, entry, "flashmla", path, q)
    if path == "adapter":
        def call():
            return flashmla.sparse_attention_forward(q, kv, idx, sink, scale, None)
    else:
        sparse_fwd = importlib.import_module("flash_mla").flash_mla_sparse_fwd
        assert shape.heads in flashmla.HEAD_GROUP_SIZES and shape.kt % flashmla.TOPK_MULTIPLE == 0
        kv_lib, idx_lib = kv.unsqueeze(1), idx.unsqueeze(1)
        options = flashmla.call_options(sparse_fwd, q.device)  # use_legacy=True: the wheel on SM90
        benchmark.extra_info.update(library_options=options)

        def call():
            return sparse_fwd(q, kv_lib, idx_lib, scale, d_v=flashmla.VALUE_DIM, attn_sink=sink, topk_length=None,
                              **options)

    call()  # first-call costs (kernel load, scheduler metadata) outside the timing
    rounds, warmup = _rounds()
    result = measure(call, None, flops=_flops_forward(shape, entry["valid"]),
                     bytes_moved=_bytes(shape, entry["valid"], False), rounds=rounds, warmup_rounds=warmup,
                     device=q.device)
    assert result[0].shape == q.shape


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_cudnn_backward(benchmark, measure, shape_name, path):
    _require(cudnn_dsa)
    if torch.are_deterministic_algorithms_enabled():
        pytest.skip("cudnn: not deterministic (fp32 atomics)")
    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    out, lse, dout = _backward_inputs(shape, entry)
    benchmark.group = f"sparse_attention.bwd.{shape.name}"
    _describe(benchmark, shape, entry, "cudnn", path, q)
    if path == "adapter":
        def call():
            return cudnn_dsa.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, None)
    else:
        wrapper = importlib.import_module("cudnn").DSA.sparse_attention_backward_wrapper
        assert shape.heads % cudnn_dsa.HEAD_MULTIPLE == 0 and shape.kt % cudnn_dsa.TOPK_MULTIPLE == 0

        def call():
            return cudnn_dsa._unpack(wrapper(q, kv, out, dout, lse, sink, idx, softmax_scale=scale,
                                             topk_length=None))

    call()  # compiles the CuTe DSL kernels (seconds) outside the timing
    rounds, warmup = _rounds()
    dq, dkv, dsink = measure(call, None, flops=2.5 * _flops_forward(shape, entry["valid"]),
                             bytes_moved=_bytes(shape, entry["valid"], True), rounds=rounds,
                             warmup_rounds=warmup, device=q.device)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dsink.shape == sink.shape
