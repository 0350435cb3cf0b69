"""Whole-layer microbenchmarks (DESIGN 1, 5): one :class:`DSv4Attention` layer per type, W (ratio 0),
C (ratio 4, indexer top-k and its loss) and H (a larger ratio), forward and forward + backward, at CP = 1.

Each round runs the suite's one training step (:mod:`dsv4cp.harness.build`, the step ``layer``, ``profile``
and the sweeps time) on one packed batch of a single document: ``fwd`` its forward alone (recording the
autograd graph, as a training forward does), ``fwd_bwd`` also its backward, seeded with a fixed random
upstream gradient of the output and the indexer loss, into the input and every parameter. Shapes:

* ``flash``: the flash preset, T = 16384 tokens, ratios W 0 / C 4 / H 128, bf16, ``backend="auto"``
  (GPU only; a one-GPU slice of the DESIGN's 2 x H200 workloads);
* ``tiny``:  the tiny preset, T = 64 tokens, ratios W 0 / C 4 / H 8, fp32 on CPU with the torch
  sparse-attention backend (the Triton interpreter would time the interpreter, not the layer).

FLOPs and bytes come from the analytic model (:func:`dsv4cp.model.estimate`, CP = 1, activation bytes
of the benchmark's dtype): ``flops`` is the model FLOPs of the pass, ``bytes`` its compulsory HBM traffic
summed over phases, so TFLOP/s and GB/s read against the H200's ceilings.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, bench_device, bench_dtype
from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.harness.build import LayerStep, build_step
from dsv4cp.harness.case import Case
from dsv4cp.model import BOTH, estimate


@dataclass(frozen=True)
class Shape:
    name: str
    preset: str
    tokens: int
    ratios: dict[str, int]
    """Layer kind ('W', 'C', 'H') -> the compression ratio benchmarked for it."""


SHAPES = {
    "tiny": Shape("tiny", "tiny", 64, {"W": 0, "C": 4, "H": 8}),
    "flash": Shape("flash", "flash", 16384, {"W": 0, "C": 4, "H": 128}),
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("flash", id="flash", marks=GPU_ONLY)]
PASSES = {"fwd": "fwd", "fwd_bwd": BOTH}
"""Benchmark phase -> the model's direction label."""


def _backend() -> str:
    return "auto" if HAS_CUDA else "torch"


def _rounds() -> tuple[int, int]:
    return (10, 3) if HAS_CUDA else (3, 1)


def _build(shape: Shape, ratio: int, backward: bool) -> LayerStep:
    """The seeded training step (:mod:`dsv4cp.harness.build`) of the layer on one document of the shape."""
    dtype = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}[bench_dtype()]
    device = bench_device()
    case = Case(cfg=DSv4Config.preset(shape.preset), ratio=ratio, lengths=(shape.tokens,), seed=1234 + ratio,
                dtype=dtype, device=torch.device(device).type, direction="fwd+bwd" if backward else "fwd",
                backend=_backend())
    return build_step(case, device=device)


@pytest.mark.parametrize("phase", list(PASSES))
@pytest.mark.parametrize("kind", ["W", "C", "H"])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_layer(benchmark, measure, shape_name, kind, phase):
    shape = SHAPES[shape_name]
    ratio = shape.ratios[kind]
    step = _build(shape, ratio, backward=phase == "fwd_bwd")
    cfg, layer, packed, x = step.layer.cfg, step.layer, step.packed, step.x
    assert layer_kind(ratio) == kind
    model = estimate(cfg, ratio, packed, 1, act_bytes=x.element_size())
    direction = PASSES[phase]
    table = model.records if direction == BOTH else model.table(direction)
    benchmark.group = f"layer.{kind}.{phase}.{shape.name}"
    benchmark.extra_info.update(kind=kind, ratio=ratio, phase=phase, shape=shape.name, preset=shape.preset,
                                tokens=shape.tokens, cp=1, packing="one", backend=layer.backend,
                                dtype=str(x.dtype))

    def target():
        return step().out.detach()

    def setup():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        return ()

    setup()
    target()  # compile / autotune / first-call costs outside the timing
    rounds, warmup = _rounds()
    out = measure(target, setup, flops=model.summary(direction).model_flops,
                  bytes_moved=float(table["hbm_bytes"].sum()), rounds=rounds, warmup_rounds=warmup,
                  device=x.device)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    if phase == "fwd_bwd":
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())
        assert layer.wq_a.weight.grad is not None
