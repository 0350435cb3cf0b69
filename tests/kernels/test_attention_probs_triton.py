"""Triton kernels of the indexer loss's target against the torch path (DESIGN 1.6).

CPU (Triton's interpreter, fp32, tiny sizes: T <= 12, H in {1, 3, 5, 8}, D in {16, 32}, K in {5, 13, 70}):
:func:`logsumexp_over_triton` and :func:`head_summed_probs_triton` against the torch functions of
:mod:`dsv4cp.ops.attention_probs` (relative error 1e-4), plus the head loop (H over several head blocks),
int32 / int64 indices, strided inputs, out-of-range rows, bf16 through the interpreter, determinism,
degenerate shapes, input validation and the dispatch (CPU and fp64 stay on torch). The ``d_chunks``
kernels the same way, per launch shape: both logit layouts (probabilities), one program per item or a
persistent grid, head loops / head blocks with a padded last block, D not a multiple of the chunk,
ragged slot blocks; their results do not depend on the grid.

GPU (marked ``gpu``): T = 2048, H = 64, D = 512, K = 512 in bf16 against the torch path in fp32 (relative
error < 1e-2), the head loop at H = 128, fp32 at D = 512 (the fp32 ladder), and the dispatch on CUDA;
the ``d_chunks`` ladder's and the bench's launches at the flash shape.

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it), never
zeros; every case mixes empty (-1) slots, a query without any valid slot and duplicated indices.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.attention_probs_triton import (
    SLOTS_ON_M_ENV,
    ChunkConfig,
    LseChunkConfig,
    head_summed_probs_triton,
    logsumexp_over_triton,
)
from dsv4cp.ops import attention_probs as il
from triton_marks import needs_cuda, skip_module_without_triton

skip_module_without_triton()


def make_case(seed: int, t: int, h: int, d: int, n: int, k: int, *, device="cpu", idx_dtype=torch.int64):
    """q ``[T, H, D]``, keys ``[N, D]`` (randn, fp32), idx ``[T, K]`` with ~20% empty slots, duplicated
    rows inside queries and query 1 without any valid slot, scale ``D^-1/2``, and the loss's
    denominator ``logaddexp(lse, sink)`` (finite everywhere, also for the empty query)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    keys = torch.randn(n, d, generator=g)
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.2] = -1
    if k > 1:  # duplicated indices inside rows
        idx[::2, k - 1] = idx[::2, 0]
        idx[1::3, k // 2] = idx[1::3, 0]
    if t > 1:
        idx[1] = -1
    scale = d**-0.5
    sink = torch.randn(h, generator=g)
    lden = torch.logaddexp(il.logsumexp_over_torch(q, keys, idx, scale), sink[None, :])
    to = {"device": device}
    return q.to(**to), keys.to(**to), idx.to(dtype=idx_dtype, **to), scale, lden.to(**to)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def check_lse(lse: torch.Tensor, ref: torch.Tensor, tol: float, msg: str) -> None:
    assert lse.dtype == torch.float32 and lse.shape == ref.shape, f"{msg}: {lse.dtype} {tuple(lse.shape)}"
    empty = torch.isneginf(ref.cpu())
    assert torch.equal(torch.isneginf(lse.cpu()), empty), f"{msg}: -inf pattern of lse differs"
    assert torch.isfinite(lse.cpu()[~empty]).all(), f"{msg}: lse not finite"
    err = rel_fro(lse.cpu()[~empty], ref.cpu()[~empty])
    assert err < tol, f"{msg}: lse rel err {err:.2e}"


def check_probs(p: torch.Tensor, ref: torch.Tensor, idx: torch.Tensor, tol: float, msg: str) -> None:
    assert p.dtype == torch.float32 and p.shape == idx.shape, f"{msg}: {p.dtype} {tuple(p.shape)}"
    assert torch.isfinite(p).all(), f"{msg}: probs not finite"
    assert (p.cpu()[idx.cpu() < 0] == 0).all(), f"{msg}: empty slots must be 0"
    err = rel_fro(p, ref)
    assert err < tol, f"{msg}: probs rel err {err:.2e}"


# ------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("kernel", ["whole_d", "d_chunks"])
@pytest.mark.parametrize("k", [5, 13, 70])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("h", [1, 3, 5, 8])
def test_matches_torch_fp32(h, d, k, kernel, seed):
    """Both kernels of each op, with their ladders' first tiles."""
    t = 12 if k < 70 else 6
    q, keys, idx, scale, lden = make_case(seed, t, h, d, 3 * k + 7, k)
    msg = f"seed={seed} T={t} H={h} D={d} K={k} {kernel}"
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel=kernel), il.logsumexp_over_torch(q, keys, idx, scale),
              1e-4, msg)
    p = head_summed_probs_triton(q, keys, idx, scale, lden, kernel=kernel)
    check_probs(p, il.head_summed_probs_torch(q, keys, idx, scale, lden), idx, 1e-4, msg)
    assert p[1].abs().max().item() == 0.0, f"{msg}: a query without slots has zero mass"


@pytest.mark.parametrize("h", [1, 5, 8])
def test_heads_on_m_layout_matches_torch(h, seed, monkeypatch):
    """``slots_on_m=False``: the other logit layout (heads on M; the default has slots on M) gives the same
    head-summed probabilities, also with padded heads and several slot blocks; a bad value of its variable is
    refused where the options are resolved."""
    q, keys, idx, scale, lden = make_case(seed, 6, h, 32, 60, 40)
    p = head_summed_probs_triton(q, keys, idx, scale, lden, block_k=16, num_warps=4, num_stages=1, kernel="whole_d",
                                 slots_on_m=False)
    check_probs(p, il.head_summed_probs_torch(q, keys, idx, scale, lden), idx, 1e-4, f"seed={seed} H={h}")
    monkeypatch.setenv(SLOTS_ON_M_ENV, "yes")
    with pytest.raises(ValueError, match=SLOTS_ON_M_ENV):
        KernelOptions.resolve()


def test_head_loop_and_slot_blocks(seed):
    """H = 20 over head blocks of 16 (the second one 4/16 full): the probabilities kernel loops over head
    blocks inside each slot block (blocks of 16 slots), the lse kernel runs two programs per query."""
    q, keys, idx, scale, lden = make_case(seed, 4, 20, 32, 24, 37)
    kw = {"block_h": 16, "block_k": 16, "num_warps": 4, "num_stages": 1, "kernel": "whole_d"}
    check_lse(logsumexp_over_triton(q, keys, idx, scale, **kw), il.logsumexp_over_torch(q, keys, idx, scale),
              1e-4, f"seed={seed}")
    p = head_summed_probs_triton(q, keys, idx, scale, lden, **kw)
    check_probs(p, il.head_summed_probs_torch(q, keys, idx, scale, lden), idx, 1e-4, f"seed={seed}")


def test_int32_strided_inputs_and_out_of_range_rows(seed):
    """int32 indices, q a head-strided view, keys and the denominator column views; rows >= N count as
    empty slots (the reference sees them as -1)."""
    q, keys, idx, scale, lden = make_case(seed, 7, 3, 16, 20, 13, idx_dtype=torch.int32)
    ref_lse = il.logsumexp_over_torch(q, keys, idx, scale)
    ref_p = il.head_summed_probs_torch(q, keys, idx, scale, lden)
    q_view = torch.stack([q, q + 1.0], dim=2).flatten(1, 2)[:, ::2]  # stride(1) = 2 D
    keys_view = torch.cat([keys, keys], dim=1)[:, :16]  # stride(0) = 2 D
    lden_view = torch.cat([lden, lden], dim=1)[:, :3]  # stride(0) = 2 H
    assert q_view.stride(1) == 32 and keys_view.stride(0) == 32 and lden_view.stride(0) == 6
    far = idx.clone()
    far[0, :3] = torch.tensor([20, 1000, 2**30], dtype=torch.int32)  # out of range: empty
    near = idx.clone()
    near[0, :3] = -1
    msg = f"seed={seed}"
    check_lse(logsumexp_over_triton(q_view, keys_view, far, scale), il.logsumexp_over_torch(q, keys, near, scale),
              1e-4, msg)
    check_lse(logsumexp_over_triton(q_view, keys_view, idx, scale), ref_lse, 1e-4, msg)
    p = head_summed_probs_triton(q_view, keys_view, far, scale, lden_view)
    assert (p[0, :3] == 0).all(), f"{msg}: out-of-range rows must be empty"
    check_probs(p, il.head_summed_probs_torch(q, keys, near, scale, lden), near, 1e-4, msg)
    check_probs(head_summed_probs_triton(q_view, keys_view, idx, scale, lden_view), ref_p, idx, 1e-4, msg)


def test_bf16_through_interpreter_vs_fp32_reference(seed):
    q, keys, idx, scale, lden = make_case(seed, 6, 4, 32, 30, 20)
    qb, kb = q.bfloat16(), keys.bfloat16()
    check_lse(logsumexp_over_triton(qb, kb, idx, scale), il.logsumexp_over_torch(q, keys, idx, scale), 1e-2,
              f"seed={seed}")
    p = head_summed_probs_triton(qb, kb, idx, scale, lden)
    check_probs(p, il.head_summed_probs_torch(q, keys, idx, scale, lden), idx, 1e-2, f"seed={seed}")


def test_deterministic_and_degenerate_shapes(seed):
    q, keys, idx, scale, lden = make_case(seed, 5, 20, 16, 12, 9)
    for kw in ({"block_h": 16, "block_k": 16, "kernel": "whole_d"},
               {"chunk_config": ChunkConfig(16, 16, 16, 4, 1, 1, 2), "kernel": "d_chunks"}):
        first = head_summed_probs_triton(q, keys, idx, scale, lden, **kw)
        assert torch.equal(first, head_summed_probs_triton(q, keys, idx, scale, lden, **kw)), f"seed={seed} {kw}"
    # no slots at all, no queries
    none = idx[:, :0]
    assert torch.isneginf(logsumexp_over_triton(q, keys, none, scale)).all()
    assert head_summed_probs_triton(q, keys, none, scale, lden).shape == (5, 0)
    assert logsumexp_over_triton(q[:0], keys, idx[:0], scale).shape == (0, 20)
    assert head_summed_probs_triton(q[:0], keys, idx[:0], scale, lden[:0]).shape == (0, 9)
    # every slot empty
    empty = torch.full_like(idx, -1)
    assert torch.isneginf(logsumexp_over_triton(q, keys, empty, scale)).all()
    assert (head_summed_probs_triton(q, keys, empty, scale, lden) == 0).all()


@pytest.mark.parametrize(
    "field, change",
    [
        ("q", lambda a: {**a, "q": a["q"][0]}),
        ("q", lambda a: {**a, "q": a["q"].double()}),
        ("q", lambda a: {**a, "q": a["q"][..., :8], "keys": a["keys"][:, :8]}),
        ("q", lambda a: {**a, "q": a["q"].repeat(1, 1, 33), "keys": a["keys"].repeat(1, 33)}),
        ("keys", lambda a: {**a, "keys": a["keys"].bfloat16()}),
        ("keys", lambda a: {**a, "keys": a["keys"][:, None]}),
        ("idx", lambda a: {**a, "idx": a["idx"].float()}),
        ("idx", lambda a: {**a, "idx": a["idx"][1:]}),
        ("log_denominator", lambda a: {**a, "log_denominator": a["log_denominator"][:, :1]}),
        ("log_denominator", lambda a: {**a, "log_denominator": a["log_denominator"].long()}),
    ],
)
def test_bad_input_names_the_field(field, change):
    q, keys, idx, scale, lden = make_case(0, 3, 2, 16, 8, 5)
    args = change({"q": q, "keys": keys, "idx": idx, "log_denominator": lden})
    with pytest.raises(ValueError, match=rf"^{field}:"):
        head_summed_probs_triton(args["q"], args["keys"], args["idx"], scale, args["log_denominator"])
    if field != "log_denominator":
        with pytest.raises(ValueError, match=rf"^{field}:"):
            logsumexp_over_triton(args["q"], args["keys"], args["idx"], scale)


def test_cpu_and_fp64_dispatch_to_torch(monkeypatch, seed):
    """The loss's functions use the kernels only for CUDA tensors (not fp64): on CPU they must never
    reach the Triton wrappers, whatever the dtype."""
    from dsv4cp.kernels import attention_probs_triton as kernels

    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken for a CPU tensor")

    monkeypatch.setattr(kernels, "logsumexp_over_triton", boom)
    monkeypatch.setattr(kernels, "head_summed_probs_triton", boom)
    q, keys, idx, scale, lden = make_case(seed, 3, 2, 16, 8, 5)
    for dtype in (torch.float32, torch.float64):
        qc, kc = q.to(dtype), keys.to(dtype)
        assert torch.equal(il.logsumexp_over(qc, kc, idx, scale), il.logsumexp_over_torch(qc, kc, idx, scale))
        ld = lden.to(dtype)
        assert torch.equal(il.head_summed_probs(qc, kc, idx, scale, ld),
                           il.head_summed_probs_torch(qc, kc, idx, scale, ld))


# d_chunks: (block_h, block_k, block_d, num_warps, num_stages, slots_on_m, programs_per_sm) on tiny shapes
_CHUNK_CASES = [
    # H, D, K, config
    (3, 32, 13, (16, 16, 16, 4, 1, 1, 0)),  # two chunks, one slot block, one program per item
    (5, 32, 40, (16, 16, 16, 4, 1, 0, 3)),  # heads on M, three slot blocks (the last ragged), persistent
    (8, 16, 70, (16, 32, 16, 4, 1, 1, 2)),  # one chunk, three slot blocks, persistent
    (20, 32, 37, (16, 16, 16, 4, 1, 1, 2)),  # head loop (two blocks, the second 4/16 full), persistent
    (20, 32, 37, (16, 32, 32, 4, 1, 0, 0)),  # head loop, heads on M
    (1, 48, 5, (16, 16, 32, 4, 1, 1, 3)),  # D = 48 in chunks of 32: a masked last chunk
    (1, 48, 5, (16, 16, 32, 4, 1, 0, 0)),
    (130, 16, 13, (128, 16, 16, 4, 1, 1, 2)),  # 128-head blocks (the ladder's for H > 64), the second padded
]


@pytest.mark.parametrize("h, d, k, config", _CHUNK_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_d_chunks_matches_torch_fp32(h, d, k, config, seed):
    t = 7
    q, keys, idx, scale, lden = make_case(seed, t, h, d, 3 * k + 7, k)
    msg = f"seed={seed} H={h} D={d} K={k} config={config}"
    p = head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks", chunk_config=ChunkConfig(*config))
    check_probs(p, il.head_summed_probs_torch(q, keys, idx, scale, lden), idx, 1e-4, msg)
    assert p[1].abs().max().item() == 0.0, f"{msg}: a query without slots has zero mass"


@pytest.mark.parametrize("h, d, k, config", _CHUNK_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_lse_d_chunks_matches_torch_fp32(h, d, k, config, seed):
    """The same shapes and tiles for the log-sum-exp (the layout field dropped: heads on M), with empty
    slots, a query without any (``-inf``) and several slot blocks of online max / sum."""
    bh, bk, bd, warps, stages, _, programs = config
    q, keys, idx, scale, _ = make_case(seed, 7, h, d, 3 * k + 7, k)
    lse = logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks",
                                chunk_config=LseChunkConfig(bh, bk, bd, warps, stages, programs))
    check_lse(lse, il.logsumexp_over_torch(q, keys, idx, scale), 1e-4, f"seed={seed} H={h} D={d} K={k} {config}")


def test_d_chunks_bf16_ladder_and_grid_independence(seed):
    """bf16 through the interpreter with the kernel's own ladder (the option's ``auto``); int32 indices,
    strided views and out-of-range rows; the same tile on a persistent grid or one program per item gives
    the same bits."""
    q, keys, idx, scale, lden = make_case(seed, 6, 4, 32, 30, 20, idx_dtype=torch.int32)
    far = idx.clone()
    far[0, :3] = torch.tensor([30, 1000, 2**30], dtype=torch.int32)  # out of range: empty
    near = idx.clone()
    near[0, :3] = -1
    qb = torch.stack([q, q + 1.0], dim=2).flatten(1, 2).bfloat16()[:, ::2]  # stride(1) = 2 D
    kb = torch.cat([keys, keys], dim=1).bfloat16()[:, :32]  # stride(0) = 2 D
    assert qb.stride(1) == 64 and kb.stride(0) == 64
    p = head_summed_probs_triton(qb, kb, far, scale, lden, kernel="d_chunks")
    ref = il.head_summed_probs_torch(qb.float(), kb.float(), near, scale, lden)
    check_probs(p, ref, near, 1e-4, f"seed={seed}")
    one = head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks",
                                   chunk_config=ChunkConfig(16, 16, 16, 4, 1, 1, 0))
    grid = head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks",
                                    chunk_config=ChunkConfig(16, 16, 16, 4, 1, 1, 4))
    assert torch.equal(one, grid), f"seed={seed}: the grid changed the result"
    check_lse(logsumexp_over_triton(qb, kb, far, scale, kernel="d_chunks"),
              il.logsumexp_over_torch(qb.float(), kb.float(), near, scale), 1e-4, f"seed={seed} lse")
    one, grid = (logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks",
                                       chunk_config=LseChunkConfig(16, 16, 16, 4, 1, programs)) for programs in (0, 4))
    assert torch.equal(one, grid), f"seed={seed}: the grid changed the lse"
    empty = torch.full_like(idx, -1)  # every slot empty: -inf lse, zero mass
    assert torch.isneginf(logsumexp_over_triton(q, keys, empty, scale, kernel="d_chunks")).all()
    assert (head_summed_probs_triton(q, keys, empty, scale, lden, kernel="d_chunks") == 0).all()


def test_d_chunks_through_the_options(seed, monkeypatch):
    """``DSV4CP_TRITON_PROBS_KERNEL=d_chunks``, resolved into the options the op takes, routes it to the
    chunked kernel and ``DSV4CP_TRITON_PROBS_CHUNK_CONFIG`` pins its launch (noted as what ran); bad values
    are refused where the options are resolved, naming the variable or the field; a whole_d pin is refused
    by the d_chunks kernel, not ignored."""
    monkeypatch.setattr(il, "triton_serves", lambda x: True)  # the op on the kernels (interpreted on CPU)
    q, keys, idx, scale, lden = make_case(seed, 5, 3, 32, 20, 9)
    ref = il.head_summed_probs_torch(q, keys, idx, scale, lden)
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_KERNEL", "d_chunks")
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_CHUNK_CONFIG", "16,16,16,4,1,0,2")
    kernel_options.reset_backends_ran()
    got = il.head_summed_probs(q, keys, idx, scale, lden, options=KernelOptions.resolve())
    check_probs(got, ref, idx, 1e-4, f"seed={seed}")
    ran = kernel_options.backends_ran()
    assert ran.get("attention_probs.probs_chunks.config") == (
        "block_h=16,block_k=16,block_d=16,num_warps=4,num_stages=1,slots_on_m=0,programs_per_sm=2"), ran
    for text, pattern in (("16,16,16,4,1,2,2", r"^DSV4CP_TRITON_PROBS_CHUNK_CONFIG\.slots_on_m"),
                          ("16,16,16,4,1", "^DSV4CP_TRITON_PROBS_CHUNK_CONFIG: expected")):
        monkeypatch.setenv("DSV4CP_TRITON_PROBS_CHUNK_CONFIG", text)
        with pytest.raises(ValueError, match=pattern):
            KernelOptions.resolve()
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_CHUNK_CONFIG", "16,16,16,4,1,0,2")
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_CONFIG", "16,16,4,1")  # the whole_d tile: refused, not ignored
    with pytest.raises(ValueError, match=r"^block_h: pins the whole_d kernel"):
        il.head_summed_probs(q, keys, idx, scale, lden, options=KernelOptions.resolve())
    monkeypatch.delenv("DSV4CP_TRITON_PROBS_CONFIG")
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_KERNEL", "tiles")
    with pytest.raises(ValueError, match="DSV4CP_TRITON_PROBS_KERNEL"):
        KernelOptions.resolve()
    monkeypatch.delenv("DSV4CP_TRITON_PROBS_KERNEL")
    monkeypatch.setenv("DSV4CP_TRITON_LSE_KERNEL", "d_chunks")
    monkeypatch.setenv("DSV4CP_TRITON_LSE_CHUNK_CONFIG", "16,16,16,4,1,3")
    check_lse(il.logsumexp_over(q, keys, idx, scale, options=KernelOptions.resolve()),
              il.logsumexp_over_torch(q, keys, idx, scale), 1e-4, f"seed={seed}")
    assert kernel_options.backends_ran().get("attention_probs.lse_chunks.config") == (
        "block_h=16,block_k=16,block_d=16,num_warps=4,num_stages=1,programs_per_sm=3")
    monkeypatch.setenv("DSV4CP_TRITON_LSE_CHUNK_CONFIG", "16,16,16,4,1,-2")
    with pytest.raises(ValueError, match=r"^DSV4CP_TRITON_LSE_CHUNK_CONFIG\.programs_per_sm"):
        KernelOptions.resolve()


@pytest.mark.parametrize("config, field", [
    ((16, 24, 16, 4, 1, 1, 0), "block_k"),
    ((16, 16, 8, 4, 1, 1, 0), "block_d"),
    ((16, 16, 16, 0, 1, 1, 0), "num_warps"),
    ((16, 16, 16, 4, 1, 3, 0), "slots_on_m"),
    ((16, 16, 16, 4, 1, 1, -1), "programs_per_sm"),
])
def test_d_chunks_bad_config_names_the_field(config, field):
    q, keys, idx, scale, lden = make_case(0, 3, 2, 16, 8, 5)
    with pytest.raises(ValueError, match=rf"^chunk_config(\.{field}|: num_warps)"):
        head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks", chunk_config=ChunkConfig(*config))
    with pytest.raises(ValueError, match=r"^kernel:"):
        head_summed_probs_triton(q, keys, idx, scale, lden, kernel="whole")
    with pytest.raises(ValueError, match=r"^block_k: pins the whole_d kernel"):
        head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks", block_k=16)
    with pytest.raises(ValueError, match=r"^num_warps: pins the whole_d kernel"):
        logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks", num_warps=4)
    if field != "slots_on_m":
        bh, bk, bd, warps, stages, _, programs = config
        with pytest.raises(ValueError, match=rf"^chunk_config(\.{field}|: num_warps)"):
            logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks",
                                  chunk_config=LseChunkConfig(bh, bk, bd, warps, stages, programs))


# ------------------------------------------------------------------------------------------ GPU
def _gpu_case(seed: int, t: int, h: int, d: int, k: int, dtype: torch.dtype):
    """Model-like inputs on CUDA: per-head RMS-normalised q, a key buffer of T + T / 4 (at least 2K) rows,
    K distinct random rows per query, ~1/8 of the slots empty, query 1 empty; the fp32 reference inputs
    are the bf16 values upcast."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = max(t + t // 4, 2 * k)  # enough rows for K distinct indices per query
    q = torch.randn(t, h, d, device="cuda", generator=g)
    q = (q * d**0.5 / q.norm(dim=-1, keepdim=True)).to(dtype)
    keys = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    idx = torch.rand(t, n, device="cuda", generator=g).topk(k, dim=1).indices
    idx[torch.rand(t, k, device="cuda", generator=g) < 0.125] = -1
    idx[:, -1] = idx[:, 0]
    idx[1] = -1
    scale = d**-0.5
    sink = torch.randn(h, device="cuda", generator=g)
    q32, k32 = q.float(), keys.float()
    ref_lse = il.logsumexp_over_torch(q32, k32, idx, scale)
    lden = torch.logaddexp(ref_lse, sink[None, :])
    return q, keys, idx, scale, lden, q32, k32, ref_lse


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("slots_on_m", ["0", "1"])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_gpu_flash_shape_bf16(idx_dtype, slots_on_m, seed):
    q, keys, idx, scale, lden, q32, k32, ref_lse = _gpu_case(seed, 2048, 64, 512, 512, torch.bfloat16)
    idx = idx.to(idx_dtype)
    msg = f"seed={seed}"
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel="whole_d"), ref_lse, 1e-2, msg)
    ref_p = il.head_summed_probs_torch(q32, k32, idx, scale, lden)
    check_probs(head_summed_probs_triton(q, keys, idx, scale, lden, kernel="whole_d", slots_on_m=slots_on_m == "1"),
                ref_p, idx, 1e-2, msg)


@pytest.mark.gpu
@needs_cuda
def test_gpu_head_loop_bf16(seed):
    """H = 128 (pro preset): the whole_d probabilities kernel loops over two head blocks of 64."""
    q, keys, idx, scale, lden, q32, k32, ref_lse = _gpu_case(seed, 512, 128, 512, 512, torch.bfloat16)
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel="whole_d"), ref_lse, 1e-2, f"seed={seed}")
    ref_p = il.head_summed_probs_torch(q32, k32, idx, scale, lden)
    check_probs(head_summed_probs_triton(q, keys, idx, scale, lden, kernel="whole_d"), ref_p, idx, 1e-2,
                f"seed={seed}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_d512(seed):
    q, keys, idx, scale, lden, _, _, ref_lse = _gpu_case(seed, 128, 64, 512, 512, torch.float32)
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel="whole_d"), ref_lse, 1e-4, f"seed={seed}")
    ref_p = il.head_summed_probs_torch(q, keys, idx, scale, lden)
    check_probs(head_summed_probs_triton(q, keys, idx, scale, lden, kernel="whole_d"), ref_p, idx, 1e-4,
                f"seed={seed}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_loss_functions_dispatch_to_triton(monkeypatch, seed):
    q, keys, idx, scale, lden, _, _, _ = _gpu_case(seed, 64, 64, 512, 128, torch.bfloat16)
    lse = il.logsumexp_over(q, keys, idx, scale)
    p = il.head_summed_probs(q, keys, idx, scale, lden)
    assert torch.equal(lse, logsumexp_over_triton(q, keys, idx, scale)), f"seed={seed}"
    assert torch.equal(p, head_summed_probs_triton(q, keys, idx, scale, lden)), f"seed={seed}"
    # fp64 stays on torch
    from dsv4cp.kernels import attention_probs_triton as kernels

    monkeypatch.setattr(kernels, "logsumexp_over_triton", None)
    q64, k64 = q.double(), keys.double()
    assert torch.equal(il.logsumexp_over(q64, k64, idx, scale), il.logsumexp_over_torch(q64, k64, idx, scale))


_GPU_CHUNK_CONFIGS = [None, (64, 512, 32, 8, 7, 1, 1), (64, 256, 64, 8, 5, 0, 1), (64, 128, 64, 8, 5, 1, 2),
                      (64, 128, 64, 8, 5, 1, 0), (64, 64, 64, 4, 5, 1, 4)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", _GPU_CHUNK_CONFIGS, ids=lambda c: "ladder" if c is None else "x".join(map(str, c)))
def test_gpu_d_chunks_flash_shape_bf16(config, seed):
    """The d_chunks kernel at the flash shape (its ladder and the bench's main launches), int32 indices."""
    q, keys, idx, scale, lden, q32, k32, _ = _gpu_case(seed, 2048, 64, 512, 512, torch.bfloat16)
    idx = idx.to(torch.int32)
    cfg = None if config is None else ChunkConfig(*config)
    p = head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks", chunk_config=cfg)
    check_probs(p, il.head_summed_probs_torch(q32, k32, idx, scale, lden), idx, 1e-2, f"seed={seed} {config}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, (64, 128, 64, 4, 7, 2), (64, 256, 32, 8, 7, 1), (64, 512, 32, 8, 7, 1)],
                         ids=lambda c: "ladder" if c is None else "x".join(map(str, c)))
def test_gpu_lse_d_chunks_flash_shape_bf16(config, seed):
    q, keys, idx, scale, _, _, _, ref_lse = _gpu_case(seed, 2048, 64, 512, 512, torch.bfloat16)
    cfg = None if config is None else LseChunkConfig(*config)
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks", chunk_config=cfg), ref_lse, 1e-2,
              f"seed={seed} {config}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_d_chunks_head_loop_and_fp32(dtype, seed):
    """H = 128 (two head blocks of 64) in bf16, and fp32 at D = 512 (the fp32 ladders): both ops."""
    h, t = (128, 512) if dtype == torch.bfloat16 else (64, 128)
    q, keys, idx, scale, lden, q32, k32, ref_lse = _gpu_case(seed, t, h, 512, 512, dtype)
    p = head_summed_probs_triton(q, keys, idx, scale, lden, kernel="d_chunks")
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    check_probs(p, il.head_summed_probs_torch(q32, k32, idx, scale, lden), idx, tol, f"seed={seed}")
    check_lse(logsumexp_over_triton(q, keys, idx, scale, kernel="d_chunks"), ref_lse, tol, f"seed={seed}")
