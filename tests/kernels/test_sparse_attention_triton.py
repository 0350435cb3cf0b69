"""Triton sparse-attention kernels against the torch oracle (DESIGN 4.1, 4.2).

CPU: fp32 (and a bf16 smoke check) under Triton's interpreter at tiny sizes (T <= 16, H <= 8, D <= 64,
Kt <= 80, plus one multi-head-block case). GPU (marked ``gpu``): full size D = 512, H = 64, Kt = 640,
T = 2048 in bf16 against an fp32 reference, fp32 at small sizes, and bitwise determinism.

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it); every
case mixes empty (-1) slots, a row with no valid key, duplicated indices, random sinks and (when given)
topk_length.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import (
    DkvConfig,
    is_deterministic,
    set_deterministic,
    sparse_attention_bwd,
    sparse_attention_fwd,
    triton_available,
    triton_interpreting,
)
from dsv4cp.ops.sparse_attention import resolve_backend, sparse_attention
from dsv4cp.ops.sparse_attention_torch import (
    sparse_attention_backward as torch_backward,
)
from dsv4cp.ops.sparse_attention_torch import (
    sparse_attention_forward as torch_forward,
)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and not triton_interpreting():
    pytest.fail(
        "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it, but "
        "something imported triton earlier): set it in the environment",
        pytrace=False,
    )
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def make_case(seed, t, h, d, n, kt, *, dtype=torch.float32, device="cpu", topk=False, dup_all=False):
    """Random inputs; never zeros. Row 1 has no valid key (all -1 or topk_length 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (t, kt), generator=g)
    idx[torch.rand(t, kt, generator=g) < 0.2] = -1  # empty slots
    if kt > 1:  # duplicated indices inside rows
        idx[::2, kt - 1] = idx[::2, 0]
        idx[1::3, kt // 2] = idx[1::3, 0]
    if dup_all:  # many queries hitting few rows: stresses the kv-gradient reduction
        idx = torch.where(idx >= 0, idx % 3, idx)
    if t > 1:
        idx[1] = -1
    topk_length = None
    if topk:
        topk_length = torch.randint(0, kt + 3, (t,), generator=g, dtype=torch.int32)
        if t > 2:
            topk_length[2] = 0
    idx = idx.to(torch.int32)
    to = {"device": device}
    return (q.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), idx.to(**to), sink.to(**to), d**-0.5,
            None if topk_length is None else topk_length.to(**to))


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def check_lse(lse, ref, tol, msg):
    assert lse.dtype == torch.float32, msg
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), empty), f"{msg}: -inf pattern of lse differs"
    assert rel_fro(lse[~empty], ref[~empty]) < tol, f"{msg}: lse"


# ------------------------------------------------------------------------------------------ CPU
# (T, H, D, N, Kt): H not a multiple of 16, Kt not a multiple of 64, D non-power-of-two once.
CPU_CASES = [
    (16, 3, 32, 40, 13),
    (12, 5, 64, 60, 70),
    (8, 8, 48, 30, 80),
    (6, 1, 16, 12, 5),
]


@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_forward_matches_torch_fp32(case, topk, seed):
    _check_forward_fp32(case, topk, seed, f"seed={seed} case={case} topk={topk}")


def _check_forward_fp32(case, topk, seed, msg, *, spread=1.0, **launch):
    """The Triton forward under ``launch`` against the torch forward at fp32 tolerances (out 1e-4 relative,
    lse 1e-4), on ``make_case``'s inputs with q scaled by ``spread``; row 1 (no key) must output 0."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, topk=topk)
    q = q * spread
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, **launch)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl_)
    assert out.dtype == q.dtype and out.shape == q.shape, msg
    assert torch.isfinite(out).all(), msg
    assert rel_fro(out, ref_out) < 1e-4, f"{msg}: out {rel_fro(out, ref_out):.2e}"
    check_lse(lse, ref_lse, 1e-4, msg)
    assert out[1].abs().max().item() == 0.0, f"{msg}: row without key must output 0"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
@pytest.mark.parametrize("case", CPU_CASES[:3], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_backward_matches_torch_fp32(case, topk, deterministic, seed):
    _check_backward_fp32(case, topk, seed, f"seed={seed} case={case} topk={topk} deterministic={deterministic}",
                         deterministic=deterministic)


def _check_backward_fp32(case, topk, seed, msg, **launch):
    """The Triton backward under ``launch`` against the torch backward (dq, dkv, dsink 1e-4 relative) at the
    torch forward's out and lse; row 1 (no key) must get dq = 0. Returns the Triton gradients."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, topk=topk)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, **launch)
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{msg}: {name} {a.dtype} {a.shape}"
        assert torch.isfinite(a).all(), f"{msg}: {name} not finite"
        assert rel_fro(a, b) < 1e-4, f"{msg}: {name} rel err {rel_fro(a, b):.2e}"
    assert got[0][1].abs().max().item() == 0.0, f"{msg}: row without key must get dq = 0"
    return got


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CPU_CASES[:3], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_backward_dq_in_dkv_matches_torch_fp32(case, deterministic, seed):
    """dq accumulated by the dkv kernel (the first kernel writes p / ds only)."""
    msg = f"seed={seed} case={case} deterministic={deterministic}"
    got = _check_backward_fp32(case, True, seed, msg, deterministic=deterministic, dq_in_dkv=True)
    assert got[0][2].abs().max().item() == 0.0, f"{msg}: topk_length 0 must get dq = 0"


def _op_gradients(q, kv, idx, sink, scale, tl_, dout, options):
    """The op's forward and gradients on the Triton backend under ``options`` (the kernels clamp the
    lengths to the slots; the op takes them in range)."""
    leaves = [t.detach().requires_grad_() for t in (q, kv, sink)]
    out, _ = sparse_attention(leaves[0], leaves[1], idx, leaves[2], scale, tl_.clamp(0, idx.shape[1]),
                              backend="triton", options=options)
    out.backward(dout)
    return out.detach(), [leaf.grad for leaf in leaves]


def test_dq_in_dkv_switch(seed, monkeypatch):
    """DSV4CP_TRITON_DQ_IN_DKV, resolved into the options the op takes, selects the placement (its own
    cached configurations) both ways (1 is also the default, so 0 is what shows the variable is read), the
    kernel's keyword selects it too, and a value other than 0 / 1 is refused when resolved (before any
    kernel runs)."""
    from dsv4cp.kernels import sparse_attention_launch as sat

    q, kv, idx, sink, scale, tl_ = make_case(seed, 6, 2, 16, 10, 7, topk=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    for pinning in ("DSV4CP_TRITON_BWD_CONFIG", "DSV4CP_TRITON_DKV_CONFIG"):  # a pinned launch caches nothing
        monkeypatch.delenv(pinning, raising=False)
    in_dkv, in_dq = {"bwd_dq_dq_in_dkv", "bwd_dkv_dq_in_dkv"}, {"bwd_dq", "bwd_dkv"}

    def check(kinds, expected, msg):
        assert expected <= kinds and not ((in_dkv | in_dq) - expected) & kinds, f"{msg}: {kinds}"

    for env, expected in (("1", in_dkv), ("0", in_dq)):
        monkeypatch.setenv(sat.DQ_IN_DKV_ENV, env)
        sat._CHOSEN.clear()
        # the backward that places dq (the default one computes dq in a pass of its own)
        options = KernelOptions.resolve({"triton_bwd_dq_pass": "0"})
        _, got = _op_gradients(q, kv, idx, sink, scale, tl_, dout, options)
        check({key[0] for key in sat._CHOSEN}, expected, f"seed={seed} env={env}")
        assert all(rel_fro(a, b) < 1e-4 for a, b in zip(got, ref)), f"seed={seed} env={env}"
    monkeypatch.delenv(sat.DQ_IN_DKV_ENV)
    for keyword, expected in ((False, in_dq), (True, in_dkv)):
        sat._CHOSEN.clear()
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, dq_in_dkv=keyword)
        check({key[0] for key in sat._CHOSEN}, expected, f"seed={seed} keyword={keyword}")
        assert all(rel_fro(a, b) < 1e-4 for a, b in zip(got, ref)), f"seed={seed} keyword={keyword}"
    monkeypatch.setenv(sat.DQ_IN_DKV_ENV, "yes")
    with pytest.raises(ValueError, match=f"^{sat.DQ_IN_DKV_ENV}: .*'yes'"):
        KernelOptions.resolve()


@pytest.mark.parametrize("logits", ["split", "slots_on_m"])
@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_forward_logits_layouts_match_torch_fp32(case, topk, logits, seed):
    """The forward whose warpgroups split the logits' slots (the value product fed through a branch), and
    the one with the slots on M (``kv @ q^T``, the softmax down the columns)."""
    _check_forward_fp32(case, topk, seed, f"seed={seed} case={case} topk={topk} logits={logits}", logits=logits)


@pytest.mark.parametrize("dq_in_dkv", [False, True], ids=["dq-kernel", "dq-in-dkv"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CPU_CASES[:3], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_backward_dkv_one_product_matches_torch_fp32(case, deterministic, dq_in_dkv, seed):
    """The dkv kernel forming ds^T q + p^T dO as one product (p and ds side by side in one scratch);
    H = 3 and 5 pad the heads to 16 inside the kernel."""
    msg = f"seed={seed} case={case} deterministic={deterministic} dq_in_dkv={dq_in_dkv}"
    _check_backward_fp32(case, True, seed, msg, deterministic=deterministic, dq_in_dkv=dq_in_dkv, dkv_one_product=True)


@pytest.mark.parametrize("variant", ["plain", "split-one-product", "slots_on_m-one-product"])
@pytest.mark.parametrize("case", CPU_CASES[:3], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_index_ahead_matches_torch_fp32(case, variant, seed):
    """Row indices loaded one step ahead, in the forward and in both backward kernels (both dq placements),
    over 16-slot steps (Kt = 13, 70, 80: one to five steps, the last one partial), alone and with the
    other variants."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, topk=True)
    others = variant != "plain"
    logits = variant.split("-")[0] if others else "duplicated"
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, block_k=16, logits=logits, index_ahead=True)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl_)
    msg = f"seed={seed} case={case} variant={variant}"
    assert rel_fro(out, ref_out) < 1e-4, f"{msg}: out {rel_fro(out, ref_out):.2e}"
    check_lse(lse, ref_lse, 1e-4, msg)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_)
    for dq_in_dkv in (False, True):
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_, block_k=16,
                                   dq_in_dkv=dq_in_dkv, dkv_one_product=others, index_ahead=True,
                                   dkv_config=DkvConfig(block_k=16, block_d=32, num_warps=4, num_stages=1))
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
            assert rel_fro(a, b) < 1e-4, f"{msg} dq_in_dkv={dq_in_dkv}: {name} rel err {rel_fro(a, b):.2e}"


@pytest.mark.parametrize("spread", [1.0, 4.0], ids=["logits-x1", "logits-x4"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_forward_lazy_rescale_matches_torch_fp32(case, spread, seed):
    """The split forward rescaling its accumulator only when a head's max rises by more than 2^8, over
    16-slot steps; q scaled by 4 spreads the logits so that some steps rescale and others keep the max."""
    _check_forward_fp32(case, True, seed, f"seed={seed} case={case} spread={spread}", spread=spread, block_k=16,
                        logits="split", lazy_rescale=True)


LOGITS_VARIABLE = "DSV4CP_TRITON_FWD_LOGITS"
VARIANT_VARIABLES = ("DSV4CP_TRITON_DKV_ONE_PRODUCT", "DSV4CP_TRITON_FWD_INDEX_AHEAD", "DSV4CP_TRITON_BWD_INDEX_AHEAD",
                     "DSV4CP_TRITON_FWD_LAZY_RESCALE")


def test_variant_options_select_the_kernels(seed, monkeypatch):
    """The variables of the forward's logits layout and lazy rescale, the dkv kernel's one product and both
    directions' indices ahead, resolved into the options the op takes, select the variants (each under its
    own cached configuration) both ways; the kernels' keywords select them too; a value a variable does not
    allow is refused when resolved, a layout the forward does not know by the forward."""
    from dsv4cp.kernels import sparse_attention_launch as sat

    q, kv, idx, sink, scale, tl_ = make_case(seed, 6, 2, 16, 10, 7, topk=True)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_)
    for pinning in ("DSV4CP_TRITON_FWD_CONFIG", "DSV4CP_TRITON_BWD_CONFIG", "DSV4CP_TRITON_DKV_CONFIG"):
        monkeypatch.delenv(pinning, raising=False)  # a pinned launch caches nothing
    monkeypatch.delenv(sat.DQ_IN_DKV_ENV, raising=False)
    monkeypatch.setenv("DSV4CP_TRITON_BWD_DQ_PASS", "0")  # the variants are those of the dq-in-dkv backward
    # each launch caches its configuration under its kind, the shape class and the variant's switches
    variants = {("fwd", "split", True, True), ("bwd_dq_dq_in_dkv", True), ("bwd_dkv_dq_in_dkv", True, True)}
    plain = {("fwd", "duplicated", False, False), ("bwd_dq_dq_in_dkv", False), ("bwd_dkv_dq_in_dkv", False, False)}

    def kinds():
        return {(key[0], *key[len(sat._config_key(q)) + 1:]) for key in sat._CHOSEN}

    for env, split in (("1", True), ("0", False)):
        for variable in VARIANT_VARIABLES:
            monkeypatch.setenv(variable, env)
        monkeypatch.setenv(LOGITS_VARIABLE, "split" if split else "duplicated")
        sat._CHOSEN.clear()
        out, got = _op_gradients(q, kv, idx, sink, scale, tl_, dout, KernelOptions.resolve())
        msg = f"seed={seed} env={env}"
        assert kinds() == (variants if split else plain), f"{msg}: {kinds()}"
        assert rel_fro(out, ref_out) < 1e-4, f"{msg}: out"
        assert all(rel_fro(a, b) < 1e-4 for a, b in zip(got, ref)), f"{msg}: gradients"
    for variable in (*VARIANT_VARIABLES, LOGITS_VARIABLE):
        monkeypatch.delenv(variable)
    for split in (False, True):
        sat._CHOSEN.clear()
        out, _ = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, logits="split" if split else "duplicated",
                                      index_ahead=split, lazy_rescale=split)
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_, dkv_one_product=split,
                                   index_ahead=split)
        msg = f"seed={seed} keywords={split}"
        assert kinds() == (variants if split else plain), f"{msg}: {kinds()}"
        assert rel_fro(out, ref_out) < 1e-4 and all(rel_fro(a, b) < 1e-4 for a, b in zip(got, ref)), msg
    for variable in (*VARIANT_VARIABLES, LOGITS_VARIABLE):
        monkeypatch.setenv(variable, "yes")
        with pytest.raises(ValueError, match=f"^{variable}: .*'yes'"):
            KernelOptions.resolve()
        monkeypatch.delenv(variable)
    with pytest.raises(ValueError, match="^logits: .*'heads'"):
        sparse_attention_fwd(q, kv, idx, sink, scale, tl_, logits="heads")


def test_multiple_head_and_slot_blocks(seed):
    """H = 20 over head blocks of 16 (the second one 4/16 full), slots in blocks of 16, the kv gradient
    in two 16-column blocks of D, the backward in chunks of 2 queries."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, 4, 20, 32, 24, 37, topk=True)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl_)
    for logits in ("duplicated", "split", "slots_on_m"):
        out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, block_h=16, block_k=16, logits=logits)
        assert rel_fro(out, ref_out) < 1e-4, f"seed={seed} logits={logits}"
        check_lse(lse, ref_lse, 1e-4, f"seed={seed} logits={logits}")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_)
    for det, dq_in_dkv, one in ((False, False, False), (True, False, False), (False, True, False),
                                (False, True, True), (True, True, True)):
        two_queries = 2 * (2 * 37 * 20 * 4 + 37 * 32 * 4)  # scratch of 2 queries: several chunks
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_, deterministic=det,
                                   block_h=16, block_k=16, scratch_bytes=two_queries, dq_in_dkv=dq_in_dkv,
                                   dkv_config=DkvConfig(block_k=16, block_d=16, num_warps=4, num_stages=1),
                                   dkv_one_product=one)
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
            assert rel_fro(a, b) < 1e-4, f"seed={seed} det={det} dq_in_dkv={dq_in_dkv} one_product={one}: {name}"


def test_deterministic_backward_is_bitwise_reproducible(seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, 16, 5, 32, 20, 40, topk=True, dup_all=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    kw = {"deterministic": True, "scratch_bytes": 5 * (2 * 40 * 5 * 4 + 40 * 32 * 4)}  # chunks of 5 queries
    first = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, **kw)
    second = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, **kw)
    for name, a, b in zip(("dq", "dkv", "dsink"), first, second):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between runs"
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    assert rel_fro(first[1], ref[1]) < 1e-4, f"seed={seed}: dkv"


def test_sink_minus_inf_and_empty_rows_stay_finite(seed):
    """A -inf sink (a padded head) and rows without keys: out 0, lse -inf, no NaN anywhere."""
    q, kv, idx, sink, scale, _ = make_case(seed, 5, 4, 32, 16, 9)
    sink[0] = float("-inf")
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"seed={seed}"
    assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all(), f"seed={seed}"
    has_key = ~torch.isneginf(lse)
    ref_out, _ = torch_forward(q, kv, idx, sink, scale)
    assert rel_fro(out[has_key], ref_out[has_key]) < 1e-4, f"seed={seed}"
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    for det in (False, True):
        dq, dkv, dsink = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, deterministic=det)
        assert torch.isfinite(dq).all() and torch.isfinite(dkv).all() and torch.isfinite(dsink).all()
        assert dsink[0].item() == 0.0, f"seed={seed}: a -inf sink gets no gradient"


def test_bf16_through_interpreter_vs_fp32_reference(seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, 8, 4, 32, 24, 20, topk=True)
    # The fp32 reference sees the same bf16-rounded inputs, so only the kernel's own rounding is measured.
    q, kv = q.bfloat16(), kv.bfloat16()
    ref_out, ref_lse = torch_forward(q.float(), kv.float(), idx, sink, scale, tl_)
    for logits, ahead in (("duplicated", False), ("split", True), ("slots_on_m", False)):
        out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, logits=logits, index_ahead=ahead)
        assert out.dtype == torch.bfloat16
        assert rel_fro(out, ref_out) < 1e-2, f"seed={seed} logits={logits}"
        check_lse(lse, ref_lse, 1e-2, f"seed={seed} logits={logits}")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    ref = torch_backward(dout.float(), q.float(), kv.float(), idx, sink, scale, out.float(), ref_lse, tl_)
    for dq_in_dkv, one in ((False, False), (True, False), (True, True)):
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, dq_in_dkv=dq_in_dkv,
                                   dkv_one_product=one, index_ahead=one)
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
            assert rel_fro(a, b) < 1e-2, f"seed={seed} dq_in_dkv={dq_in_dkv} one_product={one}: {name}"


def test_int64_indices_and_topk(seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, 6, 2, 16, 10, 7, topk=True)
    out32, lse32 = sparse_attention_fwd(q, kv, idx, sink, scale, tl_)
    out64, lse64 = sparse_attention_fwd(q, kv, idx.long(), sink, scale, tl_.long())
    assert torch.equal(out32, out64) and torch.equal(lse32, lse64), f"seed={seed}"


def _sm90_resources(match: str) -> dict[tuple[str, str], dict[str, float]]:
    """``bench/sparse_attention_resources.py`` for the flash candidates matching ``match``, in a process
    without the interpreter: (candidate, kernel) -> its figures."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "bench.sparse_attention_resources", "--shapes", "flash",
                           "--match", match], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = re.compile(r"^flash (fwd|bwd) (.+?) +(_\w+_kernel) +(\d+) regs +(\d+) B stack +([\d.]+) KB +(\d+) wgmma")
    found = {}
    for text in done.stdout.splitlines():
        m = line.match(text)
        if m:
            found[(m.group(2), m.group(3))] = {"regs": int(m.group(4)), "stack": int(m.group(5)),
                                               "shared_kb": float(m.group(6)), "wgmma": int(m.group(7))}
    return found


@pytest.mark.slow
def test_sm90_build_stops_duplicating_products():
    """Compiled for sm_90 without a GPU, the split logits and the dkv kernel's one product issue fewer
    wgmma instructions than the layouts that have both warpgroups compute the same product (Triton's
    layout rule for a product feeding another: a Triton upgrade that changes it fails here), within
    the shared memory of an SM and without more spills."""
    pytest.importorskip("triton.backends.nvidia")
    got = _sm90_resources(r"^64x64x8x2( split logits)?$|^64x64x8x1 / dkv 64x256x8x2 dq-in-dkv( one-product)?$")
    pairs = ((("64x64x8x2", "_fwd_kernel"), ("64x64x8x2 split logits", "_fwd_kernel")),
             (("64x64x8x1 / dkv 64x256x8x2 dq-in-dkv", "_bwd_dkv_kernel"),
              ("64x64x8x1 / dkv 64x256x8x2 dq-in-dkv one-product", "_bwd_dkv_kernel")))
    for old, new in pairs:
        assert old in got and new in got, f"missing figures: {sorted(got)}"
        assert got[new]["wgmma"] < got[old]["wgmma"], f"{new}: {got[new]} against {old}: {got[old]}"
        assert got[new]["stack"] <= got[old]["stack"] and got[new]["shared_kb"] <= 227, f"{new}: {got[new]}"


# ------------------------------------------------------------------------------------------ validation
def _good(d=32, dtype=torch.float32):
    return make_case(1, 3, 2, d, 8, 4, dtype=dtype)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda a: (a[0][..., :24].contiguous(), a[1][:, :24].contiguous(), *a[2:]), "q"),  # D = 24
        (lambda a: (a[0].double(), a[1].double(), *a[2:]), "q"),  # fp64
        (lambda a: (a[0][..., :16], a[1], *a[2:]), "kv"),  # D mismatch
        (lambda a: (a[0], a[1].half(), *a[2:]), "kv"),  # dtype mismatch
        (lambda a: (a[0], a[1], a[2].float(), *a[3:]), "idx"),
        (lambda a: (a[0], a[1], a[2][:2], *a[3:]), "idx"),
        (lambda a: (a[0], a[1], a[2], a[3][:1], *a[4:]), "sink"),
        (lambda a: (*a[:5], torch.ones(2, dtype=torch.int32)), "topk_length"),
        (lambda a: (*a[:5], torch.ones(3)), "topk_length"),
    ],
)
def test_invalid_inputs_raise_naming_the_field(mutate, field):
    args = mutate(_good())
    with pytest.raises(ValueError, match=f"^{field}:"):
        sparse_attention_fwd(*args)


def test_head_dim_over_limit_raises():
    q = torch.randn(2, 1, 528)
    with pytest.raises(ValueError, match="^q:.*at most 512"):
        sparse_attention_fwd(q, torch.randn(4, 528), torch.zeros(2, 1, dtype=torch.int32), torch.zeros(1), 1.0)


def test_backward_validates_dout():
    q, kv, idx, sink, scale, _ = _good()
    out, lse = torch_forward(q, kv, idx, sink, scale)
    with pytest.raises(ValueError, match="^dout:"):
        sparse_attention_bwd(out[:, :1], q, kv, idx, sink, scale, out, lse)
    with pytest.raises(ValueError, match="^lse:"):
        sparse_attention_bwd(out, q, kv, idx, sink, scale, out, lse[:1])


def test_pinned_config_validation():
    q, kv, idx, sink, scale, _ = _good()
    with pytest.raises(ValueError, match="^block_k:"):
        sparse_attention_fwd(q, kv, idx, sink, scale, block_k=24)


# ------------------------------------------------------------------------------------------ registry
needs_backend = pytest.mark.skipif(
    not triton_available(torch.device("cuda" if HAS_CUDA else "cpu")),
    reason="triton backend unavailable here (CPU needs TRITON_INTERPRET=1 before the session starts)",
)


@needs_backend
@pytest.mark.parametrize("backend", ["triton", "triton-deterministic"])
def test_registered_backend_autograd_matches_torch(backend, seed):
    device = "cuda" if HAS_CUDA else "cpu"
    q, kv, idx, sink, scale, tl_ = make_case(seed, 8, 3, 32, 20, 11, device=device, topk=True)
    tl_ = tl_.clamp_max(idx.shape[1])  # the op takes lengths in [0, Kt]; the kernel tests above go beyond
    results = {}
    for name in ("torch", backend):
        leaves = [x.clone().requires_grad_(True) for x in (q, kv, sink)]
        out, lse = sparse_attention(leaves[0], leaves[1], idx, leaves[2], scale, tl_, backend=name)
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        results[name] = (out, lse, *(x.grad for x in leaves))
    for what, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), results[backend], results["torch"]):
        if what == "lse":
            check_lse(a, b, 1e-4, f"seed={seed}")
        else:
            assert rel_fro(a, b) < 1e-4, f"seed={seed} {backend}: {what}"


@needs_backend
def test_registered_backend_serves_fp64_through_the_oracle(seed):
    """tl.dot has no fp64 matrix-unit path: the backend hands fp64 (CP tests) to the torch oracle."""
    device = "cuda" if HAS_CUDA else "cpu"
    q, kv, idx, sink, scale, _ = make_case(seed, 4, 2, 16, 8, 5, dtype=torch.float64, device=device)
    got = sparse_attention(q, kv, idx, sink, scale, backend="triton")
    ref = sparse_attention(q, kv, idx, sink, scale, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_auto_order_torch_on_cpu_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    if HAS_CUDA:
        assert "torch" not in resolve_backend("auto", torch.device("cuda")).direction_names  # triton or a library


def test_set_deterministic_round_trip():
    before = is_deterministic()
    try:
        set_deterministic(True)
        assert is_deterministic()
        set_deterministic(False)
        assert is_deterministic() == torch.are_deterministic_algorithms_enabled()
    finally:
        set_deterministic(before and not torch.are_deterministic_algorithms_enabled())


# ------------------------------------------------------------------------------------------ GPU
def realistic_idx(t, n_window, n_selected, n_compressed, device, generator):
    """Window = the previous ``n_window`` raw rows (-1 before the start), then ``n_selected`` distinct
    random compressed rows (kv rows ``t .. t + n_compressed``)."""
    tok = torch.arange(t, device=device)
    window = tok[:, None] - torch.arange(n_window, device=device)[None, :]
    window = torch.where(window >= 0, window, torch.full_like(window, -1))
    scores = torch.rand(t, n_compressed, device=device, generator=generator)
    selected = scores.topk(n_selected, dim=1).indices + t
    return torch.cat([window, selected], dim=1).to(torch.int32)


def gpu_case(seed, t, h, d, n_window, n_selected, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_comp = max(t // 4, n_selected)
    n = t + n_comp
    q = torch.randn(t, h, d, device="cuda", generator=g)
    q = q / q.norm(dim=-1, keepdim=True) * d**0.5  # model: per-head RMS-normalised queries
    kv = torch.randn(n, d, device="cuda", generator=g)
    sink = torch.randn(h, device="cuda", generator=g)
    idx = realistic_idx(t, n_window, n_selected, n_comp, "cuda", g)
    return q.to(dtype), kv.to(dtype), idx, sink, d**-0.5


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("heads, n_selected", [(64, 512), (128, 1024), (3, 64)], ids=["flash", "pro", "H3"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_full_size_bf16(heads, n_selected, deterministic, seed):
    t = 2048 if heads <= 64 else 1024
    q, kv, idx, sink, scale = gpu_case(seed, t, heads, 512, 128, n_selected, torch.bfloat16)
    q32, kv32 = q.float(), kv.float()  # the fp32 reference sees exactly the bf16 values
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale)
    ref_out, ref_lse = torch_forward(q32, kv32, idx, sink, scale)
    msg = f"seed={seed} H={heads}"
    assert rel_fro(out, ref_out) < 1e-2, f"{msg}: out {rel_fro(out, ref_out):.2e}"
    check_lse(lse, ref_lse, 1e-2, msg)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    got = sparse_attention_bwd(dout.bfloat16(), q, kv, idx, sink, scale, out, lse, deterministic=deterministic)
    ref = torch_backward(dout.bfloat16().float(), q32, kv32, idx, sink, scale, ref_out, ref_lse)
    for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
        assert rel_fro(a, b) < 1e-2, f"{msg}: {name} {rel_fro(a, b):.2e}"
    if deterministic:
        again = sparse_attention_bwd(dout.bfloat16(), q, kv, idx, sink, scale, out, lse, deterministic=True)
        for name, a, b in zip(("dq", "dkv", "dsink"), got, again):
            assert torch.equal(a, b), f"{msg}: {name} not bitwise reproducible"


@pytest.mark.parametrize("heads, n_selected", [(64, 512), (128, 1024), (3, 64)], ids=["flash", "pro", "H3"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_full_size_bf16_dq_in_dkv(heads, n_selected, seed):
    """The backward with dq accumulated by the dkv kernel (its own default configurations at D = 512)."""
    t = 2048 if heads <= 64 else 1024
    q, kv, idx, sink, scale = gpu_case(seed, t, heads, 512, 128, n_selected, torch.bfloat16)
    q32, kv32 = q.float(), kv.float()
    ref_out, ref_lse = torch_forward(q32, kv32, idx, sink, scale)
    out = ref_out.bfloat16()
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    got = sparse_attention_bwd(dout.bfloat16(), q, kv, idx, sink, scale, out, ref_lse, deterministic=False,
                               dq_in_dkv=True)
    ref = torch_backward(dout.bfloat16().float(), q32, kv32, idx, sink, scale, ref_out, ref_lse)
    for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
        assert rel_fro(a, b) < 1e-2, f"seed={seed} H={heads}: {name} {rel_fro(a, b):.2e}"


@pytest.mark.parametrize("logits, ahead", [("split", False), ("split", True), ("slots_on_m", True)],
                         ids=["split", "split-index-ahead", "slots_on_m-index-ahead"])
@pytest.mark.parametrize("heads, n_selected", [(64, 512), (128, 1024), (3, 64)], ids=["flash", "pro", "H3"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_full_size_bf16_variants(heads, n_selected, logits, ahead, seed):
    """The forward's logits layouts and the dkv kernel's one product (with or without the indices loaded
    one step ahead), each at its own default launch ladder at D = 512, against the fp32 reference (atomic
    and deterministic backward)."""
    t = 2048 if heads <= 64 else 1024
    q, kv, idx, sink, scale = gpu_case(seed, t, heads, 512, 128, n_selected, torch.bfloat16)
    q32, kv32 = q.float(), kv.float()
    ref_out, ref_lse = torch_forward(q32, kv32, idx, sink, scale)
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, logits=logits, index_ahead=ahead)
    msg = f"seed={seed} H={heads} logits={logits} ahead={ahead}"
    assert rel_fro(out, ref_out) < 1e-2, f"{msg}: out {rel_fro(out, ref_out):.2e}"
    check_lse(lse, ref_lse, 1e-2, msg)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    ref = torch_backward(dout.bfloat16().float(), q32, kv32, idx, sink, scale, ref_out, ref_lse)
    for det in (False, True):
        got = sparse_attention_bwd(dout.bfloat16(), q, kv, idx, sink, scale, ref_out.bfloat16(), ref_lse,
                                   deterministic=det, dkv_one_product=True, index_ahead=ahead)
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
            assert rel_fro(a, b) < 1e-2, f"{msg} det={det}: {name} {rel_fro(a, b):.2e}"


@pytest.mark.parametrize(
    "case", CPU_CASES + [(64, 7, 512, 300, 200)], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c)
)
@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_matches_torch(case, seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, device="cuda", topk=True)
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl_)
    assert rel_fro(out, ref_out) < 1e-4, f"seed={seed}"
    check_lse(lse, ref_lse, 1e-4, f"seed={seed}")
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    ref = torch_backward(dout, q, kv, idx, sink, scale, ref_out, ref_lse, tl_)
    for logits, ahead in (("split", False), ("split", True), ("slots_on_m", False)):
        other_out, other_lse = sparse_attention_fwd(q, kv, idx, sink, scale, tl_, logits=logits, index_ahead=ahead)
        assert rel_fro(other_out, ref_out) < 1e-4, f"seed={seed} ahead={ahead}: {logits} logits"
        check_lse(other_lse, ref_lse, 1e-4, f"seed={seed} ahead={ahead}: {logits} logits")
    for det, dq_in_dkv, one, ahead in ((False, False, False, False), (True, False, False, False),
                                       (False, True, False, False), (False, True, True, False),
                                       (True, True, True, False), (False, True, True, True),
                                       (False, False, False, True)):
        got = sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, tl_, deterministic=det,
                                   dq_in_dkv=dq_in_dkv, dkv_one_product=one, index_ahead=ahead)
        for name, a, b in zip(("dq", "dkv", "dsink"), got, ref):
            assert rel_fro(a, b) < 1e-4, (f"seed={seed} det={det} dq_in_dkv={dq_in_dkv} one_product={one} "
                                          f"ahead={ahead}: {name} {rel_fro(a, b):.2e}")

