"""The indexer scores' key-gradient reductions (:mod:`dsv4cp.kernels.indexer_scores_triton`): fp32
atomics, and the sorted reductions (per-slot contributions in fp32 or bf16 stored in key-row order, summed
per key row in a fixed order) on CPU through Triton's interpreter: gradients against the torch op, the
bf16 contributions' error bound, bitwise replay, independence from the chunking with exact arithmetic,
the sort's destinations, the chunk plan, the kernel options and deterministic mode. GPU-marked tests
repeat the comparisons at the flash shapes (Hi = 64, Di = 128, K = 512, bf16)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the kernels module below imports it

import torch

from dsv4cp import kernel_options
from dsv4cp.environment import deterministic_algorithms
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import interpreted, set_deterministic, triton_available
from dsv4cp.kernels.indexer_scores_triton import (
    BWD_SCRATCH_BYTES,
    INDEX_BYTES_PER_SLOT,
    REDUCTIONS,
    _sorted_destinations,
    indexer_scores_triton,
    resolve_reduction,
    sorted_chunk_rows,
)
from dsv4cp.ops.indexer import indexer_scores, scores_backward_keywords
from tests.kernels.test_indexer_triton import selection_with_gaps

pytestmark = pytest.mark.skipif(not triton_available("cpu") and not torch.cuda.is_available(),
                                reason="triton cannot run here (needs CUDA or TRITON_INTERPRET=1)")

REDUCE_ENV = kernel_options.OPTIONS["triton_scores_bwd_reduce"].env
SCRATCH_ENV = kernel_options.OPTIONS["triton_scores_bwd_scratch"].env
SORTED = ("sorted", "sorted-bf16")


def bf16_rounding(device: torch.device) -> float:
    """Relative error bound of one fp32 -> bf16 conversion (8 significant bits): 2^-8 rounding to nearest
    (compiled kernels: ``cvt.rn``), 2^-7 under Triton's interpreter, which truncates (seen in 3.9)."""
    return 2.0**-7 if interpreted(device) else 2.0**-8


def scores_case(seed: int, t: int = 13, hi: int = 3, di: int = 32, g: int = 11, kk: int = 19,
                dtype: torch.dtype = torch.float32, exact: bool = False):
    """Random ``q, w, keys, idx, grad`` (never all zeros): about a quarter of the slots empty (-1), one query
    with no slot at all, repeated key rows within queries, few key rows (long segments), ragged sizes.
    ``exact``: small integers (w in halves) whose products and sums are exact in fp32 and whose per-slot
    key gradients are exact in bf16, so any order of summation gives the same bits."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        q = torch.randint(-2, 3, (t, hi, di), generator=gen).float()
        keys = torch.randint(-2, 3, (g, di), generator=gen).float()
        w = torch.randint(1, 3, (t, hi), generator=gen) * 0.5 * signs((t, hi), gen)
        grad = torch.randint(1, 3, (t, kk), generator=gen).float() * signs((t, kk), gen)
    else:
        q = torch.randn(t, hi, di, generator=gen)
        keys = torch.randn(g, di, generator=gen)
        w = torch.randn(t, hi, generator=gen)
        grad = torch.randn(t, kk, generator=gen)
    idx = selection_with_gaps(gen, t, g, kk)
    return q.to(dtype), w.to(dtype), keys.to(dtype), idx, grad


def signs(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random +-1 (fp32): nonzero magnitudes with both signs."""
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1


def grads(fn, q, w, keys, idx, grad, **kw):
    """``(dq, dw, dkeys)`` in fp32 of ``sum(fn(q, w, keys, idx, **kw) * grad)`` over the valid slots."""
    leaves = [x.clone().requires_grad_(True) for x in (q, w, keys)]
    (fn(*leaves, idx, **kw) * grad * (idx >= 0)).sum().backward()
    return tuple(x.grad.float() for x in leaves)


def contribution_magnitudes(q, w, keys, idx, grad) -> torch.Tensor:
    """``[G, Di]`` fp64: per key row and column, the sum over slots of ``|dk|``, the slots' key-gradient
    contributions ``dk[t, j] = sum_h [s > 0] w g q`` (what an fp32 sum's error and the bf16 rounding of
    each contribution are bounded by)."""
    q64, w64, k64, g64 = (x.double() for x in (q, w, keys, grad))
    valid = idx >= 0
    rows = idx.clamp_min(0)
    s = torch.einsum("thd,tkd->thk", q64, k64[rows])
    ds = (s > 0) * w64[:, :, None] * (g64 * valid)[:, None, :]
    dk = torch.einsum("thk,thd->tkd", ds, q64).abs()
    out = torch.zeros(keys.shape, dtype=torch.float64)
    return out.index_add_(0, rows[valid], dk[valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_every_reduction_gives_the_torch_gradients(reduce, dtype, seed):
    """Each reduction against the torch op (fp32 inputs: to fp32 summation error) and, for bf16 inputs,
    against the atomic reduction (the same kernel products; they differ in the order of the sum only)."""
    q, w, keys, idx, grad = scores_case(seed, dtype=dtype)
    got = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce=reduce)
    if dtype == torch.float32:
        ref = grads(indexer_scores, q, w, keys, idx, grad)
        tol = {"rtol": 1e-5, "atol": 1e-5}
    else:
        ref = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce="atomic")
        tol = {"rtol": 1e-5, "atol": 1e-5}
    for name, a, b in zip(("dq", "dw", "dkeys"), got, ref):
        if name == "dkeys" and reduce == "sorted-bf16":
            continue  # bounded by the next test
        assert torch.allclose(a, b, **tol), f"seed={seed} {reduce} {dtype}: {name} off by {(a - b).abs().max()}"
    assert got[2].abs().sum() > 0, f"seed={seed}: a case with key gradients"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_contributions_stay_within_their_rounding_bound(dtype, seed):
    """bf16 contributions: each slot's fp32 key gradient rounds with a relative error of at most u
    (:func:`bf16_rounding`), so the fp32 sums differ from the fp32 contributions' by at most u (plus fp32
    summation error) times the sum of the contributions' magnitudes; the rounding must actually happen."""
    q, w, keys, idx, grad = scores_case(seed, dtype=dtype)
    fp32 = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce="sorted")[2]
    bf16 = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce="sorted-bf16")[2]
    bound = (bf16_rounding(q.device) + 1e-5) * contribution_magnitudes(q, w, keys, idx, grad)
    excess = ((bf16 - fp32).abs().double() - bound).max().item()
    assert excess <= 0, f"seed={seed} {dtype}: beyond the bound by {excess}"
    assert not torch.equal(bf16, fp32), f"seed={seed}: the contributions were not rounded to bf16"


@pytest.mark.parametrize("reduce", SORTED)
def test_sorted_reductions_replay_bitwise(reduce, seed):
    """Two backwards of the same inputs give the same key-gradient bits (and dq, dw)."""
    q, w, keys, idx, grad = scores_case(seed, dtype=torch.bfloat16)
    first = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce=reduce)
    second = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce=reduce)
    for name, a, b in zip(("dq", "dw", "dkeys"), first, second):
        assert torch.equal(a, b), f"seed={seed} {reduce}: {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunking_changes_nothing_with_exact_arithmetic(dtype, seed):
    """With exact sums (small integers) the chunk count (1, 5 and 13 queries per chunk) cannot change a
    bit, and every reduction gives the atomic one's key gradient: the chunks cover every slot once."""
    q, w, keys, idx, grad = scores_case(seed, dtype=dtype, exact=True)
    t, kk = idx.shape
    per_query = kk * (q.shape[2] * 4 + INDEX_BYTES_PER_SLOT)
    ref = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce="atomic")[2]
    assert ref.abs().sum() > 0, f"seed={seed}"
    for reduce in SORTED:
        for rows in (1, 5, t):
            got = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce=reduce,
                        scratch_bytes=rows * per_query)[2]
            assert torch.equal(got, ref), f"seed={seed} {reduce} {dtype}: {rows} queries per chunk"


@pytest.mark.parametrize("g", [11, 2**15 + 3], ids=["int16-keys", "int32-keys"])
def test_sorted_destinations_order_slots_by_key_row_then_slot(g, seed):
    """``dest`` is a permutation placing each valid slot inside its key row's segment, in query-major slot
    order within the segment, and every empty slot past the last segment (both widths of sort key)."""
    _, _, _, idx, _ = scores_case(seed)
    idx = torch.where(idx >= 0, idx * (g // 11), idx)  # spread over the G rows (the last ones included)
    idx[1, 1] = g - 1
    idx[0, 0] = g  # out of range: empty like -1
    dest, seg = _sorted_destinations(idx, g)
    flat = idx.reshape(-1)
    n = flat.numel()
    assert dest.dtype == torch.int32 and seg.dtype == torch.int64 and seg.shape == (g + 1,)
    assert torch.equal(torch.sort(dest.long()).values, torch.arange(n)), "a permutation"
    valid = (flat >= 0) & (flat < g)
    assert seg[0] == 0 and seg[-1] == valid.sum() and (seg.diff() >= 0).all()
    assert (dest[~valid] >= seg[-1]).all()
    for row in range(g):
        members = torch.nonzero(flat == row).flatten()  # query-major order
        assert torch.equal(dest[members].long(), torch.arange(seg[row], seg[row + 1])), f"seed={seed} row {row}"
    assert seg[g] - seg[g - 1] >= 1, "the last key row has its segment"


def test_chunk_plan_respects_the_budget_and_balances_the_chunks():
    t, kk, di = 65536, 512, 128
    for contrib_bytes, chunks in ((4, 9), (2, 5)):  # the flash shapes at the default 2 GiB
        rows = sorted_chunk_rows(t, kk, di, contrib_bytes, BWD_SCRATCH_BYTES)
        assert -(-t // rows) == chunks and rows * kk * (di * contrib_bytes + INDEX_BYTES_PER_SLOT) <= BWD_SCRATCH_BYTES
    assert sorted_chunk_rows(10, 4, 16, 4, 1) == 1, "at least one query"
    assert sorted_chunk_rows(10, 4, 16, 4, 2**40) == 10, "at most all of them"
    assert sorted_chunk_rows(10, 4, 16, 4, 7 * 4 * (64 + INDEX_BYTES_PER_SLOT)) == 5, "two equal chunks, not 7 + 3"
    assert sorted_chunk_rows(2**24, 2**10, 16, 4, 2**60) * 2**10 < 2**31, "int32 slot positions"


def test_deterministic_mode_turns_atomic_into_sorted(seed, monkeypatch):
    assert resolve_reduction("atomic", True) == "sorted"
    assert [resolve_reduction(r, False) for r in REDUCTIONS] == list(REDUCTIONS)
    assert resolve_reduction("sorted-bf16", True) == "sorted-bf16"
    q, w, keys, idx, grad = scores_case(seed)
    for deterministic, option, ran in ((False, "atomic", "triton/atomic"), (True, "atomic", "triton/sorted"),
                                       (False, "sorted-bf16", "triton/sorted-bf16")):
        monkeypatch.setenv(REDUCE_ENV, option)
        set_deterministic(deterministic)
        try:  # the variable resolved into options, handed over as the op does
            grads(indexer_scores_triton, q, w, keys, idx, grad, **scores_backward_keywords(KernelOptions.resolve()))
        finally:
            set_deterministic(False)
        assert kernel_options.backends_ran()["indexer_scores.bwd"] == ran, (deterministic, option)


def test_the_op_runs_triton_in_deterministic_mode(seed, monkeypatch):
    """``indexer_scores`` on a device Triton serves keeps the Triton kernels under
    ``torch.use_deterministic_algorithms(True)`` (their sorted reduction), with torch's gradients."""
    import dsv4cp.ops.indexer as ops_indexer

    q, w, keys, idx, grad = scores_case(seed)
    ref = grads(ops_indexer.indexer_scores, q, w, keys, idx, grad)
    monkeypatch.setattr(ops_indexer, "triton_serves", lambda x: True)
    kernel_options.reset_backends_ran()
    with deterministic_algorithms():
        got = grads(ops_indexer.indexer_scores, q, w, keys, idx, grad)
    ran = kernel_options.backends_ran()
    assert ran["indexer_scores.fwd"] == "triton" and ran["indexer_scores.bwd"] == "triton/sorted", ran
    for name, a, b in zip(("dq", "dw", "dkeys"), got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"seed={seed}: {name}"


@pytest.mark.parametrize("kw,env,match", [
    ({"reduce": "sorted-fp8"}, {}, r"^reduce: must be one of"),
    ({"scratch_bytes": 0}, {}, r"^scratch_bytes: must be a positive int"),
    ({"scratch_bytes": 1.5}, {}, r"^scratch_bytes: must be a positive int"),
    ({}, {REDUCE_ENV: "sorted16"}, rf"^{REDUCE_ENV}: must be one of"),
    ({}, {SCRATCH_ENV: "0"}, rf"^{SCRATCH_ENV}\.mib: must be >= 1, got 0"),
    ({}, {SCRATCH_ENV: "1,2"}, rf"^{SCRATCH_ENV}: expected 'mib'"),
])
def test_bad_reduction_settings_raise_at_the_call(kw, env, match, seed, monkeypatch):
    """Bad settings by keyword fail at the call (before any work, not at backward); by their variable,
    where the options are resolved."""
    q, w, keys, idx, _ = scores_case(seed, t=4, kk=5)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if env:
        with pytest.raises(ValueError, match=match):
            KernelOptions.resolve()
        return
    leaf = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=match):
        indexer_scores_triton(leaf, w, keys, idx, **kw)  # before any work, not at backward
    assert leaf.grad is None


def test_scratch_option_sets_the_chunking(seed, monkeypatch):
    """``triton_scores_bwd_scratch`` in MiB reaches the plan: 1 MiB is one query per chunk here (exact
    arithmetic: the same bits as one chunk)."""
    q, w, keys, idx, grad = scores_case(seed, t=4, kk=1100, di=256, exact=True)
    assert sorted_chunk_rows(4, 1100, 256, 4, 2**20) == 1
    one_chunk = grads(indexer_scores_triton, q, w, keys, idx, grad, reduce="sorted")[2]
    monkeypatch.setenv(SCRATCH_ENV, "1")
    settings = dict(scores_backward_keywords(KernelOptions.resolve()), reduce="sorted")
    assert settings["scratch_bytes"] == 2**20
    per_query = grads(indexer_scores_triton, q, w, keys, idx, grad, **settings)[2]
    assert torch.equal(per_query, one_chunk) and one_chunk.abs().sum() > 0, f"seed={seed}"


# ---------------------------------------------------------------------------------------------- GPU tests
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def flash_case(seed: int, t: int = 8192, hi: int = 64, di: int = 128, kk: int = 512):
    """bf16 flash shapes at ``t`` queries, G = t / 4 key rows, causal-like random selections (query t
    picks up to K rows among the first t / 4 + 1; the rest empty), unit-RMS q and keys."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = t // 4
    q = torch.randn(t, hi, di, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(g, di, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5).bfloat16()
    limit = torch.arange(t, device="cuda") // 4 + 1
    idx = (torch.rand(t, kk, device="cuda", generator=gen) * limit[:, None]).long()
    idx = torch.where(torch.arange(kk, device="cuda")[None, :] < limit[:, None], idx, -1)
    grad = torch.randn(t, kk, device="cuda", generator=gen)
    return q, w, keys, idx, grad


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("reduce", SORTED)
def test_gpu_sorted_reductions_match_atomic_and_replay_bitwise(reduce, seed):
    """Flash shapes, bf16: each sorted reduction against the atomic one, replayed bitwise; dq and dw do not
    depend on the reduction. dkeys' relative error (norm): fp32 contributions differ from the atomics in
    the order of ~2K-term sums only (expected ~1e-6), bf16 ones by their rounding (expected ~u / 2 with
    u = 2^-8; bounded here by 2u)."""
    case = flash_case(seed)
    ref = grads(indexer_scores_triton, *case, reduce="atomic")
    first = grads(indexer_scores_triton, *case, reduce=reduce)
    second = grads(indexer_scores_triton, *case, reduce=reduce, scratch_bytes=BWD_SCRATCH_BYTES)
    for name, a, b in zip(("dq", "dw", "dkeys"), first, second):
        assert torch.equal(a, b), f"seed={seed} {reduce}: {name} differs between replays"
    for name, a, b in zip(("dq", "dw"), first, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"seed={seed} {reduce}: {name}"
    err = relative_error(first[2], ref[2])
    assert err < (1e-4 if reduce == "sorted" else 2 * bf16_rounding(ref[2].device)), \
        f"seed={seed} {reduce}: relative error {err}"
    assert reduce == "sorted" or err > 1e-5, f"seed={seed}: the contributions were not rounded to bf16"


@pytest.mark.gpu
@needs_cuda
def test_gpu_sorted_reduction_chunks_add_in_a_fixed_order(seed):
    """Many small chunks (1 MiB of scratch) against one: the same sums to fp32 rounding, and again bitwise."""
    case = flash_case(seed, t=2048)
    one = grads(indexer_scores_triton, *case, reduce="sorted")[2]
    many = [grads(indexer_scores_triton, *case, reduce="sorted", scratch_bytes=2**20)[2] for _ in range(2)]
    assert torch.equal(many[0], many[1]), f"seed={seed}"
    assert relative_error(many[0], one) < 1e-4, f"seed={seed}"


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()
