"""Module casts keep the tables DeepSeek-V4 holds in high precision.

``rope_freqs`` stays fp64, ``attn_sink`` and every compressor ``ape`` (the indexer's too) stay fp32 or
finer under ``.to(dtype)``, ``.bfloat16()``, ``.half()``, ``.double()`` and ``.to(device, dtype)``,
while still following device moves; and a bf16 layer is measurably closer to the fp64 reference than
one whose RoPE table was rounded to bf16.
"""

from __future__ import annotations

import pytest
import torch

from conftest import cfg_for, make_layer, packed, param_state, randn, run_reference, seed_of

PINNED_FP32 = ("attn_sink", "compressor.ape", "indexer.compressor.ape")

CASTS = {
    "to(bf16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "to(cpu, bf16)": (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
    "float()": (lambda m: m.float(), torch.float32),
    "double()": (lambda m: m.double(), torch.float64),
}


def _finer(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps <= torch.finfo(b).eps else b


def _pinned(layer) -> dict[str, torch.Tensor]:
    params = dict(layer.named_parameters())
    return {name: params[name] for name in PINNED_FP32 if name in params}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_casts_keep_pinned_tables(ratio, cast):
    apply, dtype = CASTS[cast]
    layer = make_layer(cfg_for(ratio), ratio, seed=seed_of("cast", ratio), dtype=torch.float32)
    before = {name: t.detach().clone() for name, t in _pinned(layer).items()}
    freqs = layer.rope_freqs.clone()
    assert apply(layer) is layer
    assert layer.wq_a.weight.dtype == dtype and layer.kv_norm.weight.dtype == dtype
    assert layer.rope_freqs.dtype == torch.float64 and torch.equal(layer.rope_freqs, freqs)
    pinned = _pinned(layer)
    assert len(pinned) == 1 + (ratio > 0) + (ratio == 4)
    for name, tensor in pinned.items():
        assert isinstance(tensor, torch.nn.Parameter), name
        assert tensor.dtype == _finer(dtype, torch.float32), f"{name}: {tensor.dtype} after {cast}"
        assert torch.equal(tensor.double(), before[name].double()), f"{name}: values rounded by {cast}"


def test_fp64_layer_cast_to_bf16_keeps_fp32_values():
    """From fp64, the pinned tables land on fp32 (their floor), rounded once, not through bf16."""
    layer = make_layer(cfg_for(4), 4, seed=seed_of("fp64-to-bf16"), dtype=torch.float64)
    before = {name: t.detach().clone() for name, t in _pinned(layer).items()}
    layer.to(torch.bfloat16)
    for name, tensor in _pinned(layer).items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, before[name].float()), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["device", "device+bf16"])
def test_device_moves_still_move_pinned_tables(dtype):
    """The meta device stands in for a GPU: pinned tables move with the rest, keeping their dtype."""
    layer = make_layer(cfg_for(4), 4, seed=seed_of("meta"), dtype=torch.float32)
    if dtype is None:
        layer.to("meta")
    else:
        layer.to("meta", dtype)
    assert all(t.device.type == "meta" for t in [*layer.parameters(), *layer.buffers()])
    assert layer.rope_freqs.dtype == torch.float64
    assert all(t.dtype == torch.float32 for t in _pinned(layer).values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_move_keeps_pinned_tables():
    layer = make_layer(cfg_for(4), 4, seed=seed_of("cuda"), dtype=torch.float32).to("cuda", torch.bfloat16)
    assert layer.rope_freqs.is_cuda and layer.rope_freqs.dtype == torch.float64
    assert all(t.is_cuda and t.dtype == torch.float32 for t in _pinned(layer).values())


def test_gradients_follow_their_pinned_parameter():
    layer = make_layer(cfg_for(4), 4, seed=seed_of("grads"), dtype=torch.float32)
    for tensor in layer.parameters():
        tensor.grad = torch.ones_like(tensor) / 3  # not representable in bf16
    layer.to(torch.bfloat16)
    for name, tensor in _pinned(layer).items():
        assert tensor.grad.dtype == torch.float32 and torch.all(tensor.grad == torch.tensor(1 / 3)), name
    assert layer.wq_a.weight.grad.dtype == torch.bfloat16


def test_state_dict_round_trip_keeps_dtypes_and_values():
    cfg = cfg_for(4)
    layer = make_layer(cfg, 4, seed=seed_of("state"), dtype=torch.float32).to(torch.bfloat16)
    state = layer.state_dict()
    assert all(state[name].dtype == torch.float32 for name in PINNED_FP32)
    fresh = make_layer(cfg, 4, seed=seed_of("state", "other"), dtype=torch.float32).to(torch.bfloat16)
    fresh.load_state_dict(state)
    for name, tensor in fresh.state_dict().items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name


def test_bf16_forward_backward_with_fp32_tables():
    """bf16 activations meet fp32 sink / ape and fp64 RoPE in every path, forward and backward."""
    cfg = cfg_for(4)
    layer = make_layer(cfg, 4, seed=seed_of("bf16-train"), dtype=torch.float32).to(torch.bfloat16)
    pk = packed([70, 33])
    x = randn(pk.total, cfg.hidden, seed=seed_of("bf16-train", "x"), dtype=torch.bfloat16).requires_grad_()
    result = layer(x, pk)
    assert result.out.dtype == torch.bfloat16
    (result.out.float().square().mean() + result.indexer_loss.float()).backward()
    assert torch.isfinite(x.grad.float()).all()
    for name, tensor in _pinned(layer).items():
        assert tensor.grad is not None and tensor.grad.dtype == torch.float32, name
        assert torch.isfinite(tensor.grad).all() and tensor.grad.abs().max() > 0, name


def test_bf16_layer_tracks_the_fp64_reference_at_large_distances():
    """An H layer (ratio 16) over one 4000-token document: queries attend to compressed entries up to
    4000 positions away, where a bf16 RoPE table is off by up to ~0.5 rad (0.2% of a frequency of ~0.1).

    Relative Frobenius error of the second half of the rows: ~0.004 with the fp64 table (bf16 rounding
    of activations), 0.010-0.015 with it rounded to bf16 (measured over six seeds).
    """
    ratio, length = 16, 4000
    cfg = cfg_for(ratio)
    pk = packed([length])
    seed = seed_of("bf16-long-document")
    layer = make_layer(cfg, ratio, seed=seed, dtype=torch.float64).to(torch.bfloat16)
    x = randn(pk.total, cfg.hidden, seed=seed + 1, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x, pk).out
        ref, _ = run_reference(param_state(layer), cfg, ratio, x, pk)
    late = slice(length // 2, None)
    err = float((out[late].double() - ref[late]).norm() / ref[late].norm())
    assert err < 6e-3, f"bf16 layer vs fp64 reference: relative error {err:.2e} on positions >= {length // 2}"
