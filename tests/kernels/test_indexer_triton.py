"""Triton lightning-indexer kernels against the torch ops (DESIGN 1.6, 3.4, 4.2).

CPU (Triton's interpreter, fp32, tiny sizes: T <= 24, Hi <= 4, Di in {16, 32}, G <= 48):

* the masked score matrix against an einsum reference (values and the -inf pattern);
* the top-k against :func:`dsv4cp.ops.indexer.indexer_topk`: with integer-valued inputs every score is
  exact in any summation order, so the selections must be IDENTICAL, ties included (many exact ties,
  and exact-zero scores by construction: queries with non-negative q against keys with non-positive
  entries); with normal inputs the selections must agree up to near-ties (checked through the scores);
* real CP layouts (``build_layout``: several documents, rank-major gathered keys with empty slots);
* chunking (tiny budgets and chunk caps give the same selection), the key-range bounds, the planner;
* the differentiable scores at given indices (forward and gradients, atomic and deterministic).

GPU (marked ``gpu``): T = 8192, Hi = 64, Di = 128, G = T/4 in bf16: the k-th best score of our selection
against the reference's (within a small tolerance; bf16 rounding and summation order move near-ties).

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it), never zeros.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import set_deterministic
from dsv4cp.kernels.contracts import pack_selection_keys
from dsv4cp.kernels.indexer_plan import TOPK_BYTES_PER_SCORE, key_ranges, plan_chunks, query_limits
from dsv4cp.kernels.indexer_scores_triton import (
    BWD_CONFIG_ENV,
    GATHER_BWD_CONFIGS,
    GatherBwdConfig,
    indexer_scores_triton,
)
from dsv4cp.kernels.indexer_triton import (
    TOPK_KEYS_ENV,
    TOPK_SELECT_ENV,
    IndexerConfig,
    indexer_score_matrix,
    iter_score_chunks,
)
from dsv4cp.ops.indexer import fused_indexer_topk as indexer_topk_triton
from dsv4cp.ops.indexer import indexer_scores, indexer_topk, scores_backward_keywords
from dsv4cp.packing import PackedSeqs
from triton_marks import needs_cuda, skip_module_without_triton

skip_module_without_triton()


# ---------------------------------------------------------------------------------------------- inputs
def gathered_layout(gen: torch.Generator, entries: list[int], cp: int, slack: int = 2):
    """``key_doc, key_j [G]`` of a rank-major gathered buffer: the documents' entries in global order,
    cut into ``cp`` contiguous parts, each placed in a block of ``capacity`` rows followed by empty slots
    (doc -1). A document's keys are therefore split across blocks, with gaps."""
    order = [(d, j) for d, n in enumerate(entries) for j in range(n)]
    cuts = sorted(torch.randint(0, len(order) + 1, (cp - 1,), generator=gen).tolist())
    parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])]
    capacity = max(len(p) for p in parts) + slack
    key_doc = torch.full((cp * capacity,), -1, dtype=torch.int64)
    key_j = torch.zeros(cp * capacity, dtype=torch.int64)
    for r, part in enumerate(parts):
        for i, (d, j) in enumerate(part):
            key_doc[r * capacity + i], key_j[r * capacity + i] = d, j
    return key_doc, key_j


def make_case(seed: int, t: int, hi: int, di: int, entries: list[int], cp: int, *, integer: bool,
              dtype=torch.float32, device: str = "cpu"):
    """Random indexer inputs (never zeros) on a random multi-document layout; a third of the queries
    have non-negative q and a third of the keys non-positive entries, so their pairs score exactly 0.
    Query rows: random documents (some -1) and positions (some too early to see any entry)."""
    gen = torch.Generator().manual_seed(seed)
    key_doc, key_j = gathered_layout(gen, entries, cp)
    g = key_doc.numel()
    if integer:  # exact scores in any summation order (|dot| <= 9 * di, w multiples of 1/2)
        values = torch.tensor([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0])
        q = values[torch.randint(0, 6, (t, hi, di), generator=gen)]
        keys = values[torch.randint(0, 6, (g, di), generator=gen)]
        w = torch.tensor([-1.0, -0.5, 0.5, 1.0, 1.5, 2.0])[torch.randint(0, 6, (t, hi), generator=gen)]
    else:
        q = torch.randn(t, hi, di, generator=gen)
        keys = torch.randn(g, di, generator=gen)
        w = torch.randn(t, hi, generator=gen)
    pos_q = torch.rand(t, generator=gen) < 0.34
    q[pos_q] = q[pos_q].abs()
    neg_k = torch.rand(g, generator=gen) < 0.34
    keys[neg_k] = -keys[neg_k].abs()
    n_docs = len(entries)
    qdoc = torch.randint(0, n_docs, (t,), generator=gen)
    qdoc[torch.rand(t, generator=gen) < 0.1] = -1
    longest = torch.tensor(entries)[qdoc.clamp_min(0)]
    pos = (torch.rand(t, generator=gen) * (4 * longest + 4).to(torch.float32)).to(torch.int64)
    qlim = query_limits(qdoc, pos)
    return {"q": q.to(device, dtype), "w": w.to(device), "keys": keys.to(device, dtype), "query_doc": qdoc.to(device),
            "query_limit": qlim.to(device), "key_doc": key_doc.to(device), "key_j": key_j.to(device)}


def visible_of(case) -> torch.Tensor:
    qdoc, qlim = case["query_doc"], case["query_limit"]
    return ((qdoc[:, None] >= 0) & (case["key_doc"][None, :] == qdoc[:, None])
            & (case["key_j"][None, :] < qlim[:, None]))


def reference_topk(case, k: int) -> torch.Tensor:
    vis = visible_of(case)
    return indexer_topk(case["q"], case["w"], case["keys"], lambda sl: vis[sl], k)


def reference_scores(case) -> torch.Tensor:
    """fp64 masked scores of the (already rounded) inputs."""
    q, w, keys = (case[n].double() for n in ("q", "w", "keys"))
    s = torch.einsum("thd,gd->thg", q, keys).relu_().mul_(w[:, :, None]).sum(1)
    return s.masked_fill_(~visible_of(case), float("-inf"))


FP32_UNIT_ROUNDOFF = 2.0**-24


def rounding_bound(case) -> torch.Tensor:
    """``[T, G]`` fp64 bound on ``|fp32 score - exact score|`` that holds for ANY summation order.

    A score sums ``Hi * Di`` terms ``w_h q_hd k_d`` (after the exact, 1-Lipschitz ReLU of each head's
    dot product). In fp32 a term passes through at most ``n = Di + Hi`` roundings: its product and the
    ``Di - 1`` additions of its head's dot product, the multiplication by ``w_h``, the ``Hi - 1``
    additions over heads. Hence ``|fl(score) - score| <= gamma_n * sum_h |w_h| sum_d |q_hd k_d|`` with
    ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., section 3.1); the fp64 reference's own error is 2^29 times smaller.

    Two fp32 runs may legitimately differ by up to twice this: the interpreter's ``tl.dot`` is numpy's
    BLAS, whose micro-kernels sum a tile column in an order that can depend on the column's position
    (seen with OpenBLAS's AVX2 kernels), so a key row computed in another tile column (another
    ``col0``) rounds differently. Compare each run with the reference under this bound, never two runs
    bitwise. A wrong key row, query row or head is off by O(score), far above it.
    """
    q, w, keys = (case[n].double().abs() for n in ("q", "w", "keys"))
    n = q.shape[2] + q.shape[1]
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    return gamma * torch.einsum("th,thd,gd->tg", w, q, keys)


def assert_within_rounding(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, msg: str) -> None:
    """``got`` has ``ref``'s ``-inf`` pattern and is within ``bound`` of ``ref`` everywhere else."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{msg}: -inf pattern differs"
    finite = torch.isfinite(ref)
    assert finite.any(), f"{msg}: no visible score to compare"
    err = (got.double() - ref)[finite].abs()
    worst = (err / bound[finite]).nan_to_num(nan=float("inf")).max().item()
    assert (err <= bound[finite]).all(), f"{msg}: error {err.max().item():.2e}, {worst:.2f}x the fp32 rounding bound"


def triton_topk(case, k: int, **kw) -> torch.Tensor:
    return indexer_topk_triton(case["q"], case["w"], case["keys"], case["query_doc"], case["query_limit"],
                               case["key_doc"], case["key_j"], k, **kw)


def assert_equivalent_selection(ours, ref, scores, tol, msg, min_identical=0.0):
    """Same number of valid entries per row, the rows selected in increasing order, every selected entry
    visible, and the k-th best (reference) score of ours within ``tol`` (relative to the row's scale) of
    the reference's: the selections can differ only between near-tied entries."""
    assert ours.shape == ref.shape and ours.dtype == torch.int64, msg
    ours, ref, scores = ours.cpu(), ref.cpu(), scores.cpu().double()
    assert torch.equal((ours >= 0).sum(1), (ref >= 0).sum(1)), f"{msg}: valid counts differ"
    valid = ours >= 0
    assert torch.equal(valid, (ref >= 0)), f"{msg}: -1 padding must trail"
    sel = torch.gather(scores, 1, ours.clamp_min(0))
    assert torch.isfinite(sel[valid]).all(), f"{msg}: an invisible entry was selected"
    inc = ours[:, 1:] > ours[:, :-1]
    assert (inc | ~valid[:, 1:]).all(), f"{msg}: rows must be increasing"
    ref_sel = torch.gather(scores, 1, ref.clamp_min(0))
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    kth_ours = torch.where(valid, sel, inf).amin(1)
    kth_ref = torch.where(valid, ref_sel, inf).amin(1)
    rows = valid.any(1)
    scale = torch.where(torch.isfinite(scores), scores.abs(), 0).amax(1).clamp_min(1e-30)
    gap = ((kth_ours - kth_ref).abs() / scale)[rows]
    assert gap.numel() == 0 or gap.max().item() <= tol, f"{msg}: k-th best score off by {gap.max().item():.2e}"
    identical = (ours == ref).all(1).double().mean().item()
    assert identical >= min_identical, f"{msg}: only {identical:.3f} of the rows select identical entries"


# ---------------------------------------------------------------------------------------------- CPU tests
CPU_CASES = [  # (t, hi, di, entries per document, cp)
    (24, 4, 32, [9, 5, 14], 3),
    (17, 2, 16, [20, 3], 2),
    (24, 3, 32, [40], 1),
]


@pytest.mark.parametrize("t,hi,di,entries,cp", CPU_CASES)
def test_score_matrix_matches_reference(t, hi, di, entries, cp, seed):
    case = make_case(seed, t, hi, di, entries, cp, integer=False)
    ref = reference_scores(case)
    got = indexer_score_matrix(**case)
    bound = rounding_bound(case)
    msg = f"seed={seed}"
    assert got.dtype == torch.float32 and got.shape == ref.shape, msg
    assert_within_rounding(got, ref, bound, msg)
    # a column window, off the tile grid and short of G: the same scores, up to rounding (its key rows
    # sit in other tile columns); it holds the median visible key row, so values are compared
    g = ref.shape[1]
    seen = torch.isfinite(ref).any(0).nonzero().flatten()
    mid = int(seen[seen.numel() // 2])
    col0 = min(mid, g // 3)
    window = slice(col0, col0 + min(max(mid - col0 + 1, g // 2), g - col0))
    part = indexer_score_matrix(**case, col0=window.start, width=window.stop - window.start)
    assert part.shape == (t, window.stop - window.start), msg
    assert_within_rounding(part, ref[:, window], bound[:, window], f"{msg} window {window}")


HEAD_PAIR_CASES = [  # (t, hi, di, entries per document, cp): even, odd (a last unpaired head), one head only
    (24, 4, 32, [9, 5, 14], 3),
    (20, 5, 16, [20, 3], 2),
    (17, 1, 16, [12, 8], 2),
]


@pytest.mark.parametrize("t,hi,di,entries,cp", HEAD_PAIR_CASES)
def test_head_pairs_score_matrix_matches_reference(t, hi, di, entries, cp, seed):
    """The score kernel's head-pair loop (``head_pairs``): normal inputs within the fp32 rounding bound of
    the reference; integer inputs (every score exact) equal to it and to the one-head loop, ``-inf``
    pattern included, also on 16 x 16 tiles, some of which see no key at all (zero head iterations)."""
    case = make_case(seed, t, hi, di, entries, cp, integer=False)
    got = indexer_score_matrix(**case, head_pairs=True)
    assert_within_rounding(got, reference_scores(case), rounding_bound(case), f"seed={seed}")
    exact = make_case(seed, t, hi, di, entries, cp, integer=True)
    ref = reference_scores(exact)
    tile = IndexerConfig(16, 16, 4, 1)
    for config in (None, tile):
        paired = indexer_score_matrix(**exact, config=config, head_pairs=True)
        plain = indexer_score_matrix(**exact, config=config)
        assert torch.equal(paired.double(), ref), f"seed={seed} config={config}: head pairs differ from the reference"
        assert torch.equal(paired, plain), f"seed={seed} config={config}: head pairs differ from one head at a time"
    ragged = torch.cat([ref, ref.new_full((-t % 16, ref.shape[1]), float("-inf"))])
    ragged = torch.cat([ragged, ragged.new_full((ragged.shape[0], -ref.shape[1] % 16), float("-inf"))], 1)
    blind_tiles = torch.isneginf(ragged).unflatten(0, (-1, 16)).unflatten(2, (-1, 16)).all(3).all(1)
    assert blind_tiles.any() and not blind_tiles.all(), f"seed={seed}: the case needs tiles that see no key"


@pytest.mark.parametrize("t,hi,di,entries,cp", HEAD_PAIR_CASES)
def test_head_pairs_topk_identical_with_exact_scores(t, hi, di, entries, cp, seed):
    """The op with ``triton_indexer_head_pairs`` selects exactly the reference's entries (ties included)."""
    case = make_case(seed, t, hi, di, entries, cp, integer=True)
    options = KernelOptions(triton_indexer_head_pairs=True)
    for k in (1, 5, 40):
        got = triton_topk(case, k, options=options)
        assert torch.equal(got, reference_topk(case, k)), f"seed={seed} k={k}: head pairs select differently"


@pytest.mark.parametrize("k", [1, 4, 9, 40])
@pytest.mark.parametrize("t,hi,di,entries,cp", CPU_CASES)
def test_topk_identical_with_exact_scores_and_ties(t, hi, di, entries, cp, k, seed):
    case = make_case(seed, t, hi, di, entries, cp, integer=True)
    ref = reference_topk(case, k)
    got = triton_topk(case, k)
    scores = reference_scores(case)
    finite = scores[torch.isfinite(scores)]
    assert (finite == 0).any(), f"seed={seed}: the case must hold exact-zero scores"
    assert torch.equal(got, ref), f"seed={seed} k={k}: selections differ\n{got}\n{ref}"


@pytest.mark.parametrize("t,hi,di,entries,cp", CPU_CASES)
def test_packed_and_scores_buffers_select_identically_with_ties(t, hi, di, entries, cp, seed, monkeypatch):
    """``DSV4CP_TOPK_KEYS``, resolved into the options the op takes: the score kernel's packed-key epilogue
    and the fp32 buffer + ``select_top`` choose exactly the reference's entries, ties included, also over
    many small chunks."""
    case = make_case(seed, t, hi, di, entries, cp, integer=True)
    for k in (1, 4, 9, 40):
        ref = reference_topk(case, k)
        monkeypatch.setenv(TOPK_SELECT_ENV, "torch")  # the keys choice applies to the torch selection only
        for mode in ("packed", "scores"):
            monkeypatch.setenv(TOPK_KEYS_ENV, mode)
            for chunk in (None, 5):
                got = triton_topk(case, k, chunk=chunk, impl="chunked", options=KernelOptions.resolve())
                assert torch.equal(got, ref), f"seed={seed} k={k} {mode} chunk={chunk}\n{got}\n{ref}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0 in tl.dot
def test_packed_keys_are_the_packed_score_matrix(seed):
    """The packed epilogue writes exactly ``pack_selection_keys`` of the fp32 scores of the same chunk
    (same plan and tiles, so the same bits), also where a key row of +inf entries, seen by a query with
    positive q, makes the visible score +-inf or NaN (folded to ``-inf``). Normal inputs: every score
    bit is compared."""
    case = make_case(seed, 24, 3, 16, [11, 2, 9, 6], 1, integer=False)
    seen = torch.isfinite(reference_scores(case))
    row, poisoned = (int(i) for i in seen.nonzero()[0])
    q, keys = case["q"].clone(), case["keys"].clone()
    q[row] = q[row].abs()
    keys[poisoned] = float("inf")
    case = dict(case, q=q, keys=keys)
    scores = [(s, e, col0, block.clone()) for s, e, col0, block in iter_score_chunks(**case, chunk=7)]
    packed = [(s, e, col0, block.clone()) for s, e, col0, block in iter_score_chunks(**case, chunk=7, packed=True)]
    assert len(packed) == len(scores) >= 3, (len(packed), len(scores))
    poisoned_packed = False
    for (s, e, col0, block), (*where, fp32) in zip(packed, scores):
        assert (s, e, col0) == tuple(where) and block.dtype == torch.int64, (s, e, col0, where, block.dtype)
        assert torch.equal(block, pack_selection_keys(fp32)), f"seed={seed} rows [{s}, {e}) col0={col0}"
        if s <= row < e:
            assert not torch.isfinite(fp32[row - s, poisoned - col0]), f"seed={seed}: the score must be non-finite"
            poisoned_packed = True
    assert poisoned_packed, f"seed={seed}: the non-finite score was not in any chunk"


def test_bad_topk_keys_env_is_named(seed, monkeypatch):
    case = make_case(seed, 8, 2, 16, [6], 1, integer=True)
    with pytest.raises(ValueError, match="^keys_mode:"):
        triton_topk(case, 2, impl="chunked", keys_mode="int64")
    monkeypatch.setenv(TOPK_KEYS_ENV, "int64")
    with pytest.raises(ValueError, match=TOPK_KEYS_ENV):
        KernelOptions.resolve()


@pytest.mark.parametrize("t,hi,di,entries,cp", CPU_CASES)
def test_topk_matches_reference_random_normal(t, hi, di, entries, cp, seed):
    case = make_case(seed, t, hi, di, entries, cp, integer=False)
    scores = reference_scores(case)
    for k in (3, 8):
        got, ref = triton_topk(case, k), reference_topk(case, k)
        assert_equivalent_selection(got, ref, scores, 1e-5, f"seed={seed} k={k}", min_identical=0.8)


def test_topk_chunking_and_budget_do_not_change_the_selection(seed):
    case = make_case(seed, 24, 3, 16, [11, 2, 9, 6], 3, integer=True)
    k = 5
    ref = reference_topk(case, k)
    assert torch.equal(triton_topk(case, k), ref), f"seed={seed}"
    for chunk, budget in ((1, None), (5, None), (7, 4 * 32 * 6), (None, 1)):
        got = triton_topk(case, k, chunk=chunk, budget_bytes=budget, impl="chunked")
        assert torch.equal(got, ref), f"seed={seed} chunk={chunk} budget={budget}"
    got = triton_topk(case, k, config=IndexerConfig(16, 16, 4, 1))
    assert torch.equal(got, ref), f"seed={seed}: pinned 16x16 tiles"


def test_strided_inputs_and_int32_metadata(seed):
    case = make_case(seed, 20, 3, 32, [9, 7], 2, integer=True)
    ref = reference_topk(case, 4)
    q_heads_major = case["q"].transpose(0, 1).contiguous().transpose(0, 1)  # [T, Hi, Di] view, stride(2) == 1
    q_dim_major = case["q"].permute(0, 2, 1).contiguous().permute(0, 2, 1)  # last dim strided
    w_t = case["w"].t().contiguous().t()
    ints = {n: case[n].to(torch.int32) for n in ("query_doc", "query_limit", "key_doc", "key_j")}
    for q in (q_heads_major, q_dim_major):
        got = triton_topk(dict(case, q=q, w=w_t, **ints), 4)
        assert torch.equal(got, ref), f"seed={seed} strides={q.stride()}"


CP_PACKINGS = [([9, 13, 2], 24), ([5, 0, 18, 1], 24), ([24], 24), ([3, 7, 4], 24)]


@pytest.mark.parametrize("lengths,total", CP_PACKINGS)
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_topk_on_cp_layouts_matches_reference(lengths, total, cp, seed):
    """Real per-rank layouts (DESIGN 3.3): visibility from RankLayout.visible_mask vs (doc, limit)."""
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths(lengths, total=total)
    gen = torch.Generator().manual_seed(seed)
    for rank in range(cp):
        lay = build_layout(packed, cfg, 4, rank, cp)
        rows, g, hi, di = lay.rows, lay.gathered_rows, 3, 16
        values = torch.tensor([-2.0, -1.0, 1.0, 2.0])
        q = values[torch.randint(0, 4, (rows, hi, di), generator=gen)]
        w = torch.tensor([-0.5, 0.5, 1.0])[torch.randint(0, 3, (rows, hi), generator=gen)]
        keys = values[torch.randint(0, 4, (g, di), generator=gen)]
        doc, pos = lay.local_doc, lay.local_pos
        def visible(sl, lay=lay, doc=doc, pos=pos):
            return lay.visible_mask(doc[sl], pos[sl])

        for k in (2, 6):
            ref = indexer_topk(q, w, keys, visible, k)
            got = indexer_topk_triton(q, w, keys, doc, query_limits(doc, pos), lay.gathered_doc, lay.gathered_j, k)
            assert torch.equal(got, ref), f"seed={seed} rank={rank}/{cp} k={k}"


def test_key_ranges_bound_exactly_the_visible_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(5):
        g, t, n_docs = 40, 30, 4
        key_doc = torch.randint(-1, n_docs, (g,), generator=gen)
        key_j = torch.zeros(g, dtype=torch.int64)
        for d in range(n_docs):  # entry numbers per document, in a random row order (not monotone)
            rows = (key_doc == d).nonzero().flatten()
            key_j[rows] = torch.randperm(rows.numel(), generator=gen)
        qdoc = torch.randint(-1, n_docs, (t,), generator=gen)
        qlim = torch.randint(-1, 14, (t,), generator=gen)
        lo, hi = key_ranges(qdoc, qlim, key_doc, key_j)
        vis = (qdoc[:, None] >= 0) & (key_doc[None, :] == qdoc[:, None]) & (key_j[None, :] < qlim[:, None])
        cols = torch.arange(g)
        for i in range(t):
            seen = cols[vis[i]]
            want = (seen.min().item(), seen.max().item() + 1) if seen.numel() else (0, 0)
            assert (lo[i].item(), hi[i].item()) == want, f"seed={seed} query {i}"


def test_plan_chunks_cover_rows_and_respect_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    t = 300
    lo = torch.randint(0, 500, (t,), generator=gen)
    hi = lo + torch.randint(0, 400, (t,), generator=gen)
    hi[torch.rand(t, generator=gen) < 0.2] = 0  # rows that see nothing
    lo = torch.where(hi > 0, lo, 0)
    for budget, cap in ((10**9, None), (32 * 40_000, None), (32 * 5_000, 16), (1, None), (10**9, 7)):
        plan = plan_chunks(lo, hi, budget, cap)
        assert plan[0][0] == 0 and plan[-1][1] == t, f"seed={seed}"
        for (s, e, col0, width), nxt in zip(plan, plan[1:] + [(t, t, 0, 0)]):
            assert e == nxt[0] and e > s, f"seed={seed}: chunks must tile the rows"
            fits = (e - s) * width * TOPK_BYTES_PER_SCORE <= budget
            assert (e - s) == 1 or fits, f"seed={seed}: budget {budget} exceeded"
            assert cap is None or e - s <= cap, f"seed={seed}"
            live = hi[s:e] > lo[s:e]
            if live.any():
                assert col0 <= lo[s:e][live].min() and hi[s:e][live].max() <= col0 + width, f"seed={seed}"
            else:
                assert width == 0, f"seed={seed}"


def test_bf16_and_fp16_through_the_interpreter(seed):
    for dtype in (torch.bfloat16, torch.float16):
        case = make_case(seed, 20, 4, 32, [12, 8], 2, integer=False, dtype=dtype)
        ref = reference_scores(case)  # fp64 of the rounded inputs
        got = indexer_score_matrix(**case)  # the interpreter multiplies the rounded inputs in fp32
        assert_within_rounding(got, ref, rounding_bound(case), f"seed={seed} {dtype}")
        got_k = triton_topk(case, 6)
        assert_equivalent_selection(got_k, reference_topk(case, 6), ref, 1e-5, f"seed={seed} {dtype}")


def test_edge_cases_no_keys_no_queries_nothing_visible(seed):
    case = make_case(seed, 10, 2, 16, [6, 4], 2, integer=True)
    k = 50  # more than every document has: the rest is -1
    assert torch.equal(triton_topk(case, k), reference_topk(case, k)), f"seed={seed}"
    blind = dict(case, query_limit=torch.zeros_like(case["query_limit"]))
    assert (triton_topk(blind, 3) == -1).all()
    assert list(iter_score_chunks(**blind)) == []
    empty = dict(case, keys=case["keys"][:0], key_doc=case["key_doc"][:0], key_j=case["key_j"][:0])
    assert torch.equal(triton_topk(empty, 3), torch.full((10, 3), -1, dtype=torch.int64))
    none = {n: (v[:0] if n in ("q", "w", "query_doc", "query_limit") else v) for n, v in case.items()}
    assert triton_topk(none, 3).shape == (0, 3)


def _mutations():
    def set_(name, value):
        return lambda c: dict(c, **{name: value(c)})

    return [
        (set_("q", lambda c: c["q"][0]), "q"),
        (set_("q", lambda c: c["q"][..., :24].contiguous()), "q"),  # Di not a multiple of 16
        (set_("q", lambda c: c["q"].double()), "q"),
        (set_("w", lambda c: c["w"][:, :1]), "w"),
        (set_("w", lambda c: c["w"].to(torch.int32)), "w"),
        (set_("keys", lambda c: c["keys"][:, :16]), "keys"),
        (set_("keys", lambda c: c["keys"].half()), "keys"),
        (set_("query_doc", lambda c: c["query_doc"][1:]), "query_doc"),
        (set_("query_limit", lambda c: c["query_limit"].float()), "query_limit"),
        (set_("key_doc", lambda c: c["key_doc"][:, None]), "key_doc"),
        (set_("key_j", lambda c: c["key_j"][1:]), "key_j"),
    ]


@pytest.mark.parametrize("mutate,field", _mutations())
def test_invalid_inputs_raise_naming_the_field(mutate, field, seed):
    case = mutate(make_case(seed, 6, 2, 32, [5], 1, integer=True))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        triton_topk(case, 2)


def test_invalid_arguments_raise(seed):
    case = make_case(seed, 6, 2, 32, [5], 1, integer=True)
    with pytest.raises(ValueError, match="^k:"):
        triton_topk(case, 0)
    with pytest.raises(ValueError, match="^chunk:"):
        triton_topk(case, 2, chunk=0)
    with pytest.raises(ValueError, match="^budget_bytes:"):
        triton_topk(case, 2, budget_bytes=0)
    with pytest.raises(ValueError, match="block_n"):
        triton_topk(case, 2, config=IndexerConfig(16, 24, 4, 1))
    with pytest.raises(ValueError, match="^idx:"):
        indexer_scores_triton(case["q"], case["w"], case["keys"], torch.zeros(6, 2))


@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_scores_forward_and_gradients_match_torch(deterministic, seed):
    q, w, keys, idx, grad = scores_case(seed)
    t, kk = idx.shape
    if deterministic:
        idx = idx.to(torch.int32)
    results = []
    for fn in (indexer_scores_triton, indexer_scores):
        leaves = [x.clone().requires_grad_(True) for x in (q, w, keys)]
        if fn is indexer_scores_triton:
            set_deterministic(deterministic)
        try:
            out = fn(*leaves, idx)
            (out * grad * (idx >= 0)).sum().backward()
        finally:
            set_deterministic(False)
        results.append((out.detach(), *(x.grad for x in leaves)))
    (o1, dq1, dw1, dk1), (o2, dq2, dw2, dk2) = results
    msg = f"seed={seed} deterministic={deterministic}"
    assert o1.dtype == torch.float32 and o1.shape == (t, kk), msg
    valid = idx >= 0
    assert torch.allclose(o1[valid], o2[valid], rtol=1e-5, atol=1e-5), msg
    assert (o1[~valid] == 0).all(), f"{msg}: empty slots score 0"
    for name, a, b in (("dq", dq1, dq2), ("dw", dw1, dw2), ("dkeys", dk1, dk2)):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"{msg}: {name}"


def scores_case(seed: int, t: int = 12, hi: int = 3, di: int = 32, g: int = 20, kk: int = 21):
    """Random fp32 ``q, w, keys, idx, grad`` (never zeros): a quarter of the slots empty (-1), one query
    with no slot at all, and repeated key rows within queries (their key gradients add)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hi, di, generator=gen)
    w = torch.randn(t, hi, generator=gen)
    keys = torch.randn(g, di, generator=gen)
    idx = selection_with_gaps(gen, t, g, kk)
    grad = torch.randn(t, kk, generator=gen)
    return q, w, keys, idx, grad


def selection_with_gaps(gen: torch.Generator, t: int, g: int, kk: int) -> torch.Tensor:
    """``[t, kk]`` int64 key rows in ``[0, g)`` drawn from ``gen``: about a quarter of the slots empty (-1),
    query 2 with no slot at all, and every third query's last slot repeating its first."""
    idx = torch.randint(0, g, (t, kk), generator=gen)
    idx[torch.rand(t, kk, generator=gen) < 0.25] = -1
    idx[2] = -1
    idx[::3, -1] = idx[::3, 0]
    return idx


def scores_and_grads(fn, q, w, keys, idx, grad, **kw):
    """``(out, dq, dw, dkeys)`` of ``fn(q, w, keys, idx, **kw)`` under the loss ``sum(out * grad)`` over
    the valid slots; ``out`` zeroed at the empty ones (the torch op scores them at row -1)."""
    leaves = [x.clone().requires_grad_(True) for x in (q, w, keys)]
    out = fn(*leaves, idx, **kw)
    (out * grad * (idx >= 0)).sum().backward()
    return (out.detach().masked_fill(idx < 0, 0.0), *(x.grad for x in leaves))


@pytest.mark.parametrize("cfg", [GatherBwdConfig(32, 4, 1, False), GatherBwdConfig(16, 8, 2, True),
                                 GatherBwdConfig(64, 8, 2)], ids=str)
def test_indexer_scores_pinned_backward_matches_torch(cfg, seed, monkeypatch):
    """Every backward variant (relaxed or acq_rel atomics, one or several slot blocks per query), pinned
    by keyword and by the environment (resolved into options, handed over as the op does), gives torch's
    gradients."""
    q, w, keys, idx, grad = scores_case(seed)
    ref = scores_and_grads(indexer_scores, q, w, keys, idx, grad)
    got_kw = scores_and_grads(indexer_scores_triton, q, w, keys, idx, grad, bwd_config=cfg)
    monkeypatch.setenv(BWD_CONFIG_ENV, f"{cfg.block_k},{cfg.num_warps},{cfg.num_stages},{int(cfg.relaxed_atomics)}")
    got_env = scores_and_grads(indexer_scores_triton, q, w, keys, idx, grad,
                               **scores_backward_keywords(KernelOptions.resolve()))
    assert (idx < 0).any() and (indexer_scores_triton(q, w, keys, idx)[idx < 0] == 0).all(), f"seed={seed}"
    for how, got in (("keyword", got_kw), ("env", got_env)):
        for name, a, b in zip(("out", "dq", "dw", "dkeys"), got, ref):
            msg = f"seed={seed} {cfg} {how}: {name}"
            assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5), msg


def test_indexer_scores_backward_ladder_is_checked():
    """The default bf16 ladder: valid tiles, relaxed atomics, the H200's fastest first, no tile twice."""
    assert GATHER_BWD_CONFIGS[0] == (32, 4, 2)
    assert len(set(GATHER_BWD_CONFIGS)) == len(GATHER_BWD_CONFIGS)
    for tile in GATHER_BWD_CONFIGS:
        cfg = GatherBwdConfig(*tile)
        assert cfg.relaxed_atomics is True
        assert cfg.block_k >= 16 and cfg.block_k & (cfg.block_k - 1) == 0, tile


@pytest.mark.parametrize("cfg,env,match", [
    (GatherBwdConfig(24, 4, 1), None, r"^bwd_config\.block_k:"),
    (GatherBwdConfig(32, 0, 1), None, r"^bwd_config: num_warps"),
    (GatherBwdConfig(32, 4, 1, 2), None, r"^bwd_config: relaxed_atomics"),
    (None, "32,4,1", rf"^{BWD_CONFIG_ENV}:"),
    (None, "32,4,1,3", rf"^{BWD_CONFIG_ENV}\.relaxed_atomics"),
    (None, "8,4,1,1", rf"^{BWD_CONFIG_ENV}\.block_k:"),
])
def test_indexer_scores_bad_backward_config_raises_before_work(cfg, env, match, seed, monkeypatch):
    """A bad pin by keyword fails at the call (before the backward), by its variable where the options are
    resolved."""
    q, w, keys, idx, _ = scores_case(seed, t=4, kk=5)
    if env is not None:
        monkeypatch.setenv(BWD_CONFIG_ENV, env)
        with pytest.raises(ValueError, match=match):
            KernelOptions.resolve()
        return
    leaf = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=match):
        indexer_scores_triton(leaf, w, keys, idx, bwd_config=cfg)  # at the call, not at backward
    assert leaf.grad is None


def test_indexer_scores_deterministic_backward_is_bitwise_reproducible(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(10, 2, 16, generator=gen)
    w = torch.randn(10, 2, generator=gen)
    keys = torch.randn(6, 16, generator=gen)
    idx = torch.randint(-1, 6, (10, 17), generator=gen)  # few rows, many repeats
    grads = []
    set_deterministic(True)
    try:
        for _ in range(2):
            k = keys.clone().requires_grad_(True)
            indexer_scores_triton(q, w, k, idx).sum().backward()
            grads.append(k.grad)
    finally:
        set_deterministic(False)
    assert torch.equal(grads[0], grads[1]), f"seed={seed}"


# ---------------------------------------------------------------------------------------------- GPU tests
def gpu_case(seed: int, t: int, docs: list[int], dtype=torch.bfloat16, hi: int = 64, di: int = 128):
    """Query rows of packed documents (``docs`` = lengths, summing to t), keys = every entry of every
    document (G = t/4) in a rank-major gathered order with capacity padding (cp = 2). Inputs scaled
    like the model's (unit-RMS q and keys, w ~ N(0,1) / sqrt(Hi Di))."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qdoc = torch.cat([torch.full((n,), d) for d, n in enumerate(docs)]).cuda()
    pos = torch.cat([torch.arange(n) for n in docs]).cuda()
    entries = [n // 4 for n in docs]
    order = [(d, j) for d, n in enumerate(entries) for j in range(n)]
    half = (len(order) + 1) // 2
    cap = half + 7
    key_doc = torch.full((2 * cap,), -1, dtype=torch.int64)
    key_j = torch.zeros(2 * cap, dtype=torch.int64)
    for r, part in enumerate((order[:half], order[half:])):
        if part:
            ds, js = zip(*part)
            key_doc[r * cap:r * cap + len(part)] = torch.tensor(ds)
            key_j[r * cap:r * cap + len(part)] = torch.tensor(js)
    g = key_doc.numel()
    q = torch.randn(t, hi, di, device="cuda", generator=gen).to(dtype)
    keys = torch.randn(g, di, device="cuda", generator=gen).to(dtype)
    w = torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5
    return {"q": q, "w": w, "keys": keys, "query_doc": qdoc, "query_limit": query_limits(qdoc, pos),
            "key_doc": key_doc.cuda(), "key_j": key_j.cuda()}


def chunked_scores(case, step: int = 256) -> torch.Tensor:
    """fp32 masked reference scores ``[T, G]`` built ``step`` queries at a time (no [T, Hi, G] tensor)."""
    q, w, keys = case["q"].float(), case["w"].float(), case["keys"].float()
    vis = visible_of(case)
    out = torch.empty(vis.shape, dtype=torch.float32, device=q.device)
    for s in range(0, q.shape[0], step):
        dots = torch.einsum("thd,gd->thg", q[s:s + step], keys).relu_()
        out[s:s + step] = torch.einsum("thg,th->tg", dots, w[s:s + step])
    return out.masked_fill_(~vis, float("-inf"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("docs", [[8192], [3000, 100, 5000, 92]], ids=["one-doc", "four-docs"])
def test_gpu_topk_bf16_full_size(docs, seed):
    case = gpu_case(seed, 8192, docs)
    k = 512
    got = triton_topk(case, k, impl="chunked")
    ref = reference_topk(case, k)
    scores = chunked_scores(case)
    assert_equivalent_selection(got, ref, scores, 1e-3, f"seed={seed}", min_identical=0.5)
    small = triton_topk(case, k, budget_bytes=64 * 2**20, impl="chunked")  # many chunks: the same selection
    assert torch.equal(small, got), f"seed={seed}: chunking changed the selection"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("docs", [[8192], [3000, 100, 5000, 92]], ids=["one-doc", "four-docs"])
def test_gpu_packed_keys_select_what_the_fp32_scores_select(docs, seed, monkeypatch):
    """bf16 at full size: the kernel's packed-key epilogue and the fp32 buffer + ``select_top`` choose the
    same entries bitwise (the same products: only the epilogue and the chunking differ)."""
    case = gpu_case(seed, 8192, docs)
    monkeypatch.setenv(TOPK_SELECT_ENV, "torch")  # the keys choice applies to the torch selection only
    got = {}
    for mode in ("packed", "scores"):
        monkeypatch.setenv(TOPK_KEYS_ENV, mode)
        got[mode] = triton_topk(case, 512, impl="chunked")
    assert torch.equal(got["packed"], got["scores"]), f"seed={seed}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_exact_ties_match_reference(seed):
    case = make_case(seed, 600, 8, 64, [40, 90, 10], 3, integer=True, device="cuda")
    for k in (1, 16, 64):
        assert torch.equal(triton_topk(case, k), reference_topk(case, k)), f"seed={seed} k={k}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_indexer_scores_bf16(deterministic, seed):
    case = gpu_case(seed, 4096, [4096])
    k = 512
    idx = triton_topk(case, k)
    q, w, keys = case["q"], case["w"], case["keys"]
    grad = torch.randn(idx.shape, device="cuda") * (idx >= 0)
    outs = []
    for fn in (indexer_scores_triton, indexer_scores):
        leaves = [x.clone().requires_grad_(True) for x in (q, w, keys)]
        set_deterministic(deterministic and fn is indexer_scores_triton)
        try:
            out = fn(*leaves, idx)
            (out * grad).sum().backward()
        finally:
            set_deterministic(False)
        outs.append((out.detach().float(), *(x.grad.float() for x in leaves)))
    for name, a, b in zip(("out", "dq", "dw", "dkeys"), outs[0], outs[1]):
        if name == "out":
            a, b = a[idx >= 0], b[idx >= 0]
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        assert cos > 1 - 1e-3, f"seed={seed} {name}: cosine {cos}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tile", [(*t, 1) for t in GATHER_BWD_CONFIGS] + [(64, 8, 2, 0)],
                         ids=lambda t: "x".join(map(str, t)))
def test_gpu_indexer_scores_backward_tiles_bf16(tile, seed):
    """Every heads-on-M ladder tile (relaxed atomics) and the original acq_rel kernel, pinned, against the
    torch op: bf16 at Hi = 64, Di = 128, K = 512 selected entries (repeated key rows across queries). The
    keys-on-M kernel's tiles: tests/kernels/test_indexer_scores_layouts.py."""
    case = gpu_case(seed, 2048, [2048])
    idx = triton_topk(case, 512)
    grad = torch.randn(idx.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    cfg = GatherBwdConfig(*tile[:3], relaxed_atomics=bool(tile[3]))
    args = (case["q"], case["w"], case["keys"], idx, grad)
    got = scores_and_grads(indexer_scores_triton, *args, bwd_config=cfg, layout="heads_on_m")
    ref = scores_and_grads(indexer_scores, *args)
    for name, a, b in zip(("out", "dq", "dw", "dkeys"), got, ref):
        cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()
        assert cos > 1 - 1e-3, f"seed={seed} {cfg} {name}: cosine {cos}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tile", [(64, 128, 4, 3), (64, 128, 8, 3)], ids=lambda t: "x".join(map(str, t)))
def test_gpu_head_pairs_score_the_same_as_one_head_at_a_time(tile, seed):
    """bf16 at full size (T = 8192, Hi = 64, Di = 128, four documents): under one pinned tile the head-pair
    loop's scores equal the one-head loop's bitwise (the same products, summed over the heads in the same
    order), and the op with ``triton_indexer_head_pairs`` selects what the fp32 reference selects up to
    near-ties."""
    case = gpu_case(seed, 8192, [3000, 100, 5000, 92])
    config = IndexerConfig(*tile)
    plain = indexer_score_matrix(**case, config=config)
    paired = indexer_score_matrix(**case, config=config, head_pairs=True)
    finite = torch.isfinite(plain)
    assert torch.equal(torch.isfinite(paired), finite), f"seed={seed} {tile}: the -inf pattern differs"
    gap = (paired[finite] - plain[finite]).abs().max().item()
    assert torch.equal(paired, plain), f"seed={seed} {tile}: head pairs differ from one head at a time by {gap:.3e}"
    got = triton_topk(case, 512, options=KernelOptions(triton_indexer_head_pairs=True))
    assert_equivalent_selection(got, reference_topk(case, 512), chunked_scores(case), 1e-3, f"seed={seed}",
                                min_identical=0.5)
