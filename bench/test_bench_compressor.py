"""Token-compressor microbenchmarks (DESIGN 1.5): :class:`dsv4cp.layer.compressor.Compressor` on one
rank's rows at CP = 1, forward and forward + backward.

Compressors (``which``):

* ``kv_c``: the C layer's KV compressor (ratio 4, overlapping A/B halves, width D);
* ``kv_h``: the H layer's KV compressor (ratio 128 on flash, 8 on tiny; width D);
* ``index_k``: the indexer's key compressor (ratio 4, overlapping, width Di, Hadamard rotation).

``fwd_bwd`` back-propagates a fixed random upstream gradient of the entries into the parameters and, for
the KV compressors, the input rows; as in the layer, the indexer's compressor runs on detached rows, so
its backward computes weight gradients only (as the model counts it). Shapes:

* ``flash``: the flash preset (hidden 4096, D 512, Di 128), T = 16384 rows, bf16 (GPU only);
* ``tiny``:  the tiny preset (hidden 64, D 32, Di 16), T = 64 rows, fp32 (CPU and GPU).

FLOPs and bytes: the analytic model's ``compress`` / ``indexer.compress`` phase of the layer at CP = 1
(:func:`dsv4cp.model.estimate`, activation bytes of the benchmark's dtype).

``test_compress_pool``: the pooling op alone (:func:`dsv4cp.ops.compress_pool.compress_pool`, between the
projections and the norm), ``triton`` against ``torch``, forward and forward + backward (the backward's
time is the difference), GPU only, at the flash 64K shapes: the C layer's KV compressor (ratio 4,
overlapping halves, W = 2 x 512) and the H layer's (ratio 128, W = 512), bf16 projections. Memory-bound:
the bytes are the least traffic (forward: values and gates read, pooled and log-sum-exp written in fp32;
backward: values and gates read, their gradients written, pooled, log-sum-exp and the upstream gradient
read), no FLOPs recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, bench_device, bench_dtype
from dsv4cp.config import INDEXER_RATIO, DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.layer.compressor import Compressor
from dsv4cp.layer.rope import rope_frequencies
from dsv4cp.model import DIRECTIONS, estimate
from dsv4cp.ops.compress_pool import compress_pool
from dsv4cp.packing import PackedSeqs


@dataclass(frozen=True)
class Shape:
    name: str
    preset: str
    tokens: int
    h_ratio: int
    """The H layer's ratio benchmarked for ``kv_h``."""


SHAPES = {
    "tiny": Shape("tiny", "tiny", 64, 8),
    "flash": Shape("flash", "flash", 16384, 128),
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("flash", id="flash", marks=GPU_ONLY)]
WHICH = ("kv_c", "kv_h", "index_k")


def _rounds() -> tuple[int, int]:
    return (10, 3) if HAS_CUDA else (3, 1)


def _compressor(cfg: DSv4Config, which: str, h_ratio: int) -> tuple[Compressor, int, str]:
    """The module, its layer's ratio and the model phase that costs it."""
    if which == "kv_c":
        return Compressor(cfg.hidden, cfg.head_dim, INDEXER_RATIO, cfg.rms_eps), INDEXER_RATIO, "compress"
    if which == "kv_h":
        return Compressor(cfg.hidden, cfg.head_dim, h_ratio, cfg.rms_eps), h_ratio, "compress"
    module = Compressor(cfg.hidden, cfg.index_head_dim, INDEXER_RATIO, cfg.rms_eps, rotate=cfg.hadamard)
    return module, INDEXER_RATIO, "indexer.compress"


@pytest.mark.parametrize("phase", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_compressor(benchmark, measure, shape_name, which, phase):
    shape = SHAPES[shape_name]
    device, dtype = bench_device(), bench_dtype()
    cfg = DSv4Config.preset(shape.preset)
    module, ratio, model_phase = _compressor(cfg, which, shape.h_ratio)
    generator = torch.Generator().manual_seed(1234 + ratio)
    with torch.no_grad():  # non-trivial parameters: positional biases and norm weights too
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    module = module.to(device=device, dtype=dtype)
    packed = PackedSeqs.from_lengths([shape.tokens], device=device)
    layout = build_layout(packed, cfg, ratio)
    freqs = rope_frequencies(cfg, ratio).to(device)
    inputs = torch.Generator(device=device).manual_seed(4321 + ratio)
    x = torch.randn(layout.ext_rows, cfg.hidden, generator=inputs, device=device, dtype=dtype)
    x.requires_grad_(which != "index_k")  # the layer detaches the indexer's input
    upstream = torch.randn(layout.capacity, module.dim, generator=inputs, device=device, dtype=dtype)

    model = estimate(cfg, ratio, packed, 1, act_bytes=x.element_size()).table()
    rows = model[model["phase"] == model_phase]
    if phase == "fwd":
        rows = rows[rows["direction"] == "fwd"]
    else:
        assert set(rows["direction"]) == set(DIRECTIONS)
    benchmark.group = f"compressor.{which}.{phase}.{shape.name}"
    benchmark.extra_info.update(which=which, ratio=ratio, phase=phase, shape=shape.name, preset=shape.preset,
                                rows=layout.ext_rows, hidden=cfg.hidden, width=module.dim,
                                entries=layout.capacity, dtype=str(x.dtype))

    if phase == "fwd":
        def target():
            with torch.no_grad():
                return module(x, layout, freqs)
    else:
        def target():
            entries = module(x, layout, freqs)
            entries.backward(upstream)
            return entries.detach()

    def setup():
        x.grad = None
        module.zero_grad(set_to_none=True)
        return ()

    setup()
    target()  # first-call costs outside the timing
    rounds, warmup = _rounds()
    out = measure(target, setup, flops=float(rows["flops"].sum()), bytes_moved=float(rows["hbm_bytes"].sum()),
                  rounds=rounds, warmup_rounds=warmup, device=device)
    assert out.shape == (layout.capacity, module.dim) and bool(torch.isfinite(out).all())
    assert float(out.float().abs().sum()) > 0
    if phase == "fwd_bwd":
        assert module.wkv.weight.grad is not None and bool(torch.isfinite(module.wkv.weight.grad).all())
        assert (x.grad is None) == (which == "index_k")


POOL_TOKENS = 65536
POOL_RATIOS = {"kv_c": 4, "kv_h": 128}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="flash-size pooling needs CUDA")
@pytest.mark.parametrize("phase", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("which", list(POOL_RATIOS))
def test_compress_pool(benchmark, measure, which, backend, phase):
    cfg = DSv4Config.preset("flash")
    ratio, device, dtype = POOL_RATIOS[which], torch.device("cuda"), torch.bfloat16
    packed = PackedSeqs.from_lengths([POOL_TOKENS], device=device)
    layout = build_layout(packed, cfg, ratio)
    halves = layout.group_rows.shape[1] // ratio
    width = halves * cfg.head_dim
    generator = torch.Generator(device=device).manual_seed(2024 + ratio)
    values = torch.randn(layout.ext_rows, width, generator=generator, device=device, dtype=dtype)
    gates = torch.randn(layout.ext_rows, width, generator=generator, device=device, dtype=dtype)
    ape = torch.randn(ratio, width, generator=generator, device=device) * 0.1
    upstream = torch.randn(layout.capacity, cfg.head_dim, generator=generator, device=device)
    leaves = [t.requires_grad_(phase == "fwd_bwd") for t in (values, gates, ape)]
    args = (*leaves, layout.group_rows, layout.group_valid)

    io_bytes = 2 * values.numel() * values.element_size()
    entry_bytes = layout.capacity * cfg.head_dim * 4
    bytes_moved = io_bytes + 2 * entry_bytes + (2 * io_bytes + 3 * entry_bytes if phase == "fwd_bwd" else 0)
    benchmark.group = f"compress_pool.{which}.{phase}"
    benchmark.extra_info.update(which=which, ratio=ratio, backend=backend, phase=phase, rows=layout.ext_rows,
                                width=width, entries=layout.capacity, dtype=str(dtype))

    if phase == "fwd":
        def target():
            with torch.no_grad():
                return compress_pool(*args, backend=backend)
    else:
        def target():
            pooled = compress_pool(*args, backend=backend)
            pooled.backward(upstream)
            return pooled.detach()

    def setup():
        for leaf in leaves:
            leaf.grad = None
        return ()

    setup()
    target()  # compilation outside the timing
    out = measure(target, setup, flops=0.0, bytes_moved=float(bytes_moved), rounds=10, warmup_rounds=3,
                  device=device)
    assert out.shape == (layout.capacity, cfg.head_dim) and bool(torch.isfinite(out).all())
    if phase == "fwd_bwd":
        assert all(leaf.grad is not None and bool(torch.isfinite(leaf.grad).all()) for leaf in leaves)
