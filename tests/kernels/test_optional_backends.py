"""The optional library backends "flashmla" (forward) and "cudnn" (backward) against the torch oracle.

CPU: the libraries are faked. ``sys.modules`` gets a ``flash_mla`` / ``cudnn`` module object whose
function implements the LIBRARY's contract in plain torch (tests/ref.py of FlashMLA; the SM90 DSA backward
of cuDNN frontend), asserting the shapes, dtypes and layouts the real kernels require (head counts
64/128 or multiples of 64, slot counts multiples of 128 / 64, bf16, int32, contiguity, +inf lse for a
query with no key, no ``-1`` inside ``topk_length`` for cuDNN). The adapters' padding, conversions and
un-padding are then checked against the oracle on random inputs with H = 3, 64 and 130, Kt = 70, 128
and 200, empty (-1) slots, duplicated indices, a row with no valid key and topk_length (0 and > Kt).

FlashMLA's two packagings: the ``sgl-flash-mla`` wheel's function takes ``use_legacy`` (its SM90 kernels
need ``use_legacy=True``), an upstream build's may not; both fakes are exercised on a faked SM90 and SM100.

"auto" per direction: fake backends (availability switched per test) check the preference order of each
direction, the CPU rule (always "torch"), deterministic mode (no cuDNN backward) and the per-device cache.

GPU (marked ``gpu``; each runs only where its real package imports): the real adapter against the
oracle at T = 1024, H = 64, D = 512, Kt = 640 in bf16 (relative Frobenius error < 1e-2); the FlashMLA test
also checks, through a spy, that the wheel gets ``use_legacy=True`` on SM90.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import subprocess
import sys
import types

import pytest
import torch

from dsv4cp.kernels import cudnn_dsa, flashmla
from dsv4cp.ops.sparse_attention_torch import sparse_attention_backward as torch_backward
from dsv4cp.ops.sparse_attention_torch import sparse_attention_forward as torch_forward

sa = importlib.import_module("dsv4cp.ops.sparse_attention")  # the module (dsv4cp.ops exports the function)
HAS_CUDA = torch.cuda.is_available()
D = 512


# ------------------------------------------------------------------------------------------ helpers
def make_case(seed, t, h, n, kt, *, dtype=torch.bfloat16, topk=False, device="cpu", d=D):
    """Random inputs (fp32 draws cast to ``dtype``); row 1 has no valid key; 20 % empty slots;
    duplicated indices; ``topk_length`` (when asked) spans 0 .. Kt + 3."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    q = q * d**0.5 / q.norm(dim=-1, keepdim=True)  # unit-RMS rows, as in the model
    kv = torch.randn(n, d, generator=g)
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (t, kt), generator=g)
    idx[torch.rand(t, kt, generator=g) < 0.2] = -1
    if kt > 1:
        idx[::2, kt - 1] = idx[::2, 0]
    if t > 1:
        idx[1] = -1
    topk_length = None
    if topk:
        topk_length = torch.randint(0, kt + 4, (t,), generator=g, dtype=torch.int32)
        if t > 2:
            topk_length[2] = 0
    to = {"device": device}
    return (q.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), idx.to(torch.int32).to(**to), sink.to(**to),
            d**-0.5, None if topk_length is None else topk_length.to(**to))


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    assert a64.shape == b64.shape, (a64.shape, b64.shape)
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def check_lse(lse, ref, tol):
    assert lse.dtype == torch.float32
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse.cpu()), empty.cpu()), "the -inf pattern of lse differs"
    assert torch.isfinite(lse[~empty]).all()
    assert rel_fro(lse[~empty], ref[~empty]) < tol


def oracle_forward(q, kv, idx, sink, scale, topk_length):
    """The oracle on fp32 copies of the (already rounded) inputs."""
    return torch_forward(q.float(), kv.float(), idx, sink, scale, topk_length)


# ------------------------------------------------------------------------------------------ fakes
class FakeFlashMLA:
    """``flash_mla.flash_mla_sparse_fwd`` per FlashMLA's tests/ref.py, with the SM90 kernels' checks.

    ``flash_mla_sparse_fwd`` is an upstream build's signature (no ``use_legacy``); ``wheel_sparse_fwd``
    that of the ``sgl-flash-mla`` wheel, which on the SM it is told it runs on (``sm``) refuses SM90 unless
    ``use_legacy=True``, as the real wheel does."""

    def __init__(self, sm: int = 9):
        self.calls: list[dict] = []
        self.sm = sm

    def wheel_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                         use_legacy=False):
        if self.sm == 9 and not use_legacy:
            raise RuntimeError("only supported on SM100f")
        self.calls.append({"use_legacy": use_legacy})
        return self.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                             indexer_topk=0):
        t, h, d = q.shape
        n = kv.shape[0]
        assert q.dtype == kv.dtype == torch.bfloat16
        assert h in (64, 128), f"h_q = {h}"
        assert d in (512, 576) and d_v == 512
        assert kv.dim() == 3 and kv.shape[1:] == (1, d)
        assert indices.dim() == 3 and indices.shape[:2] == (t, 1) and indices.dtype == torch.int32
        kl = indices.shape[2]
        assert kl % 128 == 0 and kl >= 128, f"topk = {kl}"
        assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
        if attn_sink is not None:
            assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h,)
        if topk_length is not None:
            assert topk_length.dtype == torch.int32 and topk_length.shape == (t,)
            assert int(topk_length.min()) >= 0 and int(topk_length.max()) <= kl
        self.calls.append({"h": h, "topk": kl, "topk_length": topk_length is not None, "idx": indices[:, 0].clone(),
                           "length": None if topk_length is None else topk_length.clone()})

        idx = indices[:, 0].long()
        valid = (idx >= 0) & (idx < n)
        if topk_length is not None:
            valid &= torch.arange(kl)[None, :] < topk_length[:, None].long()
        keys = kv[:, 0].float()[idx.clamp(0, n - 1)]  # [T, Kl, D]
        logits = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        max_logits = logits.max(dim=-1).values
        lse_out = lse if attn_sink is None else torch.logaddexp(lse, attn_sink[None, :])
        lse_out = lse_out.masked_fill(torch.isneginf(lse_out), float("inf"))  # lonely query: out = 0
        out = torch.einsum("thk,tkd->thd", torch.exp(logits - lse_out[..., None]), keys[..., :d_v])
        return out.to(torch.bfloat16), max_logits, lse.masked_fill(torch.isneginf(lse), float("inf"))


class FakeCudnnDSA:
    """``cudnn.DSA.sparse_attention_backward_wrapper`` emulating the SM90 kernel: zero keys for empty
    slots, ``lse = -inf`` read as 0, sink folded into the lse, ``dkv`` skipping empty slots."""

    def __init__(self):
        self.calls: list[dict] = []

    def sparse_attention_backward_wrapper(self, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None,
                                          topk_length=None, dq=None, dkv=None, block_tile=64, stream=None):
        t, h, d = q.shape
        n = kv.shape[0]
        dv = 512 if d == 576 else d
        assert d in (512, 576)
        assert h % 64 == 0 and h > 1, f"num_heads = {h}"
        assert q.dtype in (torch.bfloat16, torch.float16)
        assert kv.dtype == out.dtype == dout.dtype == q.dtype
        assert kv.dim() == 2 and kv.shape[1] == d
        assert out.shape == dout.shape == (t, h, dv)
        assert lse.dtype == torch.float32 and lse.shape == (t, h)
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h,)
        assert topk_idxs.dtype == torch.int32 and topk_idxs.dim() == 2 and topk_idxs.shape[0] == t
        for x in (q, kv, out, dout, lse, attn_sink, topk_idxs):
            assert x.is_contiguous()
        kl = topk_idxs.shape[1]
        slots = torch.arange(kl)[None, :]
        in_range = torch.ones(t, kl, dtype=torch.bool)
        if topk_length is not None:
            in_range = slots < topk_length[:, None].long()
            assert not ((topk_idxs < 0) & in_range).any(), "the SM90 kernel would read kv row -1"
        valid = in_range & (topk_idxs >= 0)
        self.calls.append({"h": h, "topk": kl, "topk_length": topk_length is not None, "idx": topk_idxs.clone(),
                           "length": None if topk_length is None else topk_length.clone()})

        scale = d**-0.5 if softmax_scale is None else softmax_scale
        qf, of, dof = q.float(), out.float(), dout.float()
        keys = kv.float()[topk_idxs.long().clamp_min(0)] * valid[..., None]  # zero rows where empty
        lse_eff = lse.masked_fill(torch.isneginf(lse), 0.0)
        lse_sink = torch.logaddexp(lse_eff, attn_sink[None, :])
        p = torch.exp(torch.einsum("thd,tkd->thk", qf, keys) * scale - lse_sink[..., None])
        delta = (of * dof).sum(-1)
        dp = torch.einsum("thd,tkd->thk", dof, keys[..., :dv])
        ds = p * (dp - delta[..., None])
        dq_ = torch.einsum("thk,tkd->thd", ds, keys) * scale
        dkeys = torch.einsum("thk,thd->tkd", ds, qf) * scale
        dkeys[..., :dv] += torch.einsum("thk,thd->tkd", p, dof)
        dkv_ = torch.zeros(n, d)
        rows = topk_idxs.long().clamp_min(0)[valid]
        dkv_.index_add_(0, rows, dkeys[valid])
        p_sink = torch.exp(attn_sink[None, :] - torch.logaddexp(lse, attn_sink[None, :]))
        d_sink = -(p_sink * delta).sum(0)
        return {"dq": dq_.to(q.dtype), "dkv": dkv_.to(kv.dtype), "d_sink": d_sink}


@pytest.fixture
def fake_flashmla(monkeypatch):
    fake = FakeFlashMLA()
    module = types.ModuleType("flash_mla")
    module.flash_mla_sparse_fwd = fake.flash_mla_sparse_fwd
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return fake


@pytest.fixture
def fake_cudnn(monkeypatch):
    fake = FakeCudnnDSA()
    module = types.ModuleType("cudnn")
    module.DSA = types.SimpleNamespace(sparse_attention_backward_wrapper=fake.sparse_attention_backward_wrapper)
    monkeypatch.setitem(sys.modules, "cudnn", module)
    return fake


# (T, H, N, Kt, topk_length): H = 3 pads to 64, 130 splits into 128 + 2 (FlashMLA) or pads to 192 (cuDNN);
# Kt = 70 pads to 128 (FlashMLA) / 128 (cuDNN), 200 to 256 / 256, 128 needs none / none.
CASES = [
    pytest.param(9, 3, 50, 70, False, id="h3-kt70"),
    pytest.param(9, 3, 50, 70, True, id="h3-kt70-topk"),
    pytest.param(6, 64, 40, 128, False, id="h64-kt128"),
    pytest.param(5, 130, 60, 200, True, id="h130-kt200-topk"),
]


# ------------------------------------------------------------------------------------------ flashmla (fake)
def valid_in_order(idx: torch.Tensor, topk_length: torch.Tensor | None) -> list[list[int]]:
    """Per row, the valid slots' indices in slot order (the reference of the compaction)."""
    rows = []
    for t, row in enumerate(idx.tolist()):
        end = len(row) if topk_length is None else max(0, min(len(row), int(topk_length[t])))
        rows.append([v for v in row[:end] if v >= 0])
    return rows


def check_compacted(sent: torch.Tensor, length: torch.Tensor, idx: torch.Tensor, topk_length) -> None:
    """``sent [T, Kl]`` holds each row's valid slots first, in order, then ``-1``; ``length`` their count."""
    for t, want in enumerate(valid_in_order(idx.cpu(), None if topk_length is None else topk_length.cpu())):
        assert int(length[t]) == len(want), t
        assert sent[t, : len(want)].tolist() == want, t
        assert (sent[t, len(want):] == -1).all(), t


@pytest.mark.parametrize("kt,slots", [(1, 64), (7, 64), (70, 128), (200, 256), (640, 640)])
def test_compact_slots_moves_valid_slots_first_in_order(kt, slots):
    from dsv4cp.kernels._library import compact_slots

    for topk in (False, True):
        seed = 31 + kt + topk
        print(f"seed {seed}")
        _, _, idx, _, _, tl = make_case(seed, 9, 1, 50, kt, topk=topk, d=16)
        sent, length = compact_slots(idx, tl, slots)
        assert sent.shape == (9, slots) and sent.dtype == torch.int32 and length.dtype == torch.int32
        check_compacted(sent, length, idx, tl)


@pytest.fixture(params=["compact", "as-is"])
def compaction(request):
    """The library adapters with (default) and without slot compaction (their ``compact`` keyword: the
    kernel option ``library_compact_slots``)."""
    return request.param == "compact"


@pytest.mark.parametrize("t,h,n,kt,topk", CASES)
def test_flashmla_forward_matches_oracle(fake_flashmla, compaction, t, h, n, kt, topk):
    q, kv, idx, sink, scale, tl = make_case(1000 + h + kt, t, h, n, kt, topk=topk)
    out, lse = flashmla.sparse_attention_forward(q, kv, idx, sink, scale, tl, compact=compaction)
    ref_out, ref_lse = oracle_forward(q, kv, idx, sink, scale, tl)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (t, h)
    assert out.is_contiguous()
    assert rel_fro(out, ref_out) < 1e-2
    assert out[1].abs().max() == 0  # the row with no valid key
    check_lse(lse, ref_lse, 1e-5)
    expected = [{"h": hp, "topk": flashmla.padded_slots(kt), "topk_length": topk or compaction}
                for _, _, hp in flashmla.head_groups(h)]
    assert [{k: v for k, v in call.items() if k not in ("idx", "length")} for call in fake_flashmla.calls] == expected
    if compaction:
        for call in fake_flashmla.calls:
            check_compacted(call["idx"], call["length"], idx, tl)


def test_flashmla_head_groups_and_slots():
    assert flashmla.head_groups(3) == [(0, 3, 64)]
    assert flashmla.head_groups(64) == [(0, 64, 64)]
    assert flashmla.head_groups(65) == [(0, 65, 128)]
    assert flashmla.head_groups(128) == [(0, 128, 128)]
    assert flashmla.head_groups(130) == [(0, 128, 128), (128, 130, 64)]
    assert [flashmla.padded_slots(k) for k in (1, 70, 128, 129, 640, 1152)] == [128, 128, 128, 256, 640, 1152]


def test_flashmla_fp32_inputs_are_computed_in_bf16(fake_flashmla):
    q, kv, idx, sink, scale, tl = make_case(7, 8, 5, 30, 70, dtype=torch.float32, topk=True)
    out, lse = flashmla.sparse_attention_forward(q, kv, idx, sink, scale, tl)
    ref_out, ref_lse = torch_forward(q, kv, idx, sink, scale, tl)
    assert out.dtype == torch.float32
    assert rel_fro(out, ref_out) < 2e-2
    check_lse(lse, ref_lse, 1e-2)


def test_flashmla_no_slots_or_queries(fake_flashmla):
    q, kv, idx, sink, scale, _ = make_case(8, 4, 3, 20, 5)
    out, lse = flashmla.sparse_attention_forward(q, kv, idx[:, :0], sink, scale)
    assert out.abs().max() == 0 and torch.isneginf(lse).all()
    out, lse = flashmla.sparse_attention_forward(q[:0], kv, idx[:0], sink, scale)
    assert out.shape == (0, 3, D) and lse.shape == (0, 3)
    assert fake_flashmla.calls == []


# ------------------------------------------------------------------------------------------ cudnn (fake)
@pytest.mark.parametrize("t,h,n,kt,topk", CASES)
def test_cudnn_backward_matches_oracle(fake_cudnn, compaction, t, h, n, kt, topk):
    q, kv, idx, sink, scale, tl = make_case(2000 + h + kt, t, h, n, kt, topk=topk)
    ref_out, lse = oracle_forward(q, kv, idx, sink, scale, tl)
    out = ref_out.to(q.dtype)  # what a bf16 forward hands the backward
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(t + h)).to(q.dtype)
    dq, dkv, dsink = cudnn_dsa.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, tl,
                                                         compact=compaction)
    rq, rkv, rsink = torch_backward(dout.float(), q.float(), kv.float(), idx, sink, scale, out.float(), lse, tl)
    assert (dq.shape, dq.dtype, dkv.shape, dkv.dtype) == (q.shape, q.dtype, kv.shape, kv.dtype)
    assert dsink.shape == sink.shape and dsink.dtype == torch.float32
    assert dq.is_contiguous()
    assert rel_fro(dq, rq) < 1e-2
    assert rel_fro(dkv, rkv) < 1e-2
    assert rel_fro(dsink, rsink) < 1e-4
    assert dq[1].abs().max() == 0  # no valid key: no gradient

    (call,) = fake_cudnn.calls
    assert call["h"] == cudnn_dsa.padded_heads(h) and call["topk"] == cudnn_dsa.padded_slots(kt)
    assert call["topk_length"] == compaction
    sent = call["idx"]
    if compaction:
        check_compacted(sent, call["length"], idx, tl)
        return
    assert (sent[:, kt:] == -1).all()
    expect = idx.clone()
    if tl is not None:
        expect[torch.arange(kt)[None, :] >= tl[:, None]] = -1
    assert torch.equal(sent[:, :kt], expect)


def test_cudnn_padding_rules():
    assert [cudnn_dsa.padded_heads(h) for h in (1, 3, 64, 65, 128, 130)] == [64, 64, 64, 128, 128, 192]
    assert [cudnn_dsa.padded_slots(k) for k in (1, 64, 70, 640, 1152)] == [64, 64, 128, 640, 1152]


def test_cudnn_fp32_inputs_are_computed_in_bf16(fake_cudnn):
    q, kv, idx, sink, scale, tl = make_case(9, 8, 5, 30, 70, dtype=torch.float32, topk=True)
    out, lse = torch_forward(q, kv, idx, sink, scale, tl)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    dq, dkv, dsink = cudnn_dsa.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, tl)
    rq, rkv, rsink = torch_backward(dout, q, kv, idx, sink, scale, out, lse, tl)
    assert dq.dtype == dkv.dtype == dsink.dtype == torch.float32
    assert rel_fro(dq, rq) < 3e-2 and rel_fro(dkv, rkv) < 3e-2 and rel_fro(dsink, rsink) < 3e-2


def test_cudnn_result_read_by_position(monkeypatch, fake_cudnn):
    """A tuple-like result (dq, dkv, d_sink) works as well as the mapping."""
    module = sys.modules["cudnn"]

    def as_tuple(*args, **kwargs):
        r = fake_cudnn.sparse_attention_backward_wrapper(*args, **kwargs)
        return (r["dq"], r["dkv"], r["d_sink"])

    monkeypatch.setattr(module, "DSA", types.SimpleNamespace(sparse_attention_backward_wrapper=as_tuple))
    q, kv, idx, sink, scale, tl = make_case(10, 4, 64, 20, 64)
    out, lse = oracle_forward(q, kv, idx, sink, scale, tl)
    out = out.to(q.dtype)
    dq, dkv, dsink = cudnn_dsa.sparse_attention_backward(out, q, kv, idx, sink, scale, out, lse)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dsink.shape == sink.shape


# ------------------------------------------------------------------------------------------ the pair, end to end
def test_pair_through_the_op_and_autograd(monkeypatch, fake_flashmla, fake_cudnn):
    """``sparse_attention(..., backend="flashmla+cudnn")`` with both marked available: the autograd
    function runs the fake FlashMLA forward and the fake cuDNN backward; gradients match "torch"."""
    for name in ("flashmla", "cudnn"):
        monkeypatch.setitem(sa._BACKENDS, name, dataclasses.replace(sa._BACKENDS[name], available=lambda d: True))
    q, kv, idx, sink, scale, tl = make_case(11, 7, 3, 40, 70, topk=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    results = {}
    for backend in ("flashmla+cudnn", "torch"):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, kv, sink)]
        out, lse = sa.sparse_attention(leaves[0], leaves[1], idx, leaves[2], scale, tl, backend=backend)
        out.backward(dout)
        results[backend] = (out, lse, *(x.grad for x in leaves))
    got, ref = results["flashmla+cudnn"], results["torch"]
    assert rel_fro(got[0], ref[0]) < 1e-2
    check_lse(got[1], ref[1], 1e-5)
    for a, b in zip(got[2:], ref[2:]):
        assert rel_fro(a, b) < 2e-2
    assert len(fake_flashmla.calls) == 1 and len(fake_cudnn.calls) == 1


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("module", [flashmla, cudnn_dsa], ids=["flashmla", "cudnn"])
@pytest.mark.parametrize("d", [64, 576])
def test_unsupported_head_dim(module, d, fake_flashmla, fake_cudnn):
    q, kv, idx, sink, scale, _ = make_case(12, 4, 2, 10, 8, d=d)
    with pytest.raises(ValueError, match=rf"^q: head dim D = {d} .*'{module.NAME}'") as info:
        if module is flashmla:
            flashmla.sparse_attention_forward(q, kv, idx, sink, scale)
        else:
            cudnn_dsa.sparse_attention_backward(q, q, kv, idx, sink, scale, q, sink.expand(4, 2), None)
    if d == 576:
        assert "whole kv row" in str(info.value)


@pytest.mark.parametrize("module", [flashmla, cudnn_dsa], ids=["flashmla", "cudnn"])
def test_fp64_is_rejected(module, fake_flashmla, fake_cudnn):
    q, kv, idx, sink, scale, _ = make_case(13, 4, 2, 10, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^q: dtype torch.float64"):
        if module is flashmla:
            flashmla.sparse_attention_forward(q, kv, idx, sink, scale)
        else:
            cudnn_dsa.sparse_attention_backward(q, q, kv, idx, sink, scale, q, sink.expand(4, 2).float(), None)


@pytest.fixture
def deterministic():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_cudnn_refuses_deterministic_mode(fake_cudnn, deterministic):
    q, kv, idx, sink, scale, tl = make_case(14, 4, 64, 20, 64)
    out, lse = oracle_forward(q, kv, idx, sink, scale, tl)
    out = out.to(q.dtype)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="not deterministic"):
        cudnn_dsa.sparse_attention_backward(out, q, kv, idx, sink, scale, out, lse)
    assert fake_cudnn.calls == []
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="not deterministic"):
        cudnn_dsa.sparse_attention_backward(out, q, kv, idx, sink, scale, out, lse)
    assert len(fake_cudnn.calls) == 1


def test_flashmla_allowed_in_deterministic_mode(fake_flashmla, deterministic):
    """FlashMLA's forward has no atomics: deterministic mode does not stop it."""
    torch.use_deterministic_algorithms(True)
    q, kv, idx, sink, scale, _ = make_case(15, 4, 64, 20, 64)
    flashmla.sparse_attention_forward(q, kv, idx, sink, scale)
    assert len(fake_flashmla.calls) == 1


@pytest.mark.parametrize("module,import_name,needle", [
    (flashmla, "flash_mla", "FlashMLA"), (cudnn_dsa, "cudnn", "nvidia-cudnn-frontend")], ids=["flashmla", "cudnn"])
def test_missing_package(monkeypatch, module, import_name, needle):
    monkeypatch.setitem(sys.modules, import_name, None)  # "import x" raises ImportError
    assert import_name in module.library_problem()
    assert needle in module.MISSING_HINT
    q, kv, idx, sink, scale, _ = make_case(16, 4, 64, 20, 64)
    with pytest.raises(RuntimeError, match=needle):
        if module is flashmla:
            flashmla.sparse_attention_forward(q, kv, idx, sink, scale)
        else:
            cudnn_dsa.sparse_attention_backward(q, q, kv, idx, sink, scale, q, sink.expand(4, 64).float(), None)


def test_cudnn_without_dsa(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))  # an old frontend: no DSA
    assert "DSA" in cudnn_dsa.library_problem()


def test_library_present(fake_flashmla, fake_cudnn):
    assert flashmla.library_problem() is None and cudnn_dsa.library_problem() is None


def test_not_available_on_cpu(fake_flashmla, fake_cudnn):
    cpu = torch.device("cpu")
    assert not flashmla.available(cpu) and not cudnn_dsa.available(cpu)
    assert "not a CUDA device" in flashmla.unavailable_reason(cpu)
    assert "not a CUDA device" in cudnn_dsa.unavailable_reason(cpu)


def test_registered_one_sided():
    backends = sa._BACKENDS
    assert backends["flashmla"].backward is None and backends["flashmla"].forward is not None
    assert backends["cudnn"].forward is None and backends["cudnn"].backward is not None
    assert sa.AUTO_FORWARD_ORDER == ["flashmla", "triton"] and sa.AUTO_BACKWARD_ORDER == ["cudnn", "triton"]
    assert backends["cudnn"].available.missing_hint == cudnn_dsa.MISSING_HINT


# ------------------------------------------------------------------------------------------ flashmla: use_legacy
@pytest.fixture
def fresh_signature_cache():
    flashmla.accepts_use_legacy.cache_clear()
    yield
    flashmla.accepts_use_legacy.cache_clear()


def test_use_legacy_read_from_the_signature(fresh_signature_cache):
    fake = FakeFlashMLA()

    class Unreadable:  # a C function whose signature inspect cannot read
        __signature__ = "not a signature"

        def __call__(self, *args, **kwargs):
            raise AssertionError("never called")

    assert flashmla.accepts_use_legacy(fake.wheel_sparse_fwd)
    assert not flashmla.accepts_use_legacy(fake.flash_mla_sparse_fwd)
    assert not flashmla.accepts_use_legacy(Unreadable())
    assert flashmla.accepts_use_legacy(functools.partial(fake.wheel_sparse_fwd))


@pytest.mark.parametrize("packaging", ["wheel", "upstream"])
@pytest.mark.parametrize("sm", [9, 10])
def test_use_legacy_passed_on_sm90_when_accepted(monkeypatch, fresh_signature_cache, packaging, sm):
    """The adapter on a faked SM90 / SM100 with either packaging: the wheel gets ``use_legacy=True`` on SM90
    only (without it the fake refuses SM90, like the real wheel); an upstream build never sees the keyword
    (it would raise TypeError). The signature is read once, not per call."""
    fake = FakeFlashMLA(sm=sm)
    module = types.ModuleType("flash_mla")
    module.flash_mla_sparse_fwd = fake.wheel_sparse_fwd if packaging == "wheel" else fake.flash_mla_sparse_fwd
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    monkeypatch.setattr(flashmla, "compute_capability_major", lambda device: sm)
    reads = []
    real_signature = flashmla.inspect.signature
    monkeypatch.setattr(flashmla.inspect, "signature", lambda f: reads.append(f) or real_signature(f))

    q, kv, idx, sink, scale, tl = make_case(17 + sm, 9, 130, 50, 70, topk=True)  # two head groups: two calls
    for _ in range(2):
        out, _lse = flashmla.sparse_attention_forward(q, kv, idx, sink, scale, tl)
    ref_out, _ = oracle_forward(q, kv, idx, sink, scale, tl)
    assert rel_fro(out, ref_out) < 1e-2
    legacy = [call["use_legacy"] for call in fake.calls if "use_legacy" in call]
    if packaging == "wheel":
        assert legacy == [sm == 9] * 4
    else:
        assert legacy == [] and len(fake.calls) == 4
    assert len(reads) == (1 if sm == 9 else 0)  # read once, and only where it matters


def test_no_use_legacy_off_cuda(fresh_signature_cache):
    assert flashmla.call_options(FakeFlashMLA().wheel_sparse_fwd, torch.device("cpu")) == {}


# ------------------------------------------------------------------------------------------ "auto" per direction
@pytest.fixture
def fake_registry(monkeypatch):
    """The real registry with "triton" (and "triton-deterministic"), "flashmla" and "cudnn" replaced by copies
    whose availability is ``usable[name]`` (all True to start; a test switches them), and an empty "auto"
    cache."""
    usable = {"triton": True, "flashmla": True, "cudnn": True}
    backends = dict(sa._BACKENDS)
    for name in (*usable, "triton-deterministic"):
        switch = name.partition("-")[0]
        backends[name] = dataclasses.replace(backends[name], available=lambda d, switch=switch: usable[switch])
    monkeypatch.setattr(sa, "_BACKENDS", backends)
    monkeypatch.setattr(sa, "_AUTO_RESOLVED", {})
    return usable


CUDA = torch.device("cuda")  # never touched: the fake availability answers without asking CUDA


@pytest.mark.parametrize("missing,expected", [
    ((), "flashmla+cudnn"),
    (("flashmla",), "triton+cudnn"),
    (("cudnn",), "flashmla+triton"),
    (("flashmla", "cudnn"), "triton"),
    (("triton", "cudnn"), "flashmla+torch"),
    (("triton", "flashmla", "cudnn"), "torch"),
])
def test_auto_takes_the_fastest_available_per_direction(fake_registry, missing, expected):
    for name in missing:
        fake_registry[name] = False
    chosen = sa.resolve_backend("auto", CUDA)
    assert chosen.name == expected
    forward, backward = chosen.direction_names
    assert chosen.forward is sa._BACKENDS[forward].forward
    assert chosen.backward is sa._BACKENDS[backward].backward


@pytest.mark.parametrize("head_dim,expected", [(512, "flashmla+cudnn"), (None, "flashmla+cudnn"), (32, "triton")])
def test_auto_passes_over_libraries_without_the_head_dim(fake_registry, head_dim, expected):
    """FlashMLA and cuDNN's DSA run D = 512 only: "auto" on another head dim takes Triton for both
    directions instead of failing in the library's input check (seen on an H200 with a tiny layer)."""
    assert sa._BACKENDS["flashmla"].head_dims == sa._BACKENDS["cudnn"].head_dims == (512,)
    assert sa.resolve_backend("auto", CUDA, head_dim=head_dim).name == expected


@pytest.mark.parametrize("name", ["flashmla+cudnn", "flashmla+triton", "triton+cudnn"])
def test_an_explicit_library_that_cannot_run_the_head_dim_is_refused(fake_registry, name):
    """Named explicitly, a D = 512-only library fails at resolution (before the layer's collectives)."""
    assert sa.resolve_backend(name, CUDA, head_dim=512).name == name
    with pytest.raises(ValueError, match="head dim"):
        sa.resolve_backend(name, CUDA, head_dim=64)


def test_auto_is_torch_off_cuda(fake_registry):
    assert sa.resolve_backend("auto", torch.device("cpu")).name == "torch"


def test_auto_backward_avoids_cudnn_in_deterministic_mode(fake_registry, deterministic):
    assert sa.resolve_backend("auto", CUDA).name == "flashmla+cudnn"
    torch.use_deterministic_algorithms(True)
    assert sa.resolve_backend("auto", CUDA).name == "flashmla+triton"


def test_auto_is_resolved_once_per_device(fake_registry, monkeypatch):
    asked = []
    flash = sa._BACKENDS["flashmla"]
    sa._BACKENDS["flashmla"] = dataclasses.replace(flash, available=lambda d: asked.append(d) or True)
    first = sa.resolve_backend("auto", CUDA)
    assert sa.resolve_backend("auto", CUDA) is first and len(asked) == 1
    fake_registry["cudnn"] = False  # a later change is not seen until the registry changes
    assert sa.resolve_backend("auto", CUDA).name == "flashmla+cudnn"
    sa.register_backend(sa._BACKENDS["cudnn"])  # registering clears the cache
    assert sa.resolve_backend("auto", CUDA).name == "flashmla+triton"


@pytest.mark.parametrize("name,expected", [
    ("triton", "triton"), ("torch", "torch"), ("triton+cudnn", "triton+cudnn"), ("torch+torch", "torch"),
    ("flashmla+triton-deterministic", "flashmla+triton-deterministic"),
])
def test_explicit_names_win_over_auto(fake_registry, name, expected):
    assert sa.resolve_backend(name, CUDA).name == expected


def test_direction_names():
    make = functools.partial(sa.SparseAttentionBackend, forward=None, backward=None, available=lambda d: True)
    assert make("flashmla+cudnn").direction_names == ("flashmla", "cudnn")
    assert make("triton").direction_names == ("triton", "triton")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine where the backend is unavailable")
@pytest.mark.parametrize("name,needle", [("cudnn", "nvidia-cudnn-frontend"), ("flashmla", "flash_mla")])
def test_explicit_request_of_missing_backend_names_the_package(name, needle):
    pair = "torch+cudnn" if name == "cudnn" else "flashmla+torch"
    with pytest.raises(ValueError, match=rf"'{name}' is not available") as info:
        sa.resolve_backend(pair, torch.device("cpu"))
    assert needle in str(info.value), str(info.value)


def test_import_never_needs_the_libraries():
    code = ("import sys; sys.modules['cudnn'] = None; sys.modules['flash_mla'] = None\n"
            "from dsv4cp.ops.sparse_attention import backend_names\n"
            "assert {'cudnn', 'flashmla'} <= set(backend_names())\n"
            "assert 'cudnn' not in sys.modules or sys.modules['cudnn'] is None\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------ GPU, real libraries
def _real_problem(module) -> str | None:
    if not HAS_CUDA:
        return "needs CUDA"
    return module.unavailable_reason(torch.device("cuda"))


def _gpu_case(seed, topk=False):
    t, h, kt = 1024, 64, 640
    return make_case(seed, t, h, t + t // 4, kt, topk=topk, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [False, True], ids=["full", "topk_length"])
def test_real_flashmla_matches_oracle(monkeypatch, compaction, topk):
    """The installed FlashMLA (wheel or source build) against the oracle; a spy with the real function's
    signature records the keywords the adapter passes: ``use_legacy=True`` on SM90 when it is accepted."""
    problem = _real_problem(flashmla)
    if problem:
        pytest.skip(problem)
    library = importlib.import_module("flash_mla")
    real = library.flash_mla_sparse_fwd
    seen = []

    @functools.wraps(real)  # keeps the signature visible to inspect (through __wrapped__)
    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_legacy"))
        return real(*args, **kwargs)

    monkeypatch.setattr(library, "flash_mla_sparse_fwd", spy)
    flashmla.accepts_use_legacy.cache_clear()
    q, kv, idx, sink, scale, tl = _gpu_case(21, topk)
    out, lse = flashmla.sparse_attention_forward(q, kv, idx, sink, scale, tl, compact=compaction)
    ref_out, ref_lse = oracle_forward(q, kv, idx, sink, scale, tl)
    assert rel_fro(out, ref_out) < 1e-2
    check_lse(lse, ref_lse, 1e-2)
    on_sm90 = torch.cuda.get_device_capability()[0] == 9
    assert seen == [True if on_sm90 and flashmla.accepts_use_legacy(real) else None]


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [False, True], ids=["full", "topk_length"])
def test_real_cudnn_matches_oracle(compaction, topk):
    problem = _real_problem(cudnn_dsa)
    if problem:
        pytest.skip(problem)
    q, kv, idx, sink, scale, tl = _gpu_case(22, topk)
    ref_out, lse = oracle_forward(q, kv, idx, sink, scale, tl)
    out = ref_out.to(q.dtype)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(q.dtype)
    dq, dkv, dsink = cudnn_dsa.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, tl,
                                                         compact=compaction)
    rq, rkv, rsink = torch_backward(dout.float(), q.float(), kv.float(), idx, sink, scale, out.float(), lse, tl)
    assert rel_fro(dq, rq) < 1e-2
    assert rel_fro(dkv, rkv) < 1e-2
    assert rel_fro(dsink, rsink) < 1e-2
