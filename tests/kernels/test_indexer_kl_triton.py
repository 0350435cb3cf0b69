"""The fused KL pass of the sparse indexer loss (:func:`dsv4cp.ops.indexer_kl.fused_kl_rows`, the kernel
of :mod:`dsv4cp.kernels.indexer_kl_triton`) against the torch reference ``kl_distillation`` + autograd.

CPU (Triton's interpreter): fp32 inputs, ``K`` ragged 1..600 (powers of two and not), unscored slots,
rows without a valid slot, rows with one, a row whose valid mass is all 0, scores spread over 1e4,
real and padding rows (weight 1 / 0) and random positive weights. Each row's term is compared with the
reference's (the gradient of its sum in the row weights, computed in fp64 from the same fp32 inputs)
within ``1e-5`` of the row's sum of absolute per-slot terms plus ``1e-6`` (times the row's weight); the
score gradient elementwise within ``2e-6`` of the weight; the sum, the torch sum of the rows. Then the
op through ``indexer_kl`` (the kernel option), NaN propagation, bad input, its custom op (opcheck), and
at the layer (the Triton paths on the interpreter) the loss and gradients of ``indexer_loss_kl=triton``
against ``torch``, eager and compiled.

GPU (marked ``gpu``): the 64K flash shapes (rows = 65536, K = 512) against the reference.
Inputs are random from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4cp import kernel_options
from dsv4cp.ops import indexer_kl as ops_kl
from dsv4cp.ops.indexer_kl import fused_kl_rows, indexer_kl, kl_distillation
from triton_marks import HAS_CUDA, skip_module_without_triton

skip_module_without_triton()

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def make_rows(seed: int, rows: int, k: int, *, spread: float = 3.0, device=DEVICE):
    """``(target_mass, scores, valid, row_weight)``: fp32 / bool, with every kind of row (see module)."""
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(rows, k, generator=gen) ** 3
    scores = torch.randn(rows, k, generator=gen) * spread
    valid = torch.rand(rows, k, generator=gen) >= 0.25
    weight = (torch.rand(rows, generator=gen) < 0.8).float() * (0.5 + torch.rand(rows, generator=gen))
    if rows >= 4:
        valid[0] = False  # no valid slot
        valid[1] = False
        valid[1, k // 2] = True  # one valid slot
        valid[2, :2] = True
        mass[2] = 0.0  # valid slots, all without mass
        weight[3] = 1.0
    tensors = mass, scores, valid, weight
    return tuple(t.to(device) for t in tensors)


def reference(mass, scores, valid, weight):
    """fp64 reference from the same inputs: ``(per-row terms, d total / d scores, total)``."""
    scores64 = scores.double().requires_grad_()
    weight64 = weight.double().requires_grad_()
    total = kl_distillation(mass.double(), scores64, valid, weight64)
    d_scores, d_weight = torch.autograd.grad(total, (scores64, weight64))
    return d_weight * weight.double(), d_scores, total.detach()


def term_scale(mass, scores, valid):
    """Per row: the sum of the absolute per-slot terms (the row's own rounding scale), in fp64."""
    m = mass.double().masked_fill(~valid, 0)
    target = m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    log_pred = torch.log_softmax(scores.double().masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0)
    return (torch.xlogy(target, target).abs() + (target * log_pred).abs()).masked_fill(~valid, 0).sum(-1)


def check_rows(mass, scores, valid, weight, seed):
    leaf = scores.clone().requires_grad_()
    got_rows = fused_kl_rows(mass, leaf, valid, weight)
    grad_out = 0.75
    (got_rows.sum() * grad_out).backward()
    want_rows, want_grad, _ = reference(mass, scores, valid, weight)
    # the floor: the GPU's approximate exp and softmax division (a few ulp of terms of order 1)
    tol = (1e-5 * term_scale(mass, scores, valid) + 1e-6) * weight.double() + 1e-12
    err = (got_rows.double() - want_rows).abs()
    assert got_rows.dtype == torch.float32 and got_rows.shape == weight.shape
    assert bool((err <= tol).all()), f"seed={seed}: row {int((err - tol).argmax())} off by {float(err.max())}"
    grad_err = (leaf.grad.double() - grad_out * want_grad).abs()
    grad_tol = 2e-6 * weight.double()[:, None] + 1e-12
    assert bool((grad_err <= grad_tol).all()), f"seed={seed}: gradient off by {float(grad_err.max())}"
    assert bool((leaf.grad[~valid] == 0).all()), f"seed={seed}: gradient at empty slots"


@pytest.mark.parametrize("k", [1, 2, 5, 16, 33, 100, 512, 600])
def test_rows_and_gradient_match_the_reference(k, seed):
    mass, scores, valid, weight = make_rows(seed, 12, k)
    check_rows(mass, scores, valid, weight, seed)


@pytest.mark.parametrize("spread", [1e-3, 30.0, 1e4])
def test_large_and_tiny_score_ranges(spread, seed):
    """Scores spread over 1e4 (most softmax terms underflow to 0) or nearly equal."""
    mass, scores, valid, weight = make_rows(seed, 10, 40, spread=spread)
    check_rows(mass, scores, valid, weight, seed)


def test_special_rows(seed):
    """No valid slot: 0 and no gradient; one valid slot: 0 (KL of two point masses); valid slots without
    mass: a target of zeros, 0 (``0 log 0 = 0``) and the reference's 0 gradient (its target sums to 0)."""
    mass, scores, valid, weight = make_rows(seed, 8, 24)
    weight[:3] = 1.0
    leaf = scores.clone().requires_grad_()
    rows = fused_kl_rows(mass, leaf, valid, weight)
    rows.sum().backward()
    assert valid[2].sum() > 1
    assert rows[:3].tolist() == [0.0, 0.0, 0.0] and bool((leaf.grad[:3] == 0).all()), f"seed={seed}"
    _, want_grad, _ = reference(mass, scores, valid, weight)
    assert bool((want_grad[:3] == 0).all())
    check_rows(mass, scores, valid, weight, seed)


def test_op_sum_and_options(seed, monkeypatch):
    """``indexer_kl``: ``triton`` sums the fused rows with ``torch.sum``; ``torch`` is the reference; the
    option chooses; a bad ``impl`` is named."""
    mass, scores, valid, weight = make_rows(seed, 16, 64)
    _, _, want = reference(mass, scores, valid, weight)
    ref = indexer_kl(mass, scores, valid, weight, impl="torch")
    assert torch.equal(ref, kl_distillation(mass, scores, valid, weight))
    if not HAS_CUDA:  # the fused pass serves CUDA tensors only: the reference runs
        assert torch.equal(indexer_kl(mass, scores, valid, weight, impl="triton"), ref)
    monkeypatch.setattr(ops_kl, "fused_serves", lambda *ts: all(t.dtype == torch.float32 for t in ts))
    got = indexer_kl(mass, scores, valid, weight, impl="triton")
    assert torch.equal(got, fused_kl_rows(mass, scores, valid, weight).sum())
    kernel_options.reset_backends_ran()
    assert torch.equal(indexer_kl(mass, scores, valid, weight), got)  # the option's default: triton
    assert kernel_options.backends_ran()["indexer_kl"] == "triton"
    assert torch.equal(indexer_kl(mass, scores, valid, weight, impl="torch"), ref)
    assert abs(float(got) - float(want)) <= 1e-5 * float(term_scale(mass, scores, valid).sum()), f"seed={seed}"
    with pytest.raises(ValueError, match=r"^impl: must be one of 'torch', 'triton', got 'cuda'"):
        indexer_kl(mass, scores, valid, weight, impl="cuda")


def test_fused_serves_only_cuda_fp32():
    cpu = torch.zeros(2, 8)
    assert not ops_kl.fused_serves(cpu)
    if HAS_CUDA:
        assert ops_kl.fused_serves(cpu.cuda()) and not ops_kl.fused_serves(cpu.cuda().double())
        assert not ops_kl.fused_serves(cpu.cuda(), cpu.cuda().double())  # a target in fp64
        assert not ops_kl.fused_serves(torch.zeros(2, ops_kl.FUSED_MAX_K + 1, device="cuda"))


def test_nan_propagates_as_in_the_reference(seed):
    mass, scores, valid, weight = make_rows(seed, 6, 20)
    weight[:] = 1.0
    valid_row4 = int(valid[4].nonzero()[0])
    valid_row5 = int(valid[5].nonzero()[0])
    mass[4, valid_row4] = float("nan")
    scores[5, valid_row5] = float("nan")
    rows = fused_kl_rows(mass, scores, valid, weight)
    want, _, _ = reference(mass, scores, valid, weight)
    assert torch.isnan(want[4]) and torch.isnan(want[5])
    assert torch.isnan(rows[4]) and torch.isnan(rows[5]) and torch.isfinite(rows[:4]).all(), rows


def test_no_grad_keeps_no_gradient(seed):
    mass, scores, valid, weight = make_rows(seed, 6, 20)
    leaf = scores.clone().requires_grad_()
    with torch.no_grad():
        rows = fused_kl_rows(mass, leaf, valid, weight)
    assert not rows.requires_grad
    assert torch.equal(rows, fused_kl_rows(mass, scores, valid, weight))


@pytest.mark.parametrize("field,bad,match", [
    ("mass", lambda t: t.double(), r"^target_mass: must be \[6, 20\] torch.float32"),
    ("scores", lambda t: t[:, :3], r"^target_mass: must be \[6, 3\] torch.float32"),
    ("valid", lambda t: t.long(), r"^valid: must be \[6, 20\] torch.bool"),
    ("weight", lambda t: t[:2], r"^row_weight: must be \[6\] torch.float32"),
])
def test_bad_input_is_named(field, bad, match, seed):
    tensors = dict(zip(("mass", "scores", "valid", "weight"), make_rows(seed, 6, 20)))
    tensors[field] = bad(tensors[field])
    with pytest.raises(ValueError, match=match):
        fused_kl_rows(tensors["mass"], tensors["scores"], tensors["valid"], tensors["weight"])


# ------------------------------------------------------------------------------------------ the layer
@pytest.mark.skipif(HAS_CUDA, reason="the CPU interpreter case (the GPU runs the kernel where it serves)")
def test_layer_with_the_fused_kl_matches_torch_kl(seed, monkeypatch):
    """The layer (packed documents, empty slots, fp32, the indexer's Triton paths on the interpreter): the
    loss and every gradient with ``indexer_loss_kl=triton`` against ``torch``, both on the selection's
    scores and on recomputed ones."""
    from dsv4cp.harness.build import build_case
    from dsv4cp.harness.case import Case
    from dsv4cp.ops import indexer as ops_indexer

    monkeypatch.setattr(ops_indexer, "triton_serves", lambda x: x.dtype != torch.float64 and x.shape[-1] % 16 == 0)
    monkeypatch.setattr(ops_kl, "fused_serves", lambda *ts: all(t.dtype == torch.float32 for t in ts))
    layer, packed, x, weight = build_case(Case(lengths=(9, 0, 23, 5), total=40, seed=seed), torch.device("cpu"))

    def step(options):
        run = copy.deepcopy(layer)
        run.kernel_options = kernel_options.KernelOptions.resolve(options)
        leaf = x.clone().requires_grad_()
        kernel_options.reset_backends_ran()
        result = run(leaf, packed)
        ((result.out * weight).sum() + result.indexer_loss).backward()
        ran = kernel_options.backends_ran().get("indexer_kl")
        return result.indexer_loss.detach(), {"x": leaf.grad, **{n: p.grad for n, p in run.named_parameters()
                                                                 if p.grad is not None}}, ran

    for scores in ("selection", "recompute"):
        want_loss, want, want_ran = step({"indexer_loss_scores": scores, "indexer_loss_kl": "torch"})
        got_loss, got, got_ran = step({"indexer_loss_scores": scores, "indexer_loss_kl": "triton"})
        assert (want_ran, got_ran) == (None, "triton")
        assert abs(float(got_loss - want_loss)) <= 1e-5 * abs(float(want_loss)), f"seed={seed}: {scores} loss"
        for name, g in want.items():
            scale = float(g.abs().max()) or 1.0
            assert float((got[name] - g).abs().max()) <= 1e-4 * scale, f"seed={seed}: {scores} {name}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_flash_shapes_match_the_reference(seed):
    """rows = 65536, K = 512 (the 64K flash C layer's sparse loss): the rows and the gradient as on CPU."""
    mass, scores, valid, weight = make_rows(seed, 65536, 512, device="cuda")
    check_rows(mass, scores, valid, weight, seed)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU interpreter case")
def test_compiled_layer_reaches_the_fused_pass_through_its_custom_op(seed, monkeypatch):
    """``torch.compile`` (aot_eager) of the layer with ``indexer_loss_kl=triton`` on the Triton paths: no
    graph break, the fused pass run (its custom op notes it), the eager step's loss and gradients."""
    from torch._dynamo.utils import counters

    from dsv4cp.harness.build import build_case
    from dsv4cp.harness.case import Case
    from dsv4cp.ops import attention_probs, compress_pool, norm_rope
    from dsv4cp.ops import indexer as ops_indexer

    def serves(x, *_):
        return x.dtype != torch.float64 and x.shape[-1] % 16 == 0

    monkeypatch.setattr(ops_indexer, "triton_serves", serves)
    monkeypatch.setattr(attention_probs, "triton_serves", serves)
    monkeypatch.setattr(norm_rope, "use_fused", lambda x, freqs=None: serves(x))
    monkeypatch.setattr(compress_pool, "use_triton", lambda values, gates: serves(values))
    monkeypatch.setattr(ops_kl, "fused_serves", lambda *ts: all(t.dtype == torch.float32 for t in ts))
    layer, packed, x, weight = build_case(Case(lengths=(9, 0, 23), total=32, seed=seed), torch.device("cpu"))
    layer.kernel_options = kernel_options.KernelOptions.resolve({"indexer_loss_kl": "triton"})

    def step(run, compiled):
        leaf = x.clone().requires_grad_()
        kernel_options.reset_backends_ran()
        result = (torch.compile(run, backend="aot_eager") if compiled else run)(leaf, packed)
        ((result.out * weight).sum() + result.indexer_loss).backward()
        grads = {"x": leaf.grad, **{n: p.grad for n, p in run.named_parameters() if p.grad is not None}}
        return result.indexer_loss.detach(), grads, kernel_options.backends_ran().get("indexer_kl")

    want_loss, want, want_ran = step(copy.deepcopy(layer), False)
    torch._dynamo.reset()
    counters.clear()
    got_loss, got, got_ran = step(layer, True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert want_ran == got_ran == "triton"
    assert abs(float(got_loss - want_loss)) <= 1e-5 * abs(float(want_loss)), f"seed={seed}"
    for name, g in want.items():
        scale = float(g.abs().max()) or 1.0
        assert float((got[name] - g).abs().max()) <= 1e-5 * scale, f"seed={seed}: {name}"


def test_custom_op_passes_opcheck_and_is_the_eager_pass(seed):
    from dsv4cp.ops import indexer_kl_library

    mass, scores, valid, weight = make_rows(seed, 8, 24)
    for with_grad in (True, False):
        torch.library.opcheck(indexer_kl_library.indexer_kl_rows,
                              (mass, scores.clone().requires_grad_(with_grad), valid, weight, with_grad))
    rows, dscores = indexer_kl_library.indexer_kl_rows(mass, scores, valid, weight, True)
    leaf = scores.clone().requires_grad_()
    want = fused_kl_rows(mass, leaf, valid, weight)
    want.sum().backward()
    assert torch.equal(rows, want.detach()) and torch.equal(dscores, leaf.grad)
