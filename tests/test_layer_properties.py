"""Structural properties of the packed layer: causality, document isolation, position invariance
(positions are document-relative), padding and tail behaviour (DESIGN 1.4, 1.5, 2)."""

from __future__ import annotations

import pytest
import torch

from conftest import cfg_for, make_layer, packed, randn, seed_of

RATIOS = [0, 4, 8]
TOL = 1e-12


def _max_abs(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _scale(a):
    return max(a.abs().max().item(), 1e-300)


@pytest.mark.parametrize("r", RATIOS)
def test_causality_within_a_document(r):
    """Perturbing positions > t of a document leaves rows <= t of it (and other documents) unchanged."""
    cfg = cfg_for(r)
    pk = packed([9, 58, 12], 1, 2)
    cup = pk.cu_seqlens_padded.tolist()
    layer = make_layer(cfg, r, seed=seed_of("causal", r))
    x = randn(pk.total, cfg.hidden, seed=seed_of("causal-x", r))
    with torch.no_grad():
        base = layer(x, pk).out
        for t in (0, 3, 7, 8, 31, 44, 56):  # document-1 positions, around group boundaries
            x2 = x.clone()
            start = cup[1]
            x2[start + t + 1:cup[2]] += randn(cup[2] - start - t - 1, cfg.hidden, seed=t)
            out = layer(x2, pk).out
            keep = torch.ones(pk.total, dtype=torch.bool)
            keep[start + t + 1:cup[2]] = False
            assert _max_abs(out[keep], base[keep]) <= TOL * _scale(base), f"t={t}"
            assert _max_abs(out[~keep], base[~keep]) > 0, "perturbing later tokens must change them"


@pytest.mark.parametrize("r", RATIOS)
def test_documents_are_isolated(r):
    cfg = cfg_for(r)
    pk = packed([21, 0, 37, 15], 4, 3)
    cup = pk.cu_seqlens_padded.tolist()
    layer = make_layer(cfg, r, seed=seed_of("iso", r))
    x = randn(pk.total, cfg.hidden, seed=seed_of("iso-x", r))
    with torch.no_grad():
        base = layer(x, pk).out
        for d in (0, 2, 3):
            x2 = x.clone()
            x2[cup[d]:cup[d + 1]] = randn(cup[d + 1] - cup[d], cfg.hidden, seed=d + 100)
            out = layer(x2, pk).out
            other = torch.ones(pk.total, dtype=torch.bool)
            other[cup[d]:cup[d + 1]] = False
            assert _max_abs(out[other], base[other]) <= TOL * _scale(base), f"document {d} leaked"


@pytest.mark.parametrize("r", RATIOS)
def test_output_depends_on_document_relative_positions_only(r):
    """A document gives the same output alone or packed at another offset among other documents."""
    cfg = cfg_for(r, indexer_loss="sparse")
    layer = make_layer(cfg, r, seed=seed_of("shift", r))
    doc = randn(43, cfg.hidden, seed=seed_of("shift-doc", r))
    with torch.no_grad():
        alone = layer(doc, packed([43])).out
        pk = packed([7, 43, 13], 1, 0)  # the document starts at row 7: not a multiple of r
        other = torch.cat((randn(7, cfg.hidden, seed=1), doc, randn(13, cfg.hidden, seed=2)))
        inside = layer(other, pk).out[7:50]
    assert _max_abs(inside, alone) <= TOL * _scale(alone)


@pytest.mark.parametrize("r", RATIOS)
def test_padded_rows_do_not_affect_real_rows(r):
    cfg = cfg_for(r)
    pk = packed([13, 22, 5], 8, 0)  # real 13/22/5 padded to 16/24/8
    cu, cup = pk.cu_seqlens.tolist(), pk.cu_seqlens_padded.tolist()
    layer = make_layer(cfg, r, seed=seed_of("padrows", r))
    x = randn(pk.total, cfg.hidden, seed=seed_of("padrows-x", r))
    pad_rows = torch.zeros(pk.total, dtype=torch.bool)
    for d in range(3):
        pad_rows[cup[d] + cu[d + 1] - cu[d]:cup[d + 1]] = True
    x2 = x.clone()
    x2[pad_rows] = randn(int(pad_rows.sum()), cfg.hidden, seed=77) * 5
    with torch.no_grad():
        a, b = layer(x, pk), layer(x2, pk)
    assert _max_abs(a.out[~pad_rows], b.out[~pad_rows]) <= TOL * _scale(a.out)
    if r == 4:
        assert abs(a.indexer_loss.item() - b.indexer_loss.item()) <= TOL * abs(a.indexer_loss.item())


@pytest.mark.parametrize("r", RATIOS + [128])
def test_tail_rows_output_zero_and_get_zero_gradient(r):
    cfg = cfg_for(r)
    lengths = [140, 3] if r == 128 else [19, 6]
    pk = packed(lengths, 1, 9)
    end = pk.padded_end
    layer = make_layer(cfg, r, seed=seed_of("tail", r))
    x = randn(pk.total, cfg.hidden, seed=seed_of("tail-x", r)).requires_grad_(True)
    res = layer(x, pk)
    assert torch.all(res.out[end:] == 0)
    obj = (res.out * randn(*res.out.shape, seed=3)).sum()
    if res.indexer_loss is not None:
        obj = obj + res.indexer_loss
    obj.backward()
    assert torch.all(x.grad[end:] == 0)
    assert x.grad[:end].abs().max() > 0
    with torch.no_grad():  # and the tail's content is irrelevant
        x2 = x.detach().clone()
        x2[end:] = randn(pk.total - end, cfg.hidden, seed=4) * 10
        res2 = layer(x2, pk)
    assert torch.equal(res2.out[end:], torch.zeros_like(res2.out[end:]))
    assert _max_abs(res2.out, res.out.detach()) <= TOL * _scale(res.out.detach())


@pytest.mark.parametrize("r", RATIOS)
def test_all_documents_empty(r):
    """Only empty documents and tail padding: every row outputs 0 (and nothing crashes)."""
    cfg = cfg_for(r)
    pk = packed([0, 0], 1, 5)
    layer = make_layer(cfg, r, seed=seed_of("empty", r))
    x = randn(pk.total, cfg.hidden, seed=1)
    with torch.no_grad():
        res = layer(x, pk)
    assert torch.equal(res.out, torch.zeros_like(res.out))
    if r == 4:
        assert res.indexer_loss is not None and res.indexer_loss.item() == 0


@pytest.mark.parametrize("r", RATIOS)
def test_zero_rows(r):
    """A legal packing of nothing (only empty documents, T = 0) gives an empty output."""
    cfg = cfg_for(r)
    pk = packed([0, 0])
    assert pk.total == 0
    layer = make_layer(cfg, r, seed=seed_of("zero", r))
    with torch.no_grad():
        res = layer(torch.zeros(0, cfg.hidden, dtype=torch.float64), pk)
    assert res.out.shape == (0, cfg.hidden)
    if r == 4:
        assert res.indexer_loss is not None and res.indexer_loss.item() == 0


@pytest.mark.parametrize("r", RATIOS)
def test_float32_and_float64_layers_agree(r):
    cfg = cfg_for(r)
    pk = packed([30, 11], 1, 2)
    seed = seed_of("dtypes", r)
    l32 = make_layer(cfg, r, seed=seed, dtype=torch.float32)
    l64 = make_layer(cfg, r, seed=seed, dtype=torch.float64)
    with torch.no_grad():  # the same (fp32-representable) parameter values in both
        p32 = dict(l32.named_parameters())
        for name, prm in l64.named_parameters():
            prm.copy_(p32[name].double())
    x = randn(pk.total, cfg.hidden, seed=seed + 1, dtype=torch.float32)
    with torch.no_grad():
        a = l32(x, pk).out
        b = l64(x.double(), pk).out
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    assert _max_abs(a.double(), b) <= 1e-5 * _scale(b)
