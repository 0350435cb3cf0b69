"""The Triton kernels as ``torch.library`` custom ops (dsv4cp/ops/*_library.py), on Triton's CPU interpreter.

Each op passes ``torch.library.opcheck`` (schema, fake shapes, autograd registration, AOT dispatch) on small
random inputs and equals its torch reference, gradients included; the kernel options an op is handed as
typed inputs are the ones its kernels run under.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.ops import attention_probs_library, compress_pool_library, indexer_library, norm_rope_library
from dsv4cp.ops.attention_probs import head_summed_probs_torch, logsumexp_over_torch
from dsv4cp.ops.compress_pool import compress_pool_torch
from dsv4cp.ops.indexer import SCORES_OPTION_NAMES, TOPK_OPTION_NAMES, indexer_scores, indexer_topk
from dsv4cp.ops.norm_rope import apply_rope, rms_norm

TOPK_DEFAULTS = DEFAULT_OPTIONS.op_values(TOPK_OPTION_NAMES)
SCORES_DEFAULTS = DEFAULT_OPTIONS.op_values(SCORES_OPTION_NAMES)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor, name: str, rtol: float = 1e-5) -> None:
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= rtol * scale, name


def _rope_inputs(seed: int, rows: int = 5, heads: int = 3, d: int = 32):
    g = _gen(seed)
    x = torch.randn(rows, heads, d, generator=g)
    positions = torch.randint(0, 500, (rows,), generator=g)
    freqs = torch.rand(8, generator=g, dtype=torch.float64)
    return x, positions, freqs


def test_norm_rope_ops_pass_opcheck_and_match_the_reference(seed):
    x, positions, freqs = _rope_inputs(seed)
    for config in ([], [2, 4]):  # the default launch rule, and a pinned one (two head blocks of 2)
        torch.library.opcheck(norm_rope_library.head_norm_rope_fwd, (x.requires_grad_(), positions, freqs, 1e-6,
                                                                      config))
        torch.library.opcheck(norm_rope_library.rope_tail, (x, positions, freqs, True, config))
    upstream = torch.randn(x.shape, generator=_gen(seed + 1))
    for name, op, reference in (
        ("head_norm_rope", lambda t: norm_rope_library.head_norm_rope_fwd(t, positions, freqs, 1e-6, [2, 4])[0],
         lambda t: apply_rope(rms_norm(t, 1e-6), positions, freqs)),
        ("rope_tail", lambda t: norm_rope_library.rope_tail(t, positions, freqs, True, [2, 4]),
         lambda t: apply_rope(t, positions, freqs, inverse=True)),
    ):
        got_x, want_x = x.detach().clone().requires_grad_(), x.detach().double().requires_grad_()
        got, want = op(got_x), reference(want_x)
        (got * upstream).sum().backward()
        (want * upstream.double()).sum().backward()
        _close(got, want, name)
        _close(got_x.grad, want_x.grad, f"{name} dx")


def _pool_inputs(seed: int, groups: int = 4, r: int = 4, dc: int = 16):
    """An overlapping layout (S = 2r): group j pools rows [jr, (j+1)r) into the B half and group j-1's rows
    into the A half; one invalid group and a few absent slots."""
    g = _gen(seed)
    rows = groups * r
    values = torch.randn(rows, 2 * dc, generator=g)
    gates = torch.randn(rows, 2 * dc, generator=g)
    ape = torch.randn(r, 2 * dc, generator=g)
    own = torch.arange(groups)[:, None] * r + torch.arange(r)[None, :]
    prev = torch.where(torch.arange(groups)[:, None] > 0, own - r, -1)
    group_rows = torch.cat((prev, own), dim=1)
    group_rows[1, 5] = -1
    group_valid = torch.tensor([True, True, False, True][:groups])
    return values, gates, ape, group_rows, group_valid


def test_compress_pool_op_passes_opcheck_and_matches_the_reference(seed):
    values, gates, ape, group_rows, group_valid = _pool_inputs(seed)
    leaves = [t.requires_grad_() for t in (values, gates, ape)]
    torch.library.opcheck(compress_pool_library.compress_pool_fwd, (*leaves, group_rows, group_valid))
    upstream = torch.randn(group_rows.shape[0], values.shape[1] // 2, generator=_gen(seed + 1))
    got_in = [t.detach().clone().requires_grad_() for t in leaves]
    want_in = [t.detach().double().requires_grad_() for t in leaves]
    got = compress_pool_library.compress_pool_fwd(*got_in, group_rows, group_valid)[0]
    want = compress_pool_torch(*want_in, group_rows, group_valid)
    (got * upstream).sum().backward()
    (want * upstream.double()).sum().backward()
    _close(got, want, "pooled")
    for name, a, b in zip(("dvalues", "dgates", "dape"), got_in, want_in):
        _close(a.grad, b.grad, name)


def _indexer_inputs(seed: int, t: int = 6, hi: int = 4, di: int = 16, g: int = 10, k: int = 5):
    gen = _gen(seed)
    q = torch.randn(t, hi, di, generator=gen)
    w = torch.randn(t, hi, generator=gen)
    keys = torch.randn(g, di, generator=gen)
    idx = torch.randint(-1, g, (t, k), generator=gen)
    return q, w, keys, idx


def test_indexer_scores_op_passes_opcheck_and_matches_the_reference(seed):
    q, w, keys, idx = _indexer_inputs(seed)
    leaves = [t.requires_grad_() for t in (q, w, keys)]
    torch.library.opcheck(indexer_library.indexer_scores_fwd, (*leaves, idx, *SCORES_DEFAULTS))
    upstream = torch.randn(idx.shape, generator=_gen(seed + 1)) * (idx >= 0)  # empty slots: no gradient
    got_in = [t.detach().clone().requires_grad_() for t in leaves]
    want_in = [t.detach().double().requires_grad_() for t in leaves]
    got = indexer_library.indexer_scores_fwd(*got_in, idx, *SCORES_DEFAULTS)
    want = indexer_scores(*want_in, idx)  # CPU tensors: the torch reference
    (got * upstream).sum().backward()
    (want * upstream.double()).sum().backward()
    _close(torch.where(idx >= 0, got, 0), torch.where(idx >= 0, want, 0), "scores")
    for name, a, b in zip(("dq", "dw", "dkeys"), got_in, want_in):
        _close(a.grad, b.grad, name)


def _visibility(seed: int, t: int = 6, g: int = 10):
    gen = _gen(seed)
    key_doc = torch.randint(-1, 2, (g,), generator=gen)
    key_j = torch.randint(0, 6, (g,), generator=gen)
    query_doc = torch.randint(-1, 2, (t,), generator=gen)
    query_limit = torch.randint(0, 7, (t,), generator=gen)
    return query_doc, query_limit, key_doc, key_j


def test_indexer_topk_op_passes_opcheck_and_matches_the_reference(seed):
    q, w, keys, _ = _indexer_inputs(seed)
    visibility = _visibility(seed + 2)
    torch.library.opcheck(indexer_library.indexer_topk, (q, w, keys, *visibility, 3, None, *TOPK_DEFAULTS))
    query_doc, query_limit, key_doc, key_j = visibility

    def visible(rows: slice) -> torch.Tensor:
        return ((key_doc[None, :] == query_doc[rows, None]) & (query_doc[rows, None] >= 0)
                & (key_j[None, :] < query_limit[rows, None]))

    want = indexer_topk(q.double(), w.double(), keys.double(), visible, 3)  # the torch reference
    assert int((want >= 0).sum()) > 0 and int((want < 0).sum()) > 0  # selections, and rows seeing fewer keys
    assert torch.equal(indexer_library.indexer_topk(q, w, keys, *visibility, 3, None, *TOPK_DEFAULTS), want)


def test_attention_probs_ops_pass_opcheck_and_match_the_reference(seed):
    gen = _gen(seed)
    q, keys = torch.randn(6, 3, 16, generator=gen), torch.randn(9, 16, generator=gen)
    idx = torch.randint(-1, 9, (6, 5), generator=gen)
    idx[2] = -1  # a query with no key: lse -inf, probabilities 0
    denominator = torch.randn(6, 3, generator=gen) + 3.0
    torch.library.opcheck(attention_probs_library.logsumexp_over, (q, keys, idx, 0.25, "whole_d", [], []))
    torch.library.opcheck(attention_probs_library.head_summed_probs,
                          (q, keys, idx, 0.25, denominator, False, "whole_d", [], []))
    want_lse = logsumexp_over_torch(q.double(), keys.double(), idx, 0.25)
    want = head_summed_probs_torch(q.double(), keys.double(), idx, 0.25, denominator.double())
    for kernel in ("whole_d", "d_chunks"):
        got_lse = attention_probs_library.logsumexp_over(q, keys, idx, 0.25, kernel, [], [])
        assert torch.equal(got_lse.isinf(), want_lse.isinf())
        _close(got_lse.masked_fill(got_lse.isinf(), 0), want_lse.masked_fill(want_lse.isinf(), 0), f"lse {kernel}")
        for slots_on_m in (False, True):
            got = attention_probs_library.head_summed_probs(q, keys, idx, 0.25, denominator, slots_on_m, kernel,
                                                            [], [])
            _close(got, want, f"probs {kernel} slots_on_m={slots_on_m}")


@pytest.mark.parametrize("options, path", [({}, "triton/chunked/torch/packed"),
                                           ({"topk_impl": "stream"}, "triton/stream")])
def test_indexer_topk_op_runs_the_path_its_options_name(options, path, seed):
    q, w, keys, _ = _indexer_inputs(seed)
    kernel_options.reset_backends_ran()
    values = KernelOptions(**options).op_values(TOPK_OPTION_NAMES)
    indexer_library.indexer_topk(q, w, keys, *_visibility(seed + 2), 3, None, *values)
    assert kernel_options.backends_ran()["indexer_topk"] == path
