"""Non-finite values are never hidden: a NaN or infinity in the C layer's input or weights makes the
indexer loss NaN (the top-k skips non-finite scores, docs/design.md §4.5, so they used to drop out of
the loss silently), while finite results are bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_C, make_layer, packed, randn, seed_of
from dsv4cp.cp.layout import build_layout
from dsv4cp.layer.indexer_loss import _sparse_loss, indexer_loss
from dsv4cp.ops.indexer import indexer_topk

LENGTHS, TAIL = [70, 33], 5
NAN, INF = float("nan"), float("inf")


def _poison(case: str, layer: torch.nn.Module, x: torch.Tensor) -> None:
    """Put a non-finite value where ``case`` says (in place, before the step)."""
    with torch.no_grad():
        if case == "nan in wq_a.weight":  # every query latent: the indexer selects nothing
            layer.wq_a.weight[3, 5] = NAN
        elif case == "all-nan input":
            x.fill_(NAN)
        elif case == "nan in indexer.wq_b.weight":  # the attention stays finite: only the indexer sees it
            layer.indexer.wq_b.weight[7, 2] = NAN
        elif case == "inf in indexer.weights_proj.weight":
            layer.indexer.weights_proj.weight[1, 4] = INF
        elif case == "nan in indexer.compressor.wkv.weight":  # every indexer key
            layer.indexer.compressor.wkv.weight[0, 0] = NAN
        elif case == "nan in input row 5":
            x[5] = NAN
        elif case != "none":
            raise AssertionError(case)


CASES = ["nan in wq_a.weight", "all-nan input", "nan in indexer.wq_b.weight", "inf in indexer.weights_proj.weight",
         "nan in indexer.compressor.wkv.weight", "nan in input row 5"]


def _step(case: str, variant: str):
    cfg = TINY_C.replace(indexer_loss=variant)
    pk = packed(LENGTHS, tail=TAIL)
    layer = make_layer(cfg, 4, seed=seed_of("nonfinite layer", variant), dtype=torch.float32)
    x = randn(pk.total, cfg.hidden, seed=seed_of("nonfinite x", variant), dtype=torch.float32)
    _poison(case, layer, x)
    x.requires_grad_()
    res = layer(x, pk)
    (res.out.square().sum() + res.indexer_loss).backward()
    return res, layer


@pytest.mark.parametrize("variant", ["sparse", "dense"])
@pytest.mark.parametrize("case", CASES)
def test_a_nonfinite_input_or_weight_makes_the_indexer_loss_nan(case: str, variant: str) -> None:
    control, _ = _step("none", variant)
    assert torch.isfinite(control.indexer_loss) and control.indexer_loss > 0 and torch.isfinite(control.out).all()
    res, layer = _step(case, variant)
    assert torch.isnan(res.indexer_loss), f"{case}: indexer loss {res.indexer_loss.item()}"


def test_a_nan_key_is_never_selected_and_the_loss_reports_it() -> None:
    """The documented rule at the layer: the NaN indexer key of row 5's entry is not selected, rows far
    enough past the window stay finite, and the loss is NaN."""
    res, _ = _step("nan in input row 5", "sparse")
    window = TINY_C.window
    later = res.out[5 + window + 4: LENGTHS[0]]  # past the window and past the entry that pools row 5
    assert later.shape[0] > 0 and torch.isfinite(later).all()
    assert torch.isnan(res.indexer_loss)


def test_finite_loss_and_gradients_are_bitwise_those_without_the_check() -> None:
    """The sparse variant's loss is its unguarded sum times the normaliser, bit for bit, and so are the
    gradients of the indexer inputs."""
    seed = seed_of("nonfinite bitwise")
    cfg = TINY_C
    pk = packed([40, 27], tail=3)
    lay = build_layout(pk, cfg, 4)
    rows, heads, dim = pk.total, cfg.n_heads, cfg.head_dim
    hi, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    keys_rows = lay.ext_rows + lay.gathered_rows
    q, key_buffer = randn(rows, heads, dim, seed=seed), randn(keys_rows, dim, seed=seed + 1)
    index_q = randn(rows, hi, di, seed=seed + 2).requires_grad_()
    index_w = randn(rows, hi, seed=seed + 3).requires_grad_()
    index_keys = randn(lay.gathered_rows, di, seed=seed + 4).requires_grad_()
    lse, sink = randn(rows, heads, seed=seed + 5) + 3, randn(heads, seed=seed + 6)
    selected = indexer_topk(index_q.detach(), index_w.detach(), index_keys.detach(),
                            lambda sl: lay.visible_mask(lay.local_doc[sl], lay.local_pos[sl]), k)
    assert (selected >= 0).any()
    weight = lay.real.to(torch.float64)
    coeff = 0.7
    leaves = (index_q, index_w, index_keys)

    got = indexer_loss(variant="sparse", q=q, key_buffer=key_buffer, window_idx=lay.window_idx,
                       compressed_offset=lay.ext_rows, scored_entries=selected, attention_lse=lse, sink=sink,
                       scale=cfg.softmax_scale, index_q=index_q, index_w=index_w, index_keys=index_keys,
                       real=lay.real, global_real_tokens=pk.real_tokens, coeff=coeff)
    want = _sparse_loss(q, key_buffer, lay.ext_rows, selected, torch.logaddexp(lse, sink[None, :]),
                        cfg.softmax_scale, index_q, index_w, index_keys, weight) * (coeff / pk.real_tokens)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value", [NAN, INF])
def test_topk_never_selects_a_nonfinite_score(value: float) -> None:
    """A key row whose scores are NaN or +inf (-inf marks an invisible entry) is selected exactly as if
    it were invisible, every time. Positive queries and weights make an infinite key's scores +inf."""
    seed = seed_of("nonfinite topk", value)
    t, hi, di, g, k = 24, 4, 8, 30, 5
    q, w, keys = randn(t, hi, di, seed=seed).abs(), randn(t, hi, seed=seed + 1).abs() + 0.1, randn(g, di, seed=seed + 2)
    visible = torch.Generator().manual_seed(seed + 3)
    mask = torch.rand(t, g, generator=visible) < 0.7
    bad_rows = torch.tensor([0, 3, 17, 29])
    poisoned = keys.clone()
    poisoned[bad_rows] = value
    hidden = mask.clone()
    hidden[:, bad_rows] = False

    scores = torch.einsum("thd,gd->thg", q, poisoned).relu().mul(w[..., None]).sum(1)
    assert not torch.isfinite(scores[:, bad_rows]).any() and torch.isfinite(scores[:, 1]).all()
    got = indexer_topk(q, w, poisoned, lambda sl: mask[sl], k)
    want = indexer_topk(q, w, keys, lambda sl: hidden[sl], k)
    assert torch.equal(got, want) and torch.equal(got, indexer_topk(q, w, poisoned, lambda sl: mask[sl], k))
    assert not torch.isin(got, bad_rows).any() and (got >= 0).any()
