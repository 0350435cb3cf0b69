"""Sparse indexer loss microbenchmarks (docs/design.md §1.5): forward + backward of the loss's three
variants side by side, at the flash C layer's 64K shapes (GPU) and a tiny one (CPU, CI).

Variants (kernel options ``indexer_loss_scores`` x ``indexer_loss_kl``):

* ``recompute-torch``: the entries scored again by ``indexer_scores`` (Triton gather forward) and the torch
  ``kl_distillation`` (the loss before the selection's scores were reused);
* ``selection-torch``: the selection's own scores (``indexer_scores_given``: no forward kernel), torch KL;
* ``selection-fused``: the selection's scores and the fused Triton KL pass (one kernel per direction's
  share: the forward's rows and score gradient, the backward's scaling).

Scopes:

* ``loss``: :func:`dsv4cp.layer.indexer_loss.indexer_loss` as the layer calls it (its attention index's
  int32 key rows handed in; the target's head-summed probabilities, the prediction, the KL, the finiteness
  factor) then its backward (the KL's, then the scores' backward kernel into the indexer queries, weights
  and keys);
* ``prediction``: the same without the target (computed once beforehand): the scores (or given scores),
  the KL and their backward, where the variants differ.

Shapes: ``64k``: one document of T = 65536 tokens (CP = 1), the flash C layer's ``H = 64, D = 512`` attention
queries and key buffer (T window rows + G = T/4 compressed entries), ``Hi = 64, Di = 128`` indexer, K =
512 slots chosen by the layer's top-k (``indexer_topk(..., return_scores=True)``, causal: early rows have
empty slots), bf16; the attention's lse over the chosen entries. ``tiny``: T = 64, H = 4, D = 32, Hi = 4,
Di = 16, K = 8, fp32 (on CPU every variant runs the torch paths: the fused pass serves CUDA only).

``benchmark.extra_info``: the variant, scope, shape, what ran (``indexer_scores.fwd``, ``indexer_kl``) and
``peak_extra_bytes`` (CUDA). Selector for the 64K comparison: ``pytest bench/test_bench_indexer_loss.py
-m gpu -k 64k``.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, Shape, bench_device, bench_dtype, one_shape_at_a_time
from dsv4cp import kernel_options
from dsv4cp.layer.indexer_loss import indexer_loss
from dsv4cp.ops.attention_probs import head_summed_probs, logsumexp_over
from dsv4cp.ops.indexer import indexer_scores, indexer_scores_given, indexer_topk
from dsv4cp.ops.indexer_kl import indexer_kl

VARIANTS = {
    "recompute-torch": {"indexer_loss_scores": "recompute", "indexer_loss_kl": "torch"},
    "selection-torch": {"indexer_loss_scores": "selection", "indexer_loss_kl": "torch"},
    "selection-fused": {"indexer_loss_scores": "selection", "indexer_loss_kl": "triton"},
}


SHAPES = {
    "tiny": Shape("tiny", 64, 4, 32, 8, index_heads=4, index_dim=16),
    "64k": Shape("64k", 65536, 64, 512, 512, index_heads=64, index_dim=128),
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("64k", id="64k", marks=GPU_ONLY)]

@one_shape_at_a_time
def _inputs(shape: Shape) -> dict:
    """Cached inputs of one shape: attention queries / key buffer / lse, indexer inputs, the top-k's
    selection and its scores, the target (for the ``prediction`` scope)."""
    device, dtype = bench_device(), bench_dtype()
    g = torch.Generator(device=device).manual_seed(2024)
    t, n = shape.tokens, shape.n_compressed
    scale = shape.dim ** -0.5
    q = torch.randn(t, shape.heads, shape.dim, device=device, generator=g).to(dtype)
    key_buffer = torch.randn(t + n, shape.dim, device=device, generator=g).to(dtype)
    index_q = torch.randn(t, shape.index_heads, shape.index_dim, device=device, generator=g).to(dtype)
    index_w = torch.randn(t, shape.index_heads, device=device, generator=g)
    index_w = index_w * (shape.index_heads * shape.index_dim) ** -0.5
    index_keys = torch.randn(n, shape.index_dim, device=device, generator=g).to(dtype)
    pos = torch.arange(t, device=device)
    limit = (pos + 1) // 4
    key_j = torch.arange(n, device=device)
    zeros_t, zeros_n = (torch.zeros(rows, dtype=torch.int64, device=device) for rows in (t, n))  # one document
    with torch.no_grad():
        selected, scores = indexer_topk(index_q, index_w, index_keys, lambda sl: key_j[None, :] < limit[sl, None],
                                        shape.topk, visibility=(zeros_t, limit, zeros_n, key_j), key_row_limit=(0, 4),
                                        return_scores=True)
        key_rows = torch.where(selected >= 0, selected + t, -1)
        lse = logsumexp_over(q, key_buffer, key_rows, scale)  # the attention's lse over the chosen entries
        sink = torch.randn(shape.heads, device=device, generator=g)
        log_den = torch.logaddexp(lse, sink[None, :])
        target = head_summed_probs(q, key_buffer, key_rows, scale, log_den)
    entry = dict(q=q, key_buffer=key_buffer, index_q=index_q, index_w=index_w, index_keys=index_keys,
                 selected=selected, scores=scores, lse=lse, sink=sink, target=target, scale=scale,
                 key_rows=key_rows.to(torch.int32),  # as the layer hands them (its attention index)
                 real=torch.ones(t, dtype=torch.bool, device=device),
                 window_idx=torch.zeros(t, 0, dtype=torch.int64, device=device))
    return entry


def _step(entry: dict, scope: str, options: dict):
    """A no-argument callable: one forward + backward of ``scope`` under ``options``."""
    leaves = [entry[name].detach().clone().requires_grad_(True) for name in ("index_q", "index_w", "index_keys")]
    resolved = kernel_options.KernelOptions.resolve(options)
    selection = entry["scores"] if resolved.indexer_loss_scores == "selection" else None
    weight = entry["real"].to(torch.float32)

    def loss():
        return indexer_loss(variant="sparse", q=entry["q"], key_buffer=entry["key_buffer"],
                            window_idx=entry["window_idx"], compressed_offset=entry["q"].shape[0],
                            scored_entries=entry["selected"], attention_lse=entry["lse"], sink=entry["sink"],
                            scale=entry["scale"], index_q=leaves[0], index_w=leaves[1], index_keys=leaves[2],
                            real=entry["real"], global_real_tokens=entry["q"].shape[0], coeff=1e-2,
                            selection_scores=selection, scored_key_rows=entry["key_rows"], options=resolved)

    def prediction():
        idx = entry["selected"]
        scores = (indexer_scores(*leaves, idx, options=resolved) if selection is None
                  else indexer_scores_given(*leaves, idx, selection, options=resolved))
        return indexer_kl(entry["target"], scores, idx >= 0, weight, impl=resolved.indexer_loss_kl)

    body = loss if scope == "loss" else prediction

    def step():
        for leaf in leaves:
            leaf.grad = None
        value = body()
        value.backward()
        return value

    return step


def _peak_extra_bytes(fn) -> int | None:
    if not HAS_CUDA:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scope", ["loss", "prediction"])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_indexer_loss_fwd_bwd(benchmark, measure, shape_name, scope, variant):
    """One forward + backward per round of each variant, side by side (group per shape and scope)."""
    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    step = _step(entry, scope, VARIANTS[variant])
    kernel_options.reset_backends_ran()
    value = step()
    ran = kernel_options.backends_ran()
    assert torch.isfinite(value), f"{variant}: loss {value}"
    benchmark.group = f"indexer.loss.fwd_bwd.{scope}.{shape.name}"
    peak = _peak_extra_bytes(step)
    valid = int((entry["selected"] >= 0).sum().item())
    benchmark.extra_info.update(variant=variant, scope=scope, shape=shape.name, T=shape.tokens, K=shape.topk,
                                valid_slots=valid, dtype=str(entry["q"].dtype),
                                scores_fwd=ran.get("indexer_scores.fwd", "given"), kl=ran.get("indexer_kl", "torch"),
                                peak_extra_bytes=peak)
    rounds, warmup = (3, 1) if HAS_CUDA else (2, 1)
    # the KL's traffic: target, scores and the valid mask read, the score gradient written ([T, K])
    measure(step, None, flops=0.0, bytes_moved=shape.tokens * shape.topk * (4 + 4 + 1 + 4), rounds=rounds,
            warmup_rounds=warmup, device=entry["q"].device)
