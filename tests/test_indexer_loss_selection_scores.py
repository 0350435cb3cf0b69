"""The sparse indexer loss on the selection's own scores (kernel option ``indexer_loss_scores``):
``indexer_scores_given`` and the layer.

* The op: handed exactly what :func:`indexer_scores` computes, its forward is those scores and every
  gradient is bit for bit :func:`indexer_scores`' own, on the torch reference (fp32, fp64) and on the
  Triton kernels (Triton's CPU interpreter) with each key-gradient reduction and in deterministic mode;
  bad scores are refused by name.
* The layer (packed documents with empty top-k slots, fp32 and fp64, the torch and the Triton paths,
  selective recompute): with the selection's scores replaced by the recomputed ones, ``selection`` gives
  the loss and every gradient of ``recompute`` bit for bit (the wiring adds nothing). With the selection's
  real scores the two differ by the scores' rounding only (the selection sums in another order): the
  loss within the first-order bound ``normaliser * sum_t 2 max_j |ds[t, j]|`` (the KL's gradient in a
  row's scores, ``softmax - target``, has an L1 norm of at most 2) and the gradients to a relative 1e-4.
  The option ``recompute`` scores the entries again; ``selection`` asks the top-k for its scores.

Inputs are random from the per-test ``seed`` (DSV4CP_TEST_SEED varies it; failures print it). The Triton
cases need ``TRITON_INTERPRET=1`` set before triton's import (else skipped).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TINY_C, packed, randn
from dsv4cp import kernel_options
from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.harness.build import build_case
from dsv4cp.harness.case import Case
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.kernels import HAS_TRITON, set_deterministic, triton_available
from dsv4cp.layer import attention as attention_module
from dsv4cp.layer.indexer_loss import indexer_loss
from dsv4cp.ops import indexer as ops_indexer
from dsv4cp.ops.indexer import indexer_scores, indexer_scores_given

TRITON_CPU = HAS_TRITON and triton_available("cpu")
needs_interpreter = pytest.mark.skipif(not TRITON_CPU, reason="needs triton's CPU interpreter (TRITON_INTERPRET=1)")


def _scores_case(seed: int, dtype: torch.dtype, t: int = 9, hi: int = 4, di: int = 16, g: int = 13, k: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hi, di, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(t, hi, generator=gen, dtype=torch.float64).to(dtype)
    keys = torch.randn(g, di, generator=gen, dtype=torch.float64).to(dtype)
    idx = torch.randint(0, g, (t, k), generator=gen)
    idx[torch.rand(t, k, generator=gen) < 0.3] = -1  # empty slots
    idx[2] = -1  # a row with none
    grad = torch.randn(t, k, generator=gen, dtype=torch.float64)
    return q, w, keys, idx, grad


def _grads(fn, q, w, keys, idx, grad, *given, **options):
    leaves = [x.clone().requires_grad_() for x in (q, w, keys)]
    out = fn(*leaves, idx, *given, **options)
    (out * grad.to(out.dtype)).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_bitwise(got, want, seed, what):
    (out_a, grads_a), (out_b, grads_b) = got, want
    assert out_a.dtype == out_b.dtype and torch.equal(out_a, out_b), f"seed={seed}: {what} scores"
    for name, a, b in zip(("dq", "dw", "dkeys"), grads_a, grads_b):
        assert a.dtype == b.dtype and torch.equal(a, b), f"seed={seed}: {what} {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_given_scores_are_the_torch_op_bitwise(dtype, seed):
    q, w, keys, idx, grad = _scores_case(seed, dtype)
    want = _grads(indexer_scores, q, w, keys, idx, grad)
    got = _grads(indexer_scores_given, q, w, keys, idx, grad, want[0])
    assert (idx < 0).any() and (want[1][2] != 0).any()
    _assert_bitwise(got, want, seed, "torch")


@needs_interpreter
@pytest.mark.parametrize("reduce,deterministic", [("atomic", False), ("sorted", False), ("sorted-bf16", False),
                                                  ("atomic", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_given_scores_are_the_triton_op_bitwise(reduce, deterministic, dtype, seed, monkeypatch):
    """The Triton path (forced for CPU tensors): the same backward kernels, launch and reduction."""
    monkeypatch.setattr(ops_indexer, "triton_serves", lambda x: x.dtype != torch.float64 and x.shape[-1] % 16 == 0)
    q, w, keys, idx, grad = _scores_case(seed, dtype)
    set_deterministic(deterministic)
    try:
        options = KernelOptions(triton_scores_bwd_reduce=reduce)
        kernel_options.reset_backends_ran()
        want = _grads(indexer_scores, q, w, keys, idx, grad, options=options)
        want_ran = kernel_options.backends_ran()
        kernel_options.reset_backends_ran()
        got = _grads(indexer_scores_given, q, w, keys, idx, grad, want[0], options=options)
        got_ran = kernel_options.backends_ran()
    finally:
        set_deterministic(False)
    _assert_bitwise(got, want, seed, f"triton {reduce}")
    assert got_ran["indexer_scores.bwd"] == want_ran["indexer_scores.bwd"] == \
        f"triton/{'sorted' if deterministic else reduce}"
    assert "indexer_scores.fwd" not in got_ran  # no forward kernel ran


def test_bad_given_scores_are_named(seed):
    q, w, keys, idx, _ = _scores_case(seed, torch.float32)
    scores = indexer_scores(q, w, keys, idx).detach()
    with pytest.raises(ValueError, match=r"^scores: must be a tensor"):
        indexer_scores_given(q, w, keys, idx, scores.tolist())
    with pytest.raises(ValueError, match=r"^scores: must be \[9, 6\]"):
        indexer_scores_given(q, w, keys, idx, scores[:, :5])
    with pytest.raises(ValueError, match=r"^scores: dtype must be torch.float32 .*got torch.float64"):
        indexer_scores_given(q, w, keys, idx, scores.double())


# ------------------------------------------------------------------------------------------ the layer
CASE = dict(lengths=(9, 0, 23, 5), total=40, ratio=4)


def _layer_step(layer, packed, x, weight, scores: str):
    layer = copy.deepcopy(layer)
    layer.kernel_options = kernel_options.KernelOptions.resolve({"indexer_loss_scores": scores})
    x = x.clone().requires_grad_()
    result = layer(x, packed)
    ((result.out * weight).sum() + result.indexer_loss).backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None}}
    return result.indexer_loss.detach(), grads


def _recomputed_selection_scores(monkeypatch):
    """Make the layer's top-k hand back the scores ``indexer_scores`` computes at its rows (instead of its
    own); returns the list of the selections made."""
    original, seen = attention_module.indexer_topk, []

    def topk(q, w, keys, *args, **kwargs):
        out = original(q, w, keys, *args, **kwargs)
        if not kwargs.get("return_scores"):
            return out
        rows, _ = out
        seen.append(rows)
        return rows, indexer_scores(q, w, keys, rows).detach()

    monkeypatch.setattr(attention_module, "indexer_topk", topk)
    return seen


LAYER_CASES = [("fp32", False), ("fp64", False), ("fp32", True)]


@pytest.mark.parametrize("dtype,recompute", LAYER_CASES, ids=["fp32", "fp64", "fp32-recompute"])
def test_layer_on_recomputed_selection_scores_is_bitwise_recompute(dtype, recompute, seed, monkeypatch):
    layer, packed, x, weight = build_case(Case(**CASE, dtype=dtype, seed=seed, recompute=recompute),
                                          torch.device("cpu"))
    want_loss, want = _layer_step(layer, packed, x, weight, "recompute")
    seen = _recomputed_selection_scores(monkeypatch)
    got_loss, got = _layer_step(layer, packed, x, weight, "selection")
    assert len(seen) == 1 and (seen[0] < 0).any() and (seen[0] >= 0).any(), "empty and chosen slots"
    assert torch.equal(got_loss, want_loss), f"seed={seed}: loss {got_loss} vs {want_loss}"
    assert set(got) == set(want) and any(n.startswith("indexer.") for n in got)
    for name, g in want.items():
        assert torch.equal(got[name], g), f"seed={seed}: {name}"


def test_layer_triton_on_recomputed_selection_scores_is_bitwise_recompute(triton_paths, seed, monkeypatch):
    """The Triton paths: the recompute's scores are the gather kernel's, the backward the same kernels'."""
    layer, packed, x, weight = build_case(Case(**CASE, seed=seed), torch.device("cpu"))
    kernel_options.reset_backends_ran()
    want_loss, want = _layer_step(layer, packed, x, weight, "recompute")
    assert kernel_options.backends_ran()["indexer_scores.fwd"] == "triton"
    _recomputed_selection_scores(monkeypatch)
    got_loss, got = _layer_step(layer, packed, x, weight, "selection")
    assert torch.equal(got_loss, want_loss), f"seed={seed}: loss {got_loss} vs {want_loss}"
    for name, g in want.items():
        assert torch.equal(got[name], g), f"seed={seed}: {name}"


def _score_gap_bound(monkeypatch, layer, packed, x) -> float:
    """``normaliser * sum_t 2 max_j |selection - recomputed|`` over real rows' valid slots: the first-order
    bound of the loss's change from the selection's scores to the recomputed ones."""
    original, gaps = attention_module.indexer_topk, []

    def topk(q, w, keys, *args, **kwargs):
        rows, scores = original(q, w, keys, *args, **kwargs)
        again = indexer_scores(q, w, keys, rows).detach()
        gaps.append(torch.where(rows >= 0, (scores - again).abs(), 0).amax(-1))
        return rows, scores

    with monkeypatch.context() as patch:
        patch.setattr(attention_module, "indexer_topk", topk)
        layer = copy.deepcopy(layer)
        with torch.no_grad():
            layer(x, packed)
    cfg = layer.cfg
    return float(2 * gaps[0].double().sum() * cfg.indexer_loss_coeff / packed.real_tokens)


@pytest.mark.parametrize("paths", ["torch", "triton"])
def test_layer_on_selection_scores_differs_by_their_rounding_only(paths, seed, monkeypatch, request):
    if paths == "triton":
        request.getfixturevalue("triton_paths")
    layer, packed, x, weight = build_case(Case(**CASE, seed=seed), torch.device("cpu"))
    kernel_options.reset_backends_ran()
    want_loss, want = _layer_step(layer, packed, x, weight, "recompute")
    assert "indexer_scores.fwd" in kernel_options.backends_ran()
    kernel_options.reset_backends_ran()
    got_loss, got = _layer_step(layer, packed, x, weight, "selection")
    assert "indexer_scores.fwd" not in kernel_options.backends_ran()  # not scored again
    bound = _score_gap_bound(monkeypatch, layer, packed, x)
    gap = abs(float(got_loss) - float(want_loss))
    assert gap <= 2 * bound + 1e-12 * abs(float(want_loss)), f"seed={seed}: |{got_loss} - {want_loss}| > 2 x {bound}"
    for name, g in want.items():
        scale = float(g.abs().max()) or 1.0
        assert float((got[name] - g).abs().max()) <= 1e-4 * scale, f"seed={seed}: {name}"


def test_selection_option_reaches_the_top_k(seed, monkeypatch):
    """``selection`` asks the top-k for its scores, ``recompute`` does not (and scores again)."""
    asked = []
    original = attention_module.indexer_topk

    def topk(*args, **kwargs):
        asked.append(kwargs.get("return_scores", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "indexer_topk", topk)
    layer, packed, x, weight = build_case(Case(**CASE, seed=seed), torch.device("cpu"))
    for scores in ("selection", "recompute"):
        _layer_step(layer, packed, x, weight, scores)
    assert asked == [True, False]
    dense, packed, x, weight = build_case(Case(**CASE, seed=seed, cfg=DSv4Config.preset("tiny", indexer_loss="dense")),
                                          torch.device("cpu"))
    _layer_step(dense, packed, x, weight, "selection")
    assert asked[-1] is False  # the dense variant scores every visible entry itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_selection_scores_at_flash_head_sizes(seed):
    """bf16, T = 4096, Hi = 64, Di = 128, K = 512, one causal document, the layer's top-k call: the selection's
    scores match the gather kernel's to fp32 rounding (of the sums' absolute products), and handed the
    gather kernel's scores the given op's backward is its bits (the sorted, deterministic reduction)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, hi, di, k = 4096, 64, 128, 512
    g = t // 4
    q = torch.randn(t, hi, di, device="cuda", generator=gen).bfloat16()
    w = torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5
    keys = torch.randn(g, di, device="cuda", generator=gen).bfloat16()
    pos, key_j = torch.arange(t, device="cuda"), torch.arange(g, device="cuda")
    limit = (pos + 1) // 4
    rows, scores = ops_indexer.indexer_topk(
        q, w, keys, lambda sl: key_j[None, :] < limit[sl, None], k,
        visibility=(torch.zeros_like(pos), limit, torch.zeros_like(key_j), key_j), key_row_limit=(0, 4),
        return_scores=True)
    again = indexer_scores(q, w, keys, rows).detach()
    valid = rows >= 0
    # the sums' rounding scale: every product's magnitude, sum_h |w| sum_d |q k| (fp32 sums in any order)
    magnitudes = torch.einsum("thd,tkd->tkh", q.float().abs(), keys.float().abs()[rows.clamp_min(0)])
    scale = (magnitudes * w.abs()[:, None]).sum(-1)
    assert bool((((scores - again).abs() <= 1e-5 * scale) | ~valid).all()), f"seed={seed}"
    grad = torch.randn(rows.shape, device="cuda", generator=gen)
    options = KernelOptions(triton_scores_bwd_reduce="sorted")
    want = _grads(indexer_scores, q, w, keys, rows, grad, options=options)
    got = _grads(indexer_scores_given, q, w, keys, rows, grad, again, options=options)
    _assert_bitwise(got, want, seed, "gpu sorted")


@needs_interpreter
def test_top_k_scores_custom_op_passes_opcheck_and_is_the_eager_call(seed):
    """``dsv4cp::indexer_topk_scores`` (what the compiled layer calls for the rows and their scores)."""
    from dsv4cp.ops import indexer_library

    gen = torch.Generator().manual_seed(seed)
    t, g = 12, 9
    q, w = torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, generator=gen)
    keys = torch.randn(g, 16, generator=gen)
    visibility = (torch.zeros(t, dtype=torch.int64), torch.randint(0, 8, (t,), generator=gen),
                  torch.zeros(g, dtype=torch.int64), torch.arange(g))
    defaults = DEFAULT_OPTIONS.op_values(ops_indexer.TOPK_OPTION_NAMES)
    torch.library.opcheck(indexer_library.indexer_topk_scores, (q, w, keys, *visibility, 4, None, *defaults))
    rows, scores = indexer_library.indexer_topk_scores(q, w, keys, *visibility, 4, None, *defaults)
    want_rows, want_scores = ops_indexer.fused_indexer_topk(q, w, keys, *visibility, 4, return_scores=True)
    assert torch.equal(rows, want_rows) and torch.equal(scores, want_scores)
    assert (rows < 0).any() and (rows >= 0).any()


@pytest.mark.parametrize("paths", ["torch", "triton"])
def test_scored_key_rows_handed_in_give_the_same_bits(paths, seed, request):
    """The layer hands the loss its attention index's compressed rows (int32) instead of letting it rebuild
    them from the entries: the same target, loss and gradients, bit for bit."""
    if paths == "triton":
        request.getfixturevalue("triton_paths")
    cfg, pk = TINY_C, packed([40, 27], tail=3)
    lay = build_layout(pk, cfg, 4)
    rows, hi, di = pk.total, cfg.index_n_heads, cfg.index_head_dim
    q = randn(rows, cfg.n_heads, cfg.head_dim, seed=seed, dtype=torch.float32)
    key_buffer = randn(lay.ext_rows + lay.gathered_rows, cfg.head_dim, seed=seed + 1, dtype=torch.float32)
    leaves = [randn(*shape, seed=seed + 2 + i, dtype=torch.float32)
              for i, shape in enumerate(((rows, hi, di), (rows, hi), (lay.gathered_rows, di)))]
    lse, sink = randn(rows, cfg.n_heads, seed=seed + 5, dtype=torch.float32) + 3, randn(cfg.n_heads, seed=seed + 6)
    selected = ops_indexer.indexer_topk(*leaves, lambda sl: lay.visible_mask(lay.local_doc[sl], lay.local_pos[sl]),
                                        cfg.index_topk)
    key_rows = torch.where(selected >= 0, selected + lay.ext_rows, -1).to(torch.int32)
    assert (selected < 0).any() and (selected >= 0).any()

    def loss(given):
        inputs = [leaf.clone().requires_grad_() for leaf in leaves]
        value = indexer_loss(variant="sparse", q=q, key_buffer=key_buffer, window_idx=lay.window_idx,
                             compressed_offset=lay.ext_rows, scored_entries=selected, attention_lse=lse, sink=sink,
                             scale=cfg.softmax_scale, index_q=inputs[0], index_w=inputs[1], index_keys=inputs[2],
                             real=lay.real, global_real_tokens=pk.real_tokens, coeff=0.3, scored_key_rows=given)
        return value.detach(), torch.autograd.grad(value, inputs)

    (want, want_grads), (got, got_grads) = loss(None), loss(key_rows)
    assert torch.equal(got, want), f"seed={seed}"
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b), f"seed={seed}"
    with pytest.raises(ValueError, match=r"^scored_key_rows: must be scored_entries' shape"):
        loss(key_rows[:, :3])
