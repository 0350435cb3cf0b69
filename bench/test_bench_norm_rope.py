"""Query norm + RoPE and output un-rotation microbenchmarks (DESIGN 1.3, 5): the torch composition of
:mod:`dsv4cp.layer` against the fused Triton kernels of :mod:`dsv4cp.kernels.norm_rope_triton`.

Ops on ``x [rows, H, D]`` with P rotary dims:

* ``norm_rope``: ``apply_rope(rms_norm(x, eps), positions, freqs)`` vs ``head_norm_rope`` (the query path);
* ``rope_inverse``: ``apply_rope(x, positions, freqs, inverse=True)`` vs ``rope_tail(..., inverse=True)``
  (the attention output before the output projection).

Phases: ``fwd`` (forward only, no autograd graph) and ``fwd_bwd`` (forward then ``backward`` of a fixed
random upstream gradient into the leaf x). Shapes:

* ``flash``: rows = 32768, H = 64, D = 512, P = 64 (one rank's rows of the flash preset; GPU only, bf16)
* ``tiny``:  rows = 8,     H = 4,  D = 32,  P = 8  (CPU and GPU; fp32 on CPU, Triton's interpreter)

Bytes: the fused kernels' traffic (read x, write y: 2 tensors forward; read g (and x for the norm),
write dx: 2 or 3 tensors backward), the same figure for both backends, so GB/s compares like with like.
FLOPs: nominal, 8 per element per pass (these ops are bound by memory traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, bench_device, bench_dtype, one_shape_at_a_time
from dsv4cp.layer.norm import rms_norm
from dsv4cp.layer.rope import apply_rope

EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    heads: int
    dim: int
    rope_dim: int


SHAPES = {
    "tiny": Shape("tiny", 8, 4, 32, 8),
    "flash": Shape("flash", 32768, 64, 512, 64),
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("flash", id="flash", marks=GPU_ONLY)]




def _fused(op: str):
    pytest.importorskip("triton")
    from dsv4cp.kernels import triton_available

    if not triton_available(bench_device()):
        pytest.skip("triton cannot run here (CPU needs TRITON_INTERPRET=1 before triton's import)")
    from dsv4cp.kernels.norm_rope_triton import head_norm_rope, rope_tail

    if op == "norm_rope":
        return lambda x, positions, freqs: head_norm_rope(x, positions, freqs, EPS)
    return lambda x, positions, freqs: rope_tail(x, positions, freqs, inverse=True)


def _torch(op: str):
    if op == "norm_rope":
        return lambda x, positions, freqs: apply_rope(rms_norm(x, EPS), positions, freqs)
    return lambda x, positions, freqs: apply_rope(x, positions, freqs, inverse=True)


@one_shape_at_a_time
def _inputs(shape: Shape):
    """Cached ``(x leaf requiring grad, upstream gradient, positions, freqs)`` for the shape."""
    device, dtype = bench_device(), bench_dtype()
    g = torch.Generator(device=device).manual_seed(1234)
    size = (shape.rows, shape.heads, shape.dim)
    x = (torch.randn(size, device=device, generator=g) * 3.0).to(dtype).requires_grad_(True)
    grad = torch.randn(size, device=device, generator=g).to(dtype)
    positions = torch.randint(0, 2**20, (shape.rows,), device=device, generator=g)
    p = shape.rope_dim
    freqs = 10000.0 ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)
    return x, grad, positions, freqs


def _bytes(shape: Shape, op: str, phase: str) -> float:
    tensor = shape.rows * shape.heads * shape.dim * (torch.finfo(bench_dtype()).bits // 8)
    fwd = 2 * tensor
    bwd = (3 if op == "norm_rope" else 2) * tensor
    return float(fwd + (bwd if phase == "fwd_bwd" else 0))


def _rounds() -> tuple[int, int]:
    return (10, 3) if HAS_CUDA else (2, 1)


@pytest.mark.parametrize("phase", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["norm_rope", "rope_inverse"])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_norm_rope(benchmark, measure, shape_name, op, backend, phase):
    shape = SHAPES[shape_name]
    fn = _torch(op) if backend == "torch" else _fused(op)
    x, grad, positions, freqs = _inputs(shape)
    benchmark.group = f"norm_rope.{op}.{phase}.{shape.name}"
    benchmark.extra_info.update(op=op, backend=backend, phase=phase, shape=shape.name, rows=shape.rows,
                                H=shape.heads, D=shape.dim, P=shape.rope_dim, dtype=str(x.dtype))

    if phase == "fwd":
        def target():
            with torch.no_grad():
                return fn(x, positions, freqs)
    else:
        def target():
            out = fn(x, positions, freqs)
            out.backward(grad)
            return out.detach()

    def setup():
        x.grad = None
        return ()

    setup()
    target()  # compile / first-call costs outside the timing
    rounds, warmup = _rounds()
    elements = shape.rows * shape.heads * shape.dim
    out = measure(target, setup, flops=8.0 * elements * (2 if phase == "fwd_bwd" else 1),
                  bytes_moved=_bytes(shape, op, phase), rounds=rounds, warmup_rounds=warmup, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype
    if phase == "fwd_bwd":
        assert x.grad is not None and x.grad.shape == x.shape
    x.grad = None
