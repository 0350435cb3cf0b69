"""The Triton sparse-attention backward with dq in its own pass against the torch oracle (DESIGN 4.2).

CPU: fp32 under Triton's interpreter at tiny sizes (several head, column and slot blocks; empty slots, a
row with no valid key, repeated indices, random sinks, topk_length). GPU (marked ``gpu``): D = 512 at the
flash and pro head counts in bf16 against an fp32 reference, and fp32 at small sizes. Seeds from the
per-test ``seed`` fixture (DSV4CP_TEST_SEED varies it; failures print it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.sparse_attention_bwd_dq_pass_triton import (  # noqa: E402  (after the skip)
    DqPassConfig,
    KvPassConfig,
    sparse_attention_bwd_dq_pass,
)
from dsv4cp.ops.sparse_attention import resolve_backend
from dsv4cp.ops.sparse_attention_torch import sparse_attention_backward as torch_backward
from dsv4cp.ops.sparse_attention_torch import sparse_attention_forward as torch_forward
from tests.kernels.test_sparse_attention_triton import CPU_CASES, gpu_case, make_case, needs_cuda, rel_fro

SMALL_TILES = [(KvPassConfig(16, 16, 4, 1), DqPassConfig(16, 16, 16, 4, 1)), (None, None)]
"""Pinned 16-wide tiles (several column, head and slot blocks at the CPU sizes), then the ladders."""


def _check(got, ref, msg, tol, dtypes=None):
    """Each gradient's shape, dtype (``dtypes``, else the reference's), finiteness and relative error."""
    for name, a, b, dtype in zip(("dq", "dkv", "dsink"), got, ref, dtypes or [r.dtype for r in ref]):
        assert a.dtype == dtype and a.shape == b.shape, f"{msg}: {name} {a.dtype} {tuple(a.shape)}"
        assert torch.isfinite(a).all(), f"{msg}: {name} not finite"
        err = rel_fro(a, b)
        assert err < tol, f"{msg}: {name} rel err {err:.2e}"


@pytest.mark.parametrize("tiles", SMALL_TILES, ids=["16-wide", "ladder"])
@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
@pytest.mark.parametrize("case", CPU_CASES[:3] + [(10, 20, 32, 9, 40)],
                         ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_backward_dq_pass_matches_torch_fp32(case, topk, tiles, seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, topk=topk)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    kv_cfg, dq_cfg = tiles
    got = sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_, kv_config=kv_cfg,
                                       dq_config=dq_cfg)
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    msg = f"seed={seed} case={case} topk={topk} tiles={tiles}"
    _check(got, ref, msg, 1e-4)
    assert got[0][1].abs().max().item() == 0.0, f"{msg}: a row without key must get dq = 0"


def test_many_queries_on_few_rows(seed):
    """Every slot on one of three kv rows: the atomics of many queries meet on the same rows."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, 12, 4, 32, 20, 24, topk=True, dup_all=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    got = sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_)
    _check(got, torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_), f"seed={seed}", 1e-4)


def test_option_selects_the_dq_pass_backward(seed, monkeypatch):
    """``triton_bwd_dq_pass`` (default on) routes the triton backend's backward here (its launch appears in
    what ran) and off to the dq-in-dkv kernels, deterministic mode keeps the default backward, a pinned tile
    reaches the pass, and one that is not a power of two is refused naming where it came from."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, 6, 3, 16, 10, 9, topk=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    cases = [("triton", KernelOptions(), True), ("triton", KernelOptions(triton_bwd_dq_pass=False), False),
             ("triton-deterministic", KernelOptions(), False),
             ("triton", KernelOptions(triton_kv_pass_config=(16, 16, 4, 1), triton_dq_pass_config=(16, 16, 16, 4, 1)),
              True)]
    for name, options, dq_pass in cases:
        kernel_options.reset_backends_ran()
        got = resolve_backend(name, q.device).backward(dout, q, kv, idx, sink, scale, out, lse, tl_, options=options)
        ran = kernel_options.backends_ran()
        _check(got, ref, f"seed={seed} {name} {options}", 1e-4)
        assert ("sparse_attention.bwd_dq_pass.config" in ran) == dq_pass, f"{name} {options}: {ran}"
        if options.triton_kv_pass_config is not None:
            assert ran["sparse_attention.bwd_kv_pass.config"] == "block_k=16,block_d=16,num_warps=4,num_stages=1", ran
    with pytest.raises(ValueError, match=r"^kv_config\.block_k: must be a power of two"):
        sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_, kv_config=KvPassConfig(24, 16, 4, 1))
    monkeypatch.setenv(kernel_options.OPTIONS["triton_dq_pass_config"].env, "16,16,16,4")
    with pytest.raises(ValueError, match="DSV4CP_TRITON_DQ_PASS_CONFIG"):
        KernelOptions.resolve()


@pytest.mark.parametrize("heads, n_selected", [(64, 512), (128, 1024), (3, 64)], ids=["flash", "pro", "H3"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_full_size_bf16_dq_pass(heads, n_selected, seed):
    """D = 512, bf16, the passes' own ladders, against the fp32 reference of the same bf16 values."""
    t = 2048 if heads <= 64 else 1024
    q, kv, idx, sink, scale = gpu_case(seed, t, heads, 512, 128, n_selected, torch.bfloat16)
    q32, kv32 = q.float(), kv.float()
    ref_out, ref_lse = torch_forward(q32, kv32, idx, sink, scale)
    dout = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    got = sparse_attention_bwd_dq_pass(dout.bfloat16(), q, kv, idx, sink, scale, ref_out.bfloat16(), ref_lse)
    ref = torch_backward(dout.bfloat16().float(), q32, kv32, idx, sink, scale, ref_out, ref_lse)
    _check(got, ref, f"seed={seed} H={heads}", 1e-2, dtypes=(q.dtype, kv.dtype, sink.dtype))


@pytest.mark.parametrize("case", CPU_CASES + [(64, 7, 512, 300, 200)], ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_dq_pass_matches_torch(case, seed):
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, device="cuda", topk=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    got = sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_)
    _check(got, torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_), f"seed={seed}", 1e-4)
