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
