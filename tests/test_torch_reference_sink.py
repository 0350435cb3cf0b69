"""Rows with no valid key and a ``-inf`` sink: the sparse-attention op outputs 0, lse ``-inf``, and
back-propagates zeros, never NaN (contract of :func:`dsv4cp.ops.sparse_attention.sparse_attention`).

A ``-inf`` sink is a head with the sink switched off; a row without a valid key is a padding row or a
token whose only keys were masked. Together the softmax denominator is empty. The other rows must still
equal the independent fp64 reference, in value and gradient.
"""

from __future__ import annotations

import pytest
import torch

from conftest import seed_of
from dsv4cp.ops.sparse_attention import resolve_backend, sparse_attention
from reference import reference_sparse_attention

T, H, D, N, KT = 10, 4, 32, 24, 12
NO_KEY_ROWS = (1, 4, 9)
OFF_SINK_HEADS = (0, 2)
SCALE = D**-0.5


def _case(seed: int, dtype: torch.dtype, with_topk: bool):
    """Random inputs (never zeros) with rows lacking any valid key and heads whose sink is ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype)
    kv = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    sink = torch.randn(H, generator=g, dtype=torch.float64).to(torch.float32 if dtype != torch.float64 else dtype)
    sink[list(OFF_SINK_HEADS)] = float("-inf")
    idx = torch.randint(0, N, (T, KT), generator=g, dtype=torch.int32)
    idx[torch.rand(T, KT, generator=g) < 0.25] = -1
    topk_length = None
    if with_topk:  # the last no-key row is emptied by its length, not by its slots
        topk_length = torch.randint(1, KT + 1, (T,), generator=g, dtype=torch.int32)
        topk_length[NO_KEY_ROWS[-1]] = 0
        idx[list(NO_KEY_ROWS[:-1])] = -1
    else:
        idx[list(NO_KEY_ROWS)] = -1
    dout = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, kv, idx, sink, topk_length, dout


def _run(backend: str, q, kv, idx, sink, topk_length, dout):
    q, kv, sink = (t.clone().requires_grad_() for t in (q, kv, sink))
    out, lse = sparse_attention(q, kv, idx, sink, SCALE, topk_length, backend=backend)
    out.backward(dout)
    return out.detach(), lse, q.grad, kv.grad, sink.grad


def _reference(q, kv, idx, sink, topk_length, dout):
    q, kv, sink = (t.detach().double().requires_grad_() for t in (q, kv, sink))
    out, lse = reference_sparse_attention(q, kv, idx, sink, SCALE, topk_length)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, kv.grad, sink.grad


def _check_against_reference(got, want, tol: float) -> None:
    out, lse, dq, dkv, dsink = got
    ref_out, ref_lse, ref_dq, ref_dkv, ref_dsink = want
    no_key_mask = (ref_lse == float("-inf")).all(-1)  # NO_KEY_ROWS, and any row whose slots all drew -1
    assert no_key_mask[list(NO_KEY_ROWS)].all()
    no_key, has_key = no_key_mask.nonzero().flatten().tolist(), (~no_key_mask).nonzero().flatten().tolist()
    for name, tensor in (("out", out), ("dq", dq), ("dkv", dkv), ("dsink", dsink)):
        bad_rows = sorted(set(torch.nonzero(~torch.isfinite(tensor))[:, 0].tolist()))
        assert not bad_rows, f"{name}: NaN or inf in rows {bad_rows}"
    assert not torch.isnan(lse).any(), "lse: NaN"
    assert torch.all(out[no_key] == 0), "out: a row with no valid key must be 0"
    assert torch.all(lse[no_key] == float("-inf")), "lse: a row with no valid key must be -inf"
    assert torch.all(dq[no_key] == 0), "dq: a row with no valid key must get a zero gradient"
    for name, a, b in (("out", out, ref_out), ("dq", dq, ref_dq), ("dkv", dkv, ref_dkv), ("dsink", dsink, ref_dsink)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.0e} against the fp64 reference"
    lse_err = float((lse[has_key].double() - ref_lse[has_key]).abs().max())
    assert lse_err < tol * 10, f"lse: error {lse_err:.3e} on rows with keys"


@pytest.mark.parametrize("with_topk", [False, True], ids=["slots", "topk_length"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_torch_backend_empty_row_with_off_sink(dtype, with_topk):
    inputs = _case(seed_of("empty-row-off-sink", str(dtype), with_topk), dtype, with_topk)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    _check_against_reference(_run("torch", *inputs), _reference(*inputs), tol)


@pytest.mark.parametrize("with_topk", [False, True], ids=["slots", "topk_length"])
def test_triton_backend_empty_row_with_off_sink(with_topk):
    """The Triton kernels keep the same contract (on CPU under ``TRITON_INTERPRET=1``)."""
    pytest.importorskip("triton")
    try:
        resolve_backend("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as unavailable:
        pytest.skip(str(unavailable))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = _case(seed_of("empty-row-off-sink-triton", with_topk), torch.float32, with_topk)
    want = _reference(*inputs)
    got = _run("triton", *(t.to(device) if t is not None else None for t in inputs))
    _check_against_reference(tuple(t.cpu() for t in got), want, 2e-5 if device == "cpu" else 5e-3)
