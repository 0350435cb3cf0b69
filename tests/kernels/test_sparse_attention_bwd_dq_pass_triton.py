"""The Triton sparse-attention backward with dq in its own pass against the torch oracle (DESIGN 4.2).

CPU: fp32 under Triton's interpreter at tiny sizes (several head, column and slot blocks; empty slots, a
row with no valid key, repeated indices, random sinks, topk_length; kv-pass programs of several column
blocks, with head dims that are not a multiple of a program's columns). GPU (marked ``gpu``): D = 512 at the
flash and pro head counts in bf16 against an fp32 reference, and fp32 at small sizes. Seeds from the
per-test ``seed`` fixture (DSV4CP_TEST_SEED varies it; failures print it).
"""

from __future__ import annotations

from dataclasses import astuple

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.sparse_attention_bwd_dq_pass_triton import (  # noqa: E402  (after the skip)
    DqPassConfig,
    KvPassConfig,
    sparse_attention_bwd_dq_pass,
    split_backward_plan,
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


COLUMN_BLOCK_TILES = [KvPassConfig(16, 16, 4, 1, 2), KvPassConfig(16, 16, 4, 1, 3), KvPassConfig(32, 32, 4, 2, 2)]
"""kv-pass programs of 2 and 3 blocks of 16 columns and 2 of 32 (16 or 32 slots per step)."""
COLUMN_BLOCK_CASES = [(10, 3, 80, 30, 37), (6, 5, 48, 20, 24), (7, 2, 16, 9, 11)]
"""(T, H, D, N, Kt): D = 80 and 48 are no multiple of 32 or 64 columns (the last program's last block partly
or wholly past D; 48 columns fit D = 48 exactly), D = 16 is one program whose later blocks are all past D."""


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


@pytest.mark.parametrize("kv_cfg", COLUMN_BLOCK_TILES, ids=lambda c: "{}x{}x{}x{}x{}".format(*astuple(c)))
@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
@pytest.mark.parametrize("case", COLUMN_BLOCK_CASES, ids=lambda c: "T{}-H{}-D{}-N{}-Kt{}".format(*c))
def test_kv_pass_column_blocks_match_torch_fp32(case, topk, kv_cfg, seed):
    """One kv-pass program over several column blocks: every gradient against the torch reference (-1 slots,
    a row with no valid key, topk_length shorter and longer than Kt), and the kv gradient against the
    one-block pass's on the same scratch (both are fp32 sums of the same products, in another order)."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, *case, topk=topk)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    msg = f"seed={seed} case={case} topk={topk} kv={kv_cfg}"
    got = sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_, kv_config=kv_cfg,
                                       dq_config=DqPassConfig(16, 16, 16, 4, 1))
    _check(got, torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_), msg, 1e-4)
    plan = split_backward_plan(dout, q, kv, idx, sink, scale, out, lse, tl_)
    plan.preprocess()
    one_block = KvPassConfig(kv_cfg.block_k, kv_cfg.block_d, kv_cfg.num_warps, kv_cfg.num_stages)
    for t0 in plan.starts():
        plan.scores(t0)
        sums = []
        for cfg in (one_block, kv_cfg):
            plan.base.dkv.zero_()
            plan.kv_pinned = cfg
            plan.kv_gradients(t0)
            sums.append(plan.base.dkv.clone())
        err = rel_fro(sums[1], sums[0])
        assert err < 1e-5, f"{msg} t0={t0}: column blocks against one block, rel err {err:.2e}"


@pytest.mark.parametrize("topk", [False, True], ids=["all-slots", "topk_length"])
def test_atomics_alone_adds_one_per_valid_slot(topk, seed):
    """The benchmark's atomics-alone kernel (``bench/sweep_sparse_attention_dq_pass.py``) adds 1 to every
    column of a kv row per valid slot choosing it (-1 slots, slots past topk_length and rows >= N add
    nothing): the reference counts them with ``index_add_``."""
    from bench.sweep_sparse_attention_dq_pass import atomics_alone

    q, kv, idx, sink, scale, tl_ = make_case(seed, 9, 3, 160, 25, 70, topk=topk)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    idx[3, 5] = kv.shape[0]  # past the last row (after the reference forward, which refuses it): no atomic
    plan = split_backward_plan(torch.zeros_like(q), q, kv, idx, sink, scale, out, lse, tl_)
    got = torch.zeros(kv.shape[0], q.shape[2])
    for t0 in plan.starts():
        atomics_alone(plan, t0, got)
    lengths = torch.full((idx.shape[0],), idx.shape[1]) if tl_ is None else tl_.clamp(0, idx.shape[1])
    counted = (idx >= 0) & (idx < kv.shape[0]) & (torch.arange(idx.shape[1])[None, :] < lengths[:, None])
    ref = torch.zeros(kv.shape[0]).index_add_(0, idx[counted].long(), torch.ones(int(counted.sum())))
    assert torch.equal(got, ref[:, None].expand_as(got)), f"seed={seed} topk={topk}"


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
    reaches the pass (a kv tile of 4 integers with one column block, of 5 with its own), and one that is not
    a power of two (or no column block) is refused naming where it came from."""
    q, kv, idx, sink, scale, tl_ = make_case(seed, 6, 3, 16, 10, 9, topk=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl_)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl_)
    cases = [("triton", KernelOptions(), True), ("triton", KernelOptions(triton_bwd_dq_pass=False), False),
             ("triton-deterministic", KernelOptions(), False),
             ("triton", KernelOptions(triton_kv_pass_config=(16, 16, 4, 1), triton_dq_pass_config=(16, 16, 16, 4, 1)),
              True),
             ("triton", KernelOptions(triton_kv_pass_config="16,16,4,1,2"), True)]
    for name, options, dq_pass in cases:
        kernel_options.reset_backends_ran()
        got = resolve_backend(name, q.device).backward(dout, q, kv, idx, sink, scale, out, lse, tl_, options=options)
        ran = kernel_options.backends_ran()
        _check(got, ref, f"seed={seed} {name} {options}", 1e-4)
        assert ("sparse_attention.bwd_dq_pass.config" in ran) == dq_pass, f"{name} {options}: {ran}"
        if options.triton_kv_pass_config is not None:
            assert ran["sparse_attention.bwd_kv_pass.config"] == (
                "block_k=16,block_d=16,num_warps=4,num_stages=1,column_blocks=" + str(options.triton_kv_pass_config[4])
            ), ran
    with pytest.raises(ValueError, match=r"^kv_config\.block_k: must be a power of two"):
        sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_, kv_config=KvPassConfig(24, 16, 4, 1))
    with pytest.raises(ValueError, match=r"^kv_config\.column_blocks: must be >= 1"):
        sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, tl_,
                                     kv_config=KvPassConfig(16, 16, 4, 1, 0))
    with pytest.raises(ValueError, match=r"^triton_kv_pass_config\.column_blocks: must be >= 1"):
        KernelOptions(triton_kv_pass_config="16,16,4,1,0")
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
