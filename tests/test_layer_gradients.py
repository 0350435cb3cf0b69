"""Input and parameter gradients of the layer: against the reference's autograd, gradcheck, and the
indexer's gradient isolation (DESIGN 1.6: the indexer runs on detached inputs)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from conftest import (
    INDEXER_PREFIX,
    MICRO,
    assert_close_rel,
    assert_margin,
    cfg_for,
    make_layer,
    packed,
    param_state,
    randn,
    run_reference,
    seed_of,
)

# ratio -> (lengths, pad_to_multiple, tail)
GRAD_CASES = {
    0: ([13, 0, 22], 4, 3),
    4: ([45, 7, 0, 18], 4, 3),
    8: ([29, 11], 8, 2),
    128: ([260, 9], 1, 2),
}
GRAD_PARAMS = [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse"), (128, "sparse")]
LOSS_WEIGHT = 10.0


def _is_zero_grad(g) -> bool:
    return g is None or bool(torch.all(g == 0))


@pytest.mark.parametrize("r,loss", GRAD_PARAMS, ids=[f"r{r}-{loss}" for r, loss in GRAD_PARAMS])
def test_gradients_match_reference(r, loss):
    lengths, pad, tail = GRAD_CASES[r]
    cfg = cfg_for(r, indexer_loss=loss)
    pk = packed(lengths, pad, tail)
    seed = seed_of("grad", r, loss)
    layer = make_layer(cfg, r, seed=seed)
    x = randn(pk.total, cfg.hidden, seed=seed + 1)
    dout = randn(pk.total, cfg.hidden, seed=seed + 2)

    xl = x.clone().requires_grad_(True)
    res = layer(xl, pk)
    obj = (res.out * dout).sum()
    if r == 4:
        obj = obj + LOSS_WEIGHT * res.indexer_loss
    obj.backward()

    state = param_state(layer, requires_grad=True)
    xr = x.clone().requires_grad_(True)
    info = {}
    ref_out, ref_loss = run_reference(state, cfg, r, xr, pk, info=info)
    assert_margin(info, 1e-9)
    ref_obj = (ref_out * dout).sum()
    if r == 4:
        ref_obj = ref_obj + LOSS_WEIGHT * ref_loss
    ref_obj.backward()

    assert_close_rel(xl.grad, xr.grad, 1e-9, "dx")
    assert torch.all(xl.grad[pk.padded_end:] == 0), "tail rows must get exactly zero gradient"
    for name, prm in layer.named_parameters():
        ref_g = state[name].grad
        assert ref_g is not None and ref_g.abs().max() > 0, name
        assert prm.grad is not None, f"{name}: no gradient"
        assert_close_rel(prm.grad, ref_g, 1e-9, f"d{name}")


@pytest.mark.parametrize("loss", ["sparse", "dense"])
def test_indexer_loss_reaches_only_indexer_parameters(loss):
    cfg = cfg_for(4, indexer_loss=loss)
    pk = packed([45, 7, 0, 18], 4, 3)
    seed = seed_of("isolation", loss)
    layer = make_layer(cfg, 4, seed=seed)
    x = randn(pk.total, cfg.hidden, seed=seed + 1).requires_grad_(True)
    res = layer(x, pk)
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad(res.indexer_loss, (x,) + params, allow_unused=True)
    assert _is_zero_grad(grads[0]), "the indexer loss must not reach x"
    state = param_state(layer, requires_grad=True)
    _, ref_loss = run_reference(state, cfg, 4, x.detach(), pk)
    ref_loss.backward()
    for name, g in zip(names, grads[1:]):
        if name.startswith(INDEXER_PREFIX):
            assert g is not None and g.abs().max() > 0, f"{name}: indexer parameter without gradient"
            assert_close_rel(g, state[name].grad, 1e-9, f"d{name}")
        else:
            assert _is_zero_grad(g), f"{name}: the indexer loss must not reach non-indexer parameters"


def test_attention_output_gives_no_gradient_to_the_indexer():
    """The selection is discrete: the attention output never reaches indexer parameters."""
    cfg = cfg_for(4)
    pk = packed([50, 9], 1, 0)
    layer = make_layer(cfg, 4, seed=seed_of("nosel"))
    x = randn(pk.total, cfg.hidden, seed=5)
    out = layer(x, pk).out
    named = [(n, p) for n, p in layer.named_parameters() if n.startswith(INDEXER_PREFIX)]
    grads = torch.autograd.grad((out * randn(*out.shape, seed=6)).sum(), [p for _, p in named], allow_unused=True)
    for (name, _), g in zip(named, grads):
        assert _is_zero_grad(g), name


# ---------------------------------------------------------------------------------------- gradcheck
GC_CASES = {0: ([9, 0, 6], 1, 1), 4: ([14, 0, 6], 1, 1), 8: ([17, 5], 1, 1)}


FAST_AND_FULL = [pytest.param(True, id="fast"), pytest.param(False, id="full", marks=pytest.mark.slow)]


@pytest.mark.parametrize("fast", FAST_AND_FULL)
@pytest.mark.parametrize("r", [0, 4, 8])
def test_gradcheck_layer_wrt_x(r, fast):
    cfg = cfg_for(r, base=MICRO)
    lengths, pad, tail = GC_CASES[r]
    pk = packed(lengths, pad, tail)
    layer = make_layer(cfg, r, seed=seed_of("gc", r))
    x = randn(pk.total, cfg.hidden, seed=seed_of("gcx", r)).requires_grad_(True)
    info = {}
    run_reference(param_state(layer), cfg, r, x.detach(), pk, info=info)
    assert_margin(info, 1e-4)

    def fn(inp):
        return layer(inp, pk).out

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=fast)


INDEXER_PARAMS = [
    "indexer.wq_b.weight", "indexer.weights_proj.weight", "indexer.compressor.wkv.weight",
    "indexer.compressor.wgate.weight", "indexer.compressor.ape", "indexer.compressor.norm.weight",
]


@pytest.mark.parametrize("fast", FAST_AND_FULL)
@pytest.mark.parametrize("loss", ["sparse", "dense"])
@pytest.mark.parametrize("name", INDEXER_PARAMS)
def test_gradcheck_indexer_loss_wrt_indexer_parameters(name, loss, fast):
    cfg = cfg_for(4, base=MICRO, indexer_loss=loss)
    pk = packed([19, 0, 10], 1, 1)
    layer = make_layer(cfg, 4, seed=seed_of("gci", loss))
    x = randn(pk.total, cfg.hidden, seed=seed_of("gcix", loss))
    info = {}
    run_reference(param_state(layer), cfg, 4, x, pk, info=info)
    assert_margin(info, 1e-4)
    prm = dict(layer.named_parameters())[name].detach().clone().requires_grad_(True)

    def fn(p):
        return functional_call(layer, {name: p}, (x, pk)).indexer_loss

    assert fn(prm).item() > 0
    assert torch.autograd.gradcheck(fn, (prm,), eps=1e-6, atol=1e-8, rtol=1e-4, fast_mode=fast)
