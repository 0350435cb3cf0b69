"""The dense indexer loss in bounded memory: chunked over query rows, equal in fp64 to
the loss over the materialised ``[L, M]`` matrices, and no tensor of that size in a layer step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import cfg_for, make_layer, packed, randn, seed_of
from dsv4cp.cp.layout import build_layout
from dsv4cp.layer import indexer_loss as loss_module
from dsv4cp.ops import attention_probs, indexer, sparse_attention_torch
from dsv4cp.ops.attention_probs import head_summed_probs, logsumexp_over
from dsv4cp.ops.indexer import indexer_scores

COEFF = 0.3


class LargestTensor(TorchDispatchMode):
    """Records the largest storage (bytes) any op outputs while active, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes() > self.bytes:
                self.bytes, self.op = leaf.untyped_storage().nbytes(), func
        return out


def _dense_case(seed: int):
    """A C layer's dense-loss inputs on a random packing: layout, attention queries and key buffer,
    indexer queries / weights / keys (leaves), real rows."""
    cfg = cfg_for(4, indexer_loss="dense")
    pk = packed([37, 0, 61, 9], 4, 3)
    layout = build_layout(pk, cfg, 4)
    h, d, hi, di = cfg.n_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
    rows, g = layout.rows, layout.gathered_rows
    tensors = dict(
        q=randn(rows, h, d, seed=seed), key_buffer=randn(layout.ext_rows + g, d, seed=seed + 1),
        sink=randn(h, seed=seed + 2), index_q=randn(rows, hi, di, seed=seed + 3).requires_grad_(True),
        index_w=randn(rows, hi, seed=seed + 4).requires_grad_(True),
        index_keys=randn(g, di, seed=seed + 5).requires_grad_(True),
    )
    return cfg, pk, layout, tensors


def _materialised_loss(cfg, pk, layout, t):
    """The loss as computed before chunking: every ``[L, M]`` matrix at once."""
    scale = cfg.softmax_scale
    entries = layout.all_visible_idx()
    valid = entries >= 0
    key_rows = torch.where(valid, entries + layout.ext_rows, -1)
    sink = t["sink"][None, :]
    window_lse = torch.logaddexp(logsumexp_over(t["q"], t["key_buffer"], layout.window_idx, scale), sink)
    log_den = torch.logaddexp(window_lse, logsumexp_over(t["q"], t["key_buffer"], key_rows, scale))
    target = head_summed_probs(t["q"], t["key_buffer"], key_rows, scale, log_den)
    scores = indexer_scores(t["index_q"], t["index_w"], t["index_keys"], entries)
    total = loss_module.kl_distillation(target, scores, valid, layout.real.to(scores.dtype))
    return total * (COEFF / pk.real_tokens)


def _chunked_loss(cfg, pk, layout, t):
    return loss_module.indexer_loss(
        variant="dense", q=t["q"], key_buffer=t["key_buffer"], window_idx=layout.window_idx,
        compressed_offset=layout.ext_rows, scored_entries=layout.all_visible_idx,
        attention_lse=torch.zeros(layout.rows, cfg.n_heads, dtype=torch.float64), sink=t["sink"],
        scale=cfg.softmax_scale, index_q=t["index_q"], index_w=t["index_w"], index_keys=t["index_keys"],
        real=layout.real, global_real_tokens=pk.real_tokens, coeff=COEFF,
    )


def test_dense_loss_in_chunks_equals_materialised(monkeypatch):
    """fp64: value and gradients (index_q, index_w, index_keys) within 1e-12 of the one-shot loss, with
    a budget that makes many chunks of a few rows, the last one partial."""
    seed = seed_of("dense-loss-chunks")
    cfg, pk, layout, t = _dense_case(seed)
    entries = layout.all_visible_idx().shape[1]
    monkeypatch.setattr(loss_module, "DENSE_CHUNK_BYTES", 7 * entries * 400)
    step = loss_module.dense_chunk_rows(entries, cfg.n_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim)
    assert 1 < step < layout.rows and layout.rows % step, f"step={step}: the case must make several chunks"

    names = ("index_q", "index_w", "index_keys")
    expected = _materialised_loss(cfg, pk, layout, t)
    expected_grads = torch.autograd.grad(expected, [t[n] for n in names])
    got = _chunked_loss(cfg, pk, layout, t)
    got_grads = torch.autograd.grad(got, [t[n] for n in names])

    assert expected.abs() > 1e-3, f"seed={seed}: a vanishing loss would make the comparison vacuous"
    assert abs(got - expected) <= 1e-12 * abs(expected), f"seed={seed}: {got.item()} vs {expected.item()}"
    for name, g, e in zip(names, got_grads, expected_grads):
        assert e.abs().max() > 0, f"seed={seed}: {name} gradient is all zero"
        err = (g - e).abs().max() / e.abs().max()
        assert err <= 1e-12, f"seed={seed}: {name} gradient relative error {err:.3e}"

    grad_calls = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grad_calls.append(1) or real_grad(*a, **k))
    with torch.no_grad():  # no gradient wanted: the same value, no gradient work
        assert abs(_chunked_loss(cfg, pk, layout, t) - expected) <= 1e-12 * abs(expected), f"seed={seed}"
    assert not grad_calls, f"{len(grad_calls)} chunk gradients computed under no_grad"


@pytest.mark.parametrize("variant,entries", [("dense", "tensor"), ("sparse", "callable"), ("full", "tensor")])
def test_variant_and_entries_checked_before_work(variant, entries):
    seed = seed_of("dense-loss-args", variant)
    cfg, pk, layout, t = _dense_case(seed)
    idx = layout.all_visible_idx()
    scored = idx if entries == "tensor" else layout.all_visible_idx
    field = "variant" if variant == "full" else "scored_entries"
    with pytest.raises(ValueError, match=rf"^{field}:"):
        loss_module.indexer_loss(
            variant=variant, q=t["q"], key_buffer=t["key_buffer"], window_idx=layout.window_idx,
            compressed_offset=layout.ext_rows, scored_entries=scored,
            attention_lse=torch.zeros(layout.rows, cfg.n_heads, dtype=torch.float64), sink=t["sink"],
            scale=cfg.softmax_scale, index_q=t["index_q"], index_w=t["index_w"], index_keys=t["index_keys"],
            real=layout.real, global_real_tokens=pk.real_tokens, coeff=COEFF,
        )


def test_dense_layer_step_never_holds_an_entry_matrix(monkeypatch):
    """A C layer with the dense loss on one 1024-token document (M = 256 entries per query), forward and
    backward, with every chunk budget small: no tensor exceeds twice the size of the queries, while one
    ``[L, M]`` int64 entry matrix is larger (the unchunked loss took one and built more ``[L, M]`` ones)."""
    budget = 512 * 2**10
    monkeypatch.setattr(loss_module, "DENSE_CHUNK_BYTES", budget)
    monkeypatch.setattr(attention_probs, "CHUNK_ELEMENTS", budget // 4)
    monkeypatch.setattr(indexer, "CHUNK_ELEMENTS", budget // 4)
    monkeypatch.setattr(sparse_attention_torch, "CHUNK_BYTES", budget)
    cfg = cfg_for(4, indexer_loss="dense", index_topk=8)
    tokens = 1024
    seed = seed_of("dense-loss-peak")
    layer = make_layer(cfg, 4, seed=seed, dtype=torch.float32)
    pk = packed([tokens])
    x = randn(tokens, cfg.hidden, seed=seed + 1, dtype=torch.float32).requires_grad_(True)

    rows_bytes = tokens * max(cfg.n_heads * cfg.head_dim, cfg.hidden) * 4
    bound = 2 * rows_bytes
    entry_matrix_bytes = tokens * (tokens // 4) * 8
    assert entry_matrix_bytes > bound, "the case must be large enough for an [L, M] matrix to break the bound"

    with LargestTensor() as largest:
        res = layer(x, pk)
        (res.out.square().mean() + res.indexer_loss).backward()
    assert res.indexer_loss.item() > 0, f"seed={seed}"
    assert largest.bytes <= bound, f"seed={seed}: {largest.op} made {largest.bytes} bytes > bound {bound}"
