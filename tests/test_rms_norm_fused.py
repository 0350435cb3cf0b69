"""The weighted RMS norm on CUDA (torch's fused kernel) against the fp32 composition it replaces, forward and
backward, for the layer's dtypes: bf16 rows with a bf16 weight (the key and query norms) and fp32 rows
with a bf16 weight (the compressors' pooled entries). GPU only (marked ``gpu``); CPU runs the composition."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.norm_rope import rms_norm

EPS = 1e-6


def _composition(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_weighted_norm_matches_the_composition(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(4096, 512, generator=gen)).to("cuda", dtype)
    weight = (1 + 0.2 * torch.randn(512, generator=gen)).to("cuda", torch.bfloat16)
    upstream = torch.randn(4096, 512, generator=gen).to("cuda", dtype)
    results = []
    for norm in (lambda a, w: rms_norm(a, EPS, w), _composition):
        a, w = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = norm(a, w)
        out.backward(upstream)
        results.append((out, a.grad, w.grad))
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20  # a few units in the last place
    for name, got, want in zip(("out", "x.grad", "weight.grad"), *results):
        assert got.dtype == want.dtype, name
        err = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1.0)).max().item()
        assert err <= 4 * step if name != "weight.grad" else err <= 1e-2, f"{name}: {err:.3e}"
