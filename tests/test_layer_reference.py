"""The packed layer equals the independent per-document reference (GitHub issue #2).

Also holds the reference itself to a second, fully vectorised single-document formulation (masks
instead of loops, complex-number RoPE), so a loop-indexing slip in the reference would show up here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    TINY,
    assert_close_rel,
    assert_margin,
    cfg_for,
    make_layer,
    packed,
    param_state,
    randn,
    random_state,
    run_reference,
    seed_of,
)
from reference import hadamard_matrix, reference_forward, rope_frequencies

# --------------------------------------------------------------------------------------- packings
# name -> (lengths, pad_to_multiple, tail rows), per ratio; documents sized so that each ratio has
# compressed entries (and, for r = 4, more visible entries than index_topk = 8 in the long ones).
PACKINGS = {
    0: {
        "one_long": ([61], 1, 0),
        "many_short": ([5, 3, 9, 1, 7, 12, 4, 6], 1, 0),
        "empty_docs": ([0, 13, 0, 0, 21, 0], 1, 0),
        "padded": ([13, 30, 7], 8, 0),
        "tail": ([17, 9], 1, 11),
    },
    4: {
        "one_long": ([70], 1, 0),
        "many_short": ([5, 3, 9, 1, 7, 12, 4, 6], 1, 0),
        "empty_docs": ([0, 13, 0, 0, 45, 0], 1, 0),
        "shorter_than_r": ([1, 2, 3, 3], 1, 0),
        "not_multiple": ([47, 23, 6], 1, 0),
        "padded": ([13, 42, 7], 8, 0),
        "padded_tail": ([38, 5, 11], 8, 9),
        "tail": ([50, 9], 1, 11),
    },
    8: {
        "one_long": ([67], 1, 0),
        "many_short": ([5, 3, 9, 1, 17, 12, 4, 6], 1, 0),
        "empty_docs": ([0, 13, 0, 0, 29, 0], 1, 0),
        "shorter_than_r": ([3, 7, 2], 1, 0),
        "not_multiple": ([37, 23, 9], 1, 0),
        "padded": ([13, 30, 7], 16, 0),
        "tail": ([41, 9], 1, 11),
    },
    128: {
        "one_long": ([300], 1, 0),
        "two_docs": ([270, 45, 0], 1, 0),
        "shorter_than_r": ([100, 27], 1, 0),
        "padded_tail": ([259, 3], 16, 7),
    },
}
FP32_CASES = {0: ["many_short", "padded"], 4: ["one_long", "padded_tail"], 8: ["not_multiple", "tail"],
              128: ["padded_tail"]}
CASES = [(r, name) for r, cases in PACKINGS.items() for name in cases]
LOSSES = ("sparse", "dense")


def _loss_variants(r):
    return LOSSES if r == 4 else ("sparse",)


def _compare_case(r, name, loss, dtype, tol):
    lengths, pad, tail = PACKINGS[r][name]
    cfg = cfg_for(r, indexer_loss=loss)
    pk = packed(lengths, pad, tail)
    seed = seed_of("layer", r, name, loss)
    layer = make_layer(cfg, r, seed=seed, dtype=dtype)
    x = randn(pk.total, cfg.hidden, seed=seed + 1, dtype=dtype)
    with torch.no_grad():
        res = layer(x, pk)
        info = {}
        ref_out, ref_loss = run_reference(param_state(layer), cfg, r, x, pk, info=info)
    assert_margin(info, 1e-9 if dtype == torch.float64 else 1e-5)
    assert res.out.shape == (pk.total, cfg.hidden)
    assert res.out.dtype == dtype
    assert_close_rel(res.out, ref_out, tol, f"out r={r} {name} {loss}")
    if tail:
        assert torch.all(res.out[pk.padded_end:] == 0), "tail rows must output exactly 0"
    if r == 4:
        assert res.indexer_loss is not None
        has_entries = any(n >= 4 for n in pk.padded_lengths())
        assert (ref_loss.item() > 0) == has_entries
        assert abs(res.indexer_loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item()), (
            f"indexer loss {res.indexer_loss.item()!r} vs reference {ref_loss.item()!r}"
        )
    else:
        assert res.indexer_loss is None


def _with_losses(pairs):
    return [(r, n, loss) for r, n in pairs for loss in _loss_variants(r)]


FP64_PARAMS = _with_losses(CASES)
FP32_PARAMS = _with_losses([(r, n) for r, names in FP32_CASES.items() for n in names])


@pytest.mark.parametrize("r,name,loss", FP64_PARAMS, ids=[f"r{r}-{n}-{loss}" for r, n, loss in FP64_PARAMS])
def test_layer_matches_reference_fp64(r, name, loss):
    _compare_case(r, name, loss, torch.float64, 1e-10)


@pytest.mark.parametrize("r,name,loss", FP32_PARAMS, ids=[f"r{r}-{n}-{loss}" for r, n, loss in FP32_PARAMS])
def test_layer_fp32_matches_fp64_reference(r, name, loss):
    _compare_case(r, name, loss, torch.float32, 1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    r=st.sampled_from([0, 4, 8]),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0),
    pad=st.sampled_from([1, 4, 8]),
    tail=st.integers(0, 5),
    loss=st.sampled_from(LOSSES),
    seed=st.integers(0, 2**20),
)
def test_layer_matches_reference_random_packings(r, lengths, pad, tail, loss, seed):
    cfg = cfg_for(r, indexer_loss=loss)
    pk = packed(lengths, pad, tail)
    layer = make_layer(cfg, r, seed=seed)
    x = randn(pk.total, cfg.hidden, seed=seed + 1)
    with torch.no_grad():
        res = layer(x, pk)
        info = {}
        ref_out, ref_loss = run_reference(param_state(layer), cfg, r, x, pk, info=info)
    if info["topk_margin"] < 1e-9:
        return  # an (improbable) indexer tie: the selection is legitimately ambiguous
    assert_close_rel(res.out, ref_out, 1e-10, "out")
    if r == 4:
        assert abs(res.indexer_loss.item() - ref_loss.item()) <= 1e-10 * max(abs(ref_loss.item()), 1e-30)


def test_indexer_loss_is_normalised_by_real_tokens():
    """Adding a document with no compressed entry only rescales the loss by the real-token count."""
    cfg = cfg_for(4)
    layer = make_layer(cfg, 4, seed=seed_of("norm"))
    pk1 = packed([50])
    pk2 = packed([50, 3], pad_to_multiple=1, tail=4)
    x1 = randn(pk1.total, cfg.hidden, seed=1)
    x2 = torch.cat((x1, randn(pk2.total - pk1.total, cfg.hidden, seed=2)))
    with torch.no_grad():
        l1 = layer(x1, pk1).indexer_loss.item()
        l2 = layer(x2, pk2).indexer_loss.item()
    assert l2 == pytest.approx(l1 * 50 / 53, rel=1e-10)


def test_padding_rows_do_not_count_in_indexer_loss():
    """Padded rows of a document (past its real length) are excluded from the loss."""
    cfg = cfg_for(4)
    layer = make_layer(cfg, 4, seed=seed_of("padloss"))
    pk_real = packed([45])
    pk_pad = packed([45], pad_to_multiple=16)  # 3 padded rows, which do have visible entries
    x = randn(pk_pad.total, cfg.hidden, seed=3)
    with torch.no_grad():
        a = layer(x[:45], pk_real).indexer_loss.item()
        b = layer(x, pk_pad).indexer_loss.item()
    assert b == pytest.approx(a, rel=1e-10)


# --------------------------------------------------------------------------------------- reference self-check
def _rope_complex(v, pos, freqs):
    """RoPE via complex multiplication: v [..., D] with pos broadcast against v's leading dims."""
    P = 2 * freqs.numel()
    pairs = torch.view_as_complex(v[..., -P:].reshape(*v.shape[:-1], P // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(freqs), pos[..., None] * freqs)
    out = torch.view_as_real(pairs * rot).reshape(*v.shape[:-1], P)
    return torch.cat((v[..., :-P], out), dim=-1)


def _rms(v, w, eps):
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * (1 if w is None else w)


def _compress_vectorised(x, wkv, wgate, ape, norm_w, r, c, overlap, eps, freqs, had=None):
    E = x.shape[0] // r
    if E == 0:
        return x.new_zeros((0, c))
    a = (x[: E * r] @ wkv.t()).view(E, r, -1)
    z = (x[: E * r] @ wgate.t()).view(E, r, -1) + ape[None]
    if overlap:
        prev_a = torch.cat((torch.zeros_like(a[:1, :, :c]), a[:-1, :, :c]))
        prev_z = torch.cat((torch.full_like(z[:1, :, :c], -math.inf), z[:-1, :, :c]))
        a = torch.cat((prev_a, a[:, :, c:]), dim=1)
        z = torch.cat((prev_z, z[:, :, c:]), dim=1)
    pooled = (torch.softmax(z, dim=1) * a).sum(1)
    e = _rope_complex(_rms(pooled, norm_w, eps), torch.arange(E, dtype=torch.float64) * r, freqs)
    return e @ had if had is not None else e


def dense_document(state, cfg, r, xd, real):
    """One document at positions 0..n-1, vectorised with masks: (out [n, hidden], sum of KL)."""
    n = xd.shape[0]
    H, D, G, OL, W = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.window
    Hi, Di, K, eps = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.rms_eps
    s = {k: v.double() for k, v in state.items()}
    freqs = rope_frequencies(cfg, r)
    pos = torch.arange(n, dtype=torch.float64)
    c_lat = _rms(xd @ s["wq_a.weight"].t(), s["q_norm.weight"], eps)
    q = _rope_complex(_rms((c_lat @ s["wq_b.weight"].t()).view(n, H, D), None, eps), pos[:, None], freqs)
    kv = _rope_complex(_rms(xd @ s["wkv.weight"].t(), s["kv_norm.weight"], eps), pos, freqs)
    E = n // r if r else 0
    keys = kv
    tt = torch.arange(n)[:, None]
    win_mask = (tt - torch.arange(n)[None, :] >= 0) & (tt - torch.arange(n)[None, :] < W)
    mask = win_mask
    if r:
        ckv = _compress_vectorised(
            xd, s["compressor.wkv.weight"], s["compressor.wgate.weight"], s["compressor.ape"],
            s["compressor.norm.weight"], r, D, r == 4, eps, freqs,
        )
        keys = torch.cat((kv, ckv))
        visible = torch.arange(E)[None, :] < (tt + 1) // r  # [n, E]
        comp_mask = visible
        if r == 4:
            had = hadamard_matrix(Di) if cfg.hadamard else None
            ki = _compress_vectorised(
                xd, s["indexer.compressor.wkv.weight"], s["indexer.compressor.wgate.weight"],
                s["indexer.compressor.ape"], s["indexer.compressor.norm.weight"], 4, Di, True, eps, freqs, had,
            )
            qi = _rope_complex((c_lat @ s["indexer.wq_b.weight"].t()).view(n, Hi, Di), pos[:, None], freqs)
            if had is not None:
                qi = qi @ had
            wi = xd @ s["indexer.weights_proj.weight"].t() / math.sqrt(Hi * Di)
            scores = torch.einsum("th,the->te", wi, torch.relu(torch.einsum("thd,ed->the", qi, ki)))
            masked = scores.masked_fill(~visible, -math.inf)
            top = masked.topk(min(K, E), dim=-1).indices
            comp_mask = torch.zeros_like(visible).scatter(1, top, True) & visible
        mask = torch.cat((win_mask, comp_mask), dim=1)
    logits = cfg.head_dim**-0.5 * torch.einsum("thd,kd->thk", q, keys)
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    sink = s["attn_sink"][None, :, None].expand(n, H, 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    o = _rope_complex(torch.einsum("thk,kd->thd", probs, keys), -pos[:, None], freqs)
    y = torch.einsum("tgk,gok->tgo", o.reshape(n, G, -1), s["wo_a.weight"].view(G, OL, -1)).reshape(n, -1)
    out = y @ s["wo_b.weight"].t()
    kl = torch.zeros((), dtype=torch.float64)
    if r == 4 and E:
        lc = logits[..., n:]  # [n, H, E], -inf outside comp_mask
        if cfg.indexer_loss == "sparse":
            lse = torch.logsumexp(torch.cat((logits, sink), -1), -1)
            sel = comp_mask
        else:
            lw = logits[..., :n]
            lc = cfg.head_dim**-0.5 * torch.einsum("thd,ed->the", q, ckv).masked_fill(~visible[:, None], -math.inf)
            lse = torch.logaddexp(torch.logsumexp(torch.cat((lw, sink), -1), -1), torch.logsumexp(lc, -1))
            sel = visible
        p = torch.exp(lc - lse[..., None]).sum(1)  # [n, E]
        rows = (torch.arange(n) < real) & sel.any(1)
        target = p / p.sum(-1, keepdim=True)
        log_pred = torch.log_softmax(scores.masked_fill(~sel, -math.inf), -1)
        term = torch.where(sel, torch.xlogy(target, target) - target * log_pred.masked_fill(~sel, 0), 0.0)
        kl = term.sum(-1)[rows].sum()
    return out, kl


@pytest.mark.parametrize("r,loss", [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse"), (16, "sparse")])
def test_reference_matches_vectorised_formulation(r, loss):
    cfg = cfg_for(r, indexer_loss=loss)
    state = random_state(cfg, r, seed=seed_of("selfcheck", r))
    lengths, pad = [61, 0, 7, 44], 8
    pk = packed(lengths, pad, tail=3)
    cu, cup = pk.cu_seqlens.tolist(), pk.cu_seqlens_padded.tolist()
    x = randn(pk.total, cfg.hidden, seed=seed_of("selfcheck-x", r))
    info = {}
    out, loss_val = reference_forward(state, cfg, r, x, cu, cup, info=info)
    assert_margin(info, 1e-9)
    expected = torch.zeros_like(out)
    kl = torch.zeros((), dtype=torch.float64)
    for d in range(len(lengths)):
        a, b = cup[d], cup[d + 1]
        if b > a:
            expected[a:b], k = dense_document(state, cfg, r, x[a:b], cu[d + 1] - cu[d])
            kl = kl + k
    assert_close_rel(out, expected, 1e-12, "reference vs vectorised")
    assert torch.all(out[pk.padded_end:] == 0)
    if r == 4:
        assert loss_val.item() == pytest.approx(cfg.indexer_loss_coeff * kl.item() / cu[-1], rel=1e-12)
        assert loss_val.item() > 0
    else:
        assert loss_val is None


def test_reference_yarn_table_flash():
    """Flash C/H layers: pairs 0..15 keep base^(-2i/64), 25..31 are divided by 16, linear ramp between."""
    cfg = TINY.replace(rope_dim=64, head_dim=128, index_head_dim=64)
    f = rope_frequencies(cfg, 4)
    plain = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    ratio = f / plain
    assert torch.allclose(ratio[:16], torch.ones(16, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(ratio[25:], torch.full((7,), 1 / 16, dtype=torch.float64), rtol=0, atol=1e-15)
    m = (torch.arange(16, 25, dtype=torch.float64) - 15) / 10
    assert torch.allclose(ratio[16:25], 1 - m + m / 16, rtol=0, atol=1e-14)
    w = rope_frequencies(cfg, 0)
    assert torch.allclose(w, torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64))


def test_reference_hadamard_is_orthonormal_sylvester():
    h = hadamard_matrix(16)
    assert torch.allclose(h @ h.t(), torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert torch.all(h[0] > 0) and h[1, 1] < 0 and h[1, 0] > 0  # Sylvester order
    assert torch.allclose(h[:8, :8], hadamard_matrix(8) * math.sqrt(8 / 16), rtol=0, atol=1e-15)
