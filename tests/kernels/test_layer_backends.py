"""The layer on the Triton kernels equals the layer on the torch oracle (forward, input and
parameter gradients), at flash shapes on a GPU. CP = 2 is covered by ``dsv4cp check-cp
--kernel-backend triton`` on two GPUs (results/)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.harness.build import randomize_

pytestmark = pytest.mark.gpu

COSINE_MIN = 1 - 1e-3  # DESIGN 3.8, bf16


def _run(backend: str, ratio: int, packed: PackedSeqs, seed: int):
    cfg = DSv4Config.preset("flash")
    generator = torch.Generator().manual_seed(seed)
    layer = DSv4Attention(cfg, ratio, backend=backend)
    randomize_(layer, generator)
    layer = layer.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(packed.total, cfg.hidden, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    weight = torch.randn(packed.total, cfg.hidden, generator=generator).to("cuda", torch.bfloat16)
    res = layer(x, packed)
    loss = (res.out.float() * weight.float()).sum() + (res.indexer_loss if res.indexer_loss is not None else 0)
    loss.backward()
    return [("out", res.out), ("x_grad", x.grad)] + [(n, p.grad) for n, p in layer.named_parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_triton_layer_matches_torch_layer(ratio: int) -> None:
    packed = PackedSeqs.from_lengths([3000, 77, 0, 5115], total=8192, device="cuda")
    got, want = _run("triton", ratio, packed, seed=ratio), _run("torch", ratio, packed, seed=ratio)
    for (name, a), (_, b) in zip(got, want):
        if b is None:
            assert a is None, name
            continue
        cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
        assert cos > COSINE_MIN, f"{name}: cosine {cos.item():.6f}"
