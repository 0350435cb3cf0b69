"""``sparse_attention`` as ``torch.library`` custom ops: their registration passes ``opcheck`` (schema, fake
shapes, autograd), and a compiled function calling the op has no graph break and equals eager."""

from __future__ import annotations

import torch

from dsv4cp.kernel_options import KernelOptions
from dsv4cp.ops import sparse_attention
from dsv4cp.ops.sparse_attention import option_values, options_of
from dsv4cp.ops.sparse_attention_library import sparse_attention_fwd


def _inputs(seed: int, t: int = 12, h: int = 2, d: int = 16, n: int = 20, k: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, n, (t, k), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen, dtype=torch.float64).float().requires_grad_()
    length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32)
    return q, kv, idx, sink, length


def test_custom_op_passes_opcheck(seed):
    q, kv, idx, sink, length = _inputs(seed)
    pinned = KernelOptions(triton_fwd_config=(16, 16, 4, 1), triton_dq_in_dkv=False, library_compact_slots=False)
    for options in (KernelOptions(), pinned):
        values = option_values(options)
        torch.library.opcheck(sparse_attention_fwd, (q, kv, idx, sink, 0.25, length, "torch", *values))
        torch.library.opcheck(sparse_attention_fwd, (q, kv, idx, sink, 0.25, None, "torch", *values))


def test_option_values_round_trip():
    """The custom ops' option arguments give back the options they came from (tiles as lists, [] for auto)."""
    options = KernelOptions(triton_fwd_config=(16, 16, 4, 1), triton_dkv_config=(16, 32, 4, 1),
                            triton_fwd_logits="duplicated", triton_bwd_index_ahead=False)
    values = option_values(options)
    assert values[0] == [16, 16, 4, 1] and values[4] == [] and options_of(values) == options
    assert options_of(option_values(KernelOptions())) == KernelOptions()


def test_compiled_op_has_no_graph_break_and_matches_eager(seed):
    q, kv, idx, sink, length = _inputs(seed)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)

    def loss(q, kv, sink):
        out, lse = sparse_attention(q, kv, idx, sink, 0.25, length, backend="torch")
        return (out * weight).sum() + lse.masked_fill(lse.isinf(), 0).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(q, kv, sink)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(q, kv, sink)
    got_grads = torch.autograd.grad(got, (q, kv, sink))
    want = loss(q, kv, sink)
    want_grads = torch.autograd.grad(want, (q, kv, sink))
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    for name, a, b in zip(("dq", "dkv", "dsink"), got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
