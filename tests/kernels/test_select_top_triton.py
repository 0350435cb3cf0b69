"""The Triton radix select (:func:`dsv4cp.kernels.select_top_triton.select_top_triton`) against the
selection contract :func:`dsv4cp.kernels.contracts.select_top`: the answers must be IDENTICAL.

CPU (Triton's interpreter, tiny rows, ``BLOCK = 32`` columns per step so every row takes several steps):
many ties (ReLU zeros, values from a small set, duplicates straddling the cut), ``-inf`` masks (causal
prefixes), NaN / +inf entries, ``-0.0`` vs ``+0.0``, rows with fewer finite scores than ``keep``, every
early exit of the radix passes, ``keep`` 0 / 1 / ``columns``, columns not a multiple of the step, a
strided row view, ``row_limit`` on and off (the same answer, and columns past the bound never read),
the chunked top-k wired to it, and bad arguments (``ValueError`` naming them).

GPU (marked ``gpu``): flash-like rows (512 rows x 16384 columns, keep 512, scores rounded through bf16
with half ReLU zeros and causal ``-inf`` tails) under every ladder configuration and an 11-bit-digit one;
the chunked top-k at T = 8192 (bf16, flash head sizes) selecting with radix what it selects with torch.

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.kernel_options import OPTIONS, KernelOptions
from dsv4cp.kernels.contracts import select_top
from dsv4cp.kernels.select_top_triton import (
    BOUNDED_SELECT_CONFIGS,
    SELECT_CONFIG_ENV,
    SELECT_CONFIGS,
    SELECT_VARIANTS,
    SelectConfig,
    select_config_ladder,
    select_top_triton,
)
from triton_marks import HAS_CUDA, skip_module_without_triton

skip_module_without_triton()


VARIANT_ENV = OPTIONS["topk_select_variant"].env
select_kernel = select_top_triton
"""The kernel itself: the fixture below rebinds ``select_top_triton`` to it with each variant."""


@pytest.fixture(autouse=True, params=SELECT_VARIANTS)
def variant(request, monkeypatch) -> str:
    """Every test runs each radix-select kernel (its ``variant`` keyword: the kernel option
    ``topk_select_variant``)."""
    monkeypatch.setitem(globals(), "select_top_triton", functools.partial(select_kernel, variant=request.param))
    return request.param


def tied_scores(gen: torch.Generator, rows: int, columns: int) -> torch.Tensor:
    """fp32 ``[rows, columns]`` with many exact ties: values from a small set (positive and negative),
    ReLU zeros of both signs, a few distinct values, -inf, NaN and +inf entries."""
    small = torch.tensor([-2.5, -1.0, 0.5, 1.0, 1.5, 3.0])
    scores = small[torch.randint(0, len(small), (rows, columns), generator=gen)]
    distinct = torch.randn(rows, columns, generator=gen)
    scores = torch.where(torch.rand(rows, columns, generator=gen) < 0.3, distinct, scores)
    zeros = torch.rand(rows, columns, generator=gen)
    scores = torch.where(zeros < 0.25, torch.zeros(()), scores)
    scores = torch.where(zeros > 0.9, -torch.zeros(()), scores)  # -0.0 ties +0.0
    odd = torch.rand(rows, columns, generator=gen)
    scores = torch.where(odd < 0.08, float("-inf"), scores)
    scores = torch.where((odd >= 0.08) & (odd < 0.1), float("nan"), scores)
    return torch.where((odd >= 0.1) & (odd < 0.12), float("inf"), scores)


def check(scores: torch.Tensor, keep: int, msg: str, **kwargs) -> torch.Tensor:
    """The selection of ``scores`` equals the contract's, and the scores returned with it are the
    buffer's at the chosen columns bit for bit (0.0 in the ``-1`` slots)."""
    got, values = select_top_triton(scores, keep, return_values=True, **kwargs)
    expected = select_top(scores, keep)
    assert got.dtype == torch.int64 and got.shape == expected.shape, msg
    assert torch.equal(got.cpu(), expected.cpu()), f"{msg} keep={keep}\n{scores}\n{got}\n{expected}"
    gathered = torch.where(expected >= 0, scores.gather(1, expected.clamp_min(0)), 0.0)
    assert values.dtype == torch.float32 and values.shape == expected.shape, msg
    assert torch.equal(values.view(torch.int32).cpu(), gathered.view(torch.int32).cpu()), f"{msg}\n{values}"
    if select_top_triton.keywords["variant"] == "bounded":  # the plain kernel launches the same either way
        assert torch.equal(select_top_triton(scores, keep, **kwargs), got), msg  # the same without the values
    return got


@pytest.mark.parametrize("columns,keep", [(70, 9), (64, 1), (45, 45), (100, 37), (33, 32)])
def test_matches_contract_with_ties(columns, keep, seed):
    gen = torch.Generator().manual_seed(seed)
    check(tied_scores(gen, 5, columns), keep, f"seed={seed}")


def test_duplicates_straddling_the_cut(seed):
    """The keep-th best value repeated on both sides of the cut, so only the lowest columns of the tie
    are taken; the tie sits in the middle of its row's steps."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, 96, generator=gen).abs() - 3.0  # all below the tied value
    for r in range(4):
        ties = torch.randperm(96, generator=gen)[:12]
        scores[r, ties] = 0.75
        scores[r, ties[:3]] = 2.0 + r  # 3 above the tie: keep 8 takes 5 of its 12 copies
    check(scores, 8, f"seed={seed}")


def test_signed_zeros_tie_and_negatives_rank_below(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = -torch.rand(3, 40, generator=gen) - 0.1  # negatives only ...
    scores[:, ::5] = 0.0
    scores[:, 2::5] = -0.0  # ... below interleaved signed zeros, which must tie by column
    check(scores, 12, f"seed={seed}")
    scores[1, 7] = -1e-38  # the smallest negative normals and denormals stay below zero
    scores[2, 9] = -1e-44
    check(scores, 20, f"seed={seed}")


def test_causal_masks_and_short_rows(seed):
    """-inf tails of a causal prefix: rows with no, a few and exactly ``keep`` finite scores (the
    take-everything exit) next to rows with many."""
    gen = torch.Generator().manual_seed(seed)
    rows, columns, keep = 9, 80, 10
    scores = torch.relu(torch.randn(rows, columns, generator=gen))  # half exact zeros
    finite = torch.tensor([0, 1, 3, 9, 10, 11, 40, 79, 80])
    scores[torch.arange(columns)[None, :] >= finite[:, None]] = float("-inf")
    got = check(scores, keep, f"seed={seed}")
    assert (got[0] == -1).all() and (got[4] >= 0).all()


def test_non_finite_never_chosen(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 50, generator=gen)
    scores[0, ::2] = float("inf")  # above every finite score, yet never taken
    scores[1, 1::2] = float("nan")
    scores[1, 0] = -float("nan")
    got = check(scores, 30, f"seed={seed}")
    assert (got[0, 25:] == -1).all()


def test_group_exit_and_exact_cut(seed):
    """Pass outcomes: the top digit's whole group taken (no tie pass), and a cut resolved in pass 4
    (values that differ only in their lowest mantissa bits)."""
    gen = torch.Generator().manual_seed(seed)
    group = torch.rand(2, 64, generator=gen) - 4.0  # [-4, -3): one top digit
    group[:, torch.randperm(64, generator=gen)[:6]] = 1000.0 + torch.rand(6, generator=gen)  # another one
    check(group, 6, f"seed={seed}")
    base = torch.tensor(1.25).view(torch.int32)
    low_bits = torch.randint(0, 4, (3, 64), generator=gen, dtype=torch.int32)
    check((base + low_bits).view(torch.float32), 17, f"seed={seed}")


@pytest.mark.parametrize("keep", [0, 1, 37])
def test_keep_extremes_and_columns(keep, seed):
    gen = torch.Generator().manual_seed(seed)
    check(tied_scores(gen, 3, 37), keep, f"seed={seed}")
    assert select_top_triton(torch.empty(0, 37), keep).shape == (0, keep)


def test_strided_row_view(seed):
    """Rows of a view into a wider flat buffer, as the chunked top-k passes them."""
    gen = torch.Generator().manual_seed(seed)
    flat = tied_scores(gen, 4, 90).reshape(-1)
    view = flat[: 4 * 90].view(4, 90)[:, 5:75]  # stride 90, 70 columns
    assert view.stride() == (90, 1)
    check(view, 11, f"seed={seed}")


@pytest.mark.parametrize("base,ratio,row0", [(6, 4, 0), (3, 2, 17), (-5, 1, 3), (200, 1, 0)])
def test_row_limit_same_answer_and_unread(base, ratio, row0, seed):
    """With the causal bound the answer is the same, and columns at or past it are never read: they are
    poisoned with a finite 1e30, which would be chosen first if the kernel read it."""
    gen = torch.Generator().manual_seed(seed)
    rows, columns, keep = 6, 72, 9
    scores = tied_scores(gen, rows, columns)
    limit = (base + (row0 + torch.arange(rows)) // ratio + 1).clamp(0, columns)
    beyond = torch.arange(columns)[None, :] >= limit[:, None]
    scores[beyond] = float("-inf")
    expected = check(scores, keep, f"seed={seed}")
    poisoned = scores.masked_fill(beyond, 1e30)  # would be chosen first if the kernel read it
    got = select_top_triton(poisoned, keep, row_limit=(base, ratio, row0))
    assert torch.equal(got, expected), f"seed={seed}\n{got}\n{expected}"


def test_row_range_same_answer_and_unread(variant, seed):
    """Per-row column ranges (a packed document's key range): the same answer, and the bounded kernel
    never reads outside them (poisoned with a finite 1e30, which would be chosen first); ranges combine
    with ``row_limit`` (the narrower bound holds)."""
    gen = torch.Generator().manual_seed(seed)
    rows, columns, keep = 6, 90, 7
    scores = tied_scores(gen, rows, columns)
    start = torch.tensor([0, 10, 35, 80, 5, 60])
    stop = torch.tensor([90, 40, 50, 90, 5, 200])  # an empty range, one past the columns
    cols = torch.arange(columns)[None, :]
    outside = (cols < start[:, None]) | (cols >= stop[:, None])
    scores[outside] = float("-inf")
    expected = check(scores, keep, f"seed={seed}", row_range=(start, stop))
    assert (expected[4] == -1).all()
    if variant == "bounded":
        poisoned = scores.masked_fill(outside, 1e30)
        got = select_top_triton(poisoned, keep, row_range=(start.to(torch.int32), stop))
        assert torch.equal(got, expected), f"seed={seed}\n{got}\n{expected}"
        limit = (20 + torch.arange(rows) // 1 + 1).clamp(0, columns)  # row_limit (20, 1, 0)
        narrower = poisoned.masked_fill(cols >= limit[:, None], 1e30)
        both = scores.masked_fill(cols >= limit[:, None], float("-inf"))
        got = select_top_triton(narrower, keep, row_limit=(20, 1, 0), row_range=(start, stop))
        assert torch.equal(got, select_top(both, keep)), f"seed={seed}"


@pytest.mark.parametrize("radix_bits", [3, 5, 11, 12])
def test_other_digit_widths(radix_bits, seed):
    """Digit widths that do not divide 32 (the last pass takes the bits left) and the widest, on ties,
    signed zeros and a cut in the lowest mantissa bits."""
    gen = torch.Generator().manual_seed(seed)
    config = SelectConfig(32, radix_bits, 4, 1)
    check(tied_scores(gen, 3, 70), 9, f"seed={seed}", config=config)
    low_bits = torch.randint(0, 4, (2, 40), generator=gen, dtype=torch.int32)
    check((torch.tensor(-1.25).view(torch.int32) + low_bits).view(torch.float32), 13, f"seed={seed}",
          config=config)


def test_config_pins_and_env(monkeypatch, seed):
    """A launch pinned by keyword or by the variable (resolved into options, its integers handed over as
    the op does); bad pins refused, by the variable where resolved, by the keyword at the call."""
    gen = torch.Generator().manual_seed(seed)
    scores = tied_scores(gen, 3, 50)
    check(scores, 7, f"seed={seed}", config=SelectConfig(16, 8, 2, 1))
    monkeypatch.setenv(SELECT_CONFIG_ENV, "64,6,4,1")
    check(scores, 7, f"seed={seed}", config=KernelOptions.resolve().triton_select_config)
    for text, pattern in (("64,4,1", SELECT_CONFIG_ENV), ("48,8,4,1", "block_n")):
        monkeypatch.setenv(SELECT_CONFIG_ENV, text)
        with pytest.raises(ValueError, match=pattern):
            KernelOptions.resolve()
    with pytest.raises(ValueError, match="^config.radix_bits"):
        select_top_triton(scores, 7, config=(64, 13, 4, 1))
    monkeypatch.delenv(SELECT_CONFIG_ENV)
    monkeypatch.setenv(VARIANT_ENV, "heap")
    with pytest.raises(ValueError, match=VARIANT_ENV):
        KernelOptions.resolve()


def test_bounded_pass_zero_cases(seed):
    """The cases of the bounded kernel's pass 0 and its list: a lower bound from the lanes' maxima (rows
    of one binade, where the candidates share sign and exponent), no bound (``keep`` above the lanes, or
    fewer live lanes than ``keep``), every key equal (bound = largest key: the list overflows, the cut is
    found with no pass, from the row), all negative, one finite score more than ``keep``, a dense cluster
    under one large score, and more keys above the bound than the list holds."""
    gen = torch.Generator().manual_seed(seed)
    binade = 1.0 + torch.rand(3, 100, generator=gen)  # [1, 2): one exponent
    check(binade, 9, f"seed={seed}")
    check(binade, 40, f"seed={seed}")  # keep above the interpreter's 32 segments: no bound
    sparse = torch.full((2, 100), float("-inf"))
    sparse[:, torch.randperm(100, generator=gen)[:12]] = torch.randn(2, 12, generator=gen)
    check(sparse, 10, f"seed={seed}")  # 12 finite, in fewer live segments than keep
    check(torch.full((2, 70), 0.5), 9, f"seed={seed}")  # lower bound = largest key: all tied
    check(-torch.rand(2, 90, generator=gen) - 1.0, 11, f"seed={seed}")
    short = torch.full((1, 64), float("-inf"))
    short[0, 5:16] = torch.randn(11, generator=gen)
    check(short, 10, f"seed={seed}")
    # One large score far above a dense cluster: the bits of lb and hi barely agree, the cluster stays in
    # one bin for two more passes (its keys differ in their 12 lowest bits only), the row passes go on
    # until the group fits the list, then the list finishes the cut.
    low_bits = torch.randint(0, 4096, (2, 119), generator=gen, dtype=torch.int32)
    cluster = (torch.tensor(1.0).view(torch.int32) + low_bits).view(torch.float32)
    dense = torch.cat([torch.full((2, 1), 1000.0), cluster], dim=1)
    check(dense, 9, f"seed={seed}")
    # keep close to the interpreter's 32 lanes: ~88 keys above the bound, more than the list holds
    # (keep + 32), so the row passes run first
    check(torch.randn(2, 200, generator=gen), 30, f"seed={seed}")


@pytest.mark.parametrize("trial", range(6))
def test_random_rows(trial, seed):
    """Random shapes, ``keep`` and mixtures (Gaussian, ReLU zeros, a narrow binade, ties, ``-inf`` and
    NaN) against the contract."""
    gen = torch.Generator().manual_seed(seed)
    rows, columns = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(2, 150, (), generator=gen))
    keep = int(torch.randint(1, columns + 1, (), generator=gen))
    scores = torch.randn(rows, columns, generator=gen)
    scores = [scores, scores.relu(), scores.abs() + 8.0, (scores * 2).round(), tied_scores(gen, rows, columns),
              scores.masked_fill(torch.rand(rows, columns, generator=gen) < 0.5, float("-inf"))][trial]
    check(scores, keep, f"seed={seed} trial={trial}")


@pytest.mark.parametrize("kwargs,name", [
    ({"scores": torch.zeros(4)}, "scores"),
    ({"scores": torch.zeros(2, 5, dtype=torch.float64)}, "scores"),
    ({"scores": torch.zeros(5, 2).t()}, "scores"),
    ({"keep": 6}, "keep"),
    ({"keep": -1}, "keep"),
    ({"keep": True}, "keep"),
    ({"row_limit": (1, 0, 0)}, "row_limit"),
    ({"row_limit": (1, 2)}, "row_limit"),
    ({"row_limit": (1, 2, -1)}, "row_limit"),
    ({"config": SelectConfig(32, 8, 0, 1)}, "config"),
    ({"config": SelectConfig(32, 0, 4, 1)}, "radix_bits"),
    ({"variant": "heap"}, "variant"),
    ({"return_values": 1}, "return_values"),
    ({"row_range": (torch.zeros(2, dtype=torch.int64),)}, "row_range"),
    ({"row_range": (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))}, "row_range"),
    ({"row_range": (torch.zeros(2), torch.zeros(2))}, "row_range"),
])
def test_bad_arguments_are_named(kwargs, name):
    args = {"scores": torch.randn(2, 5), "keep": 2, **kwargs}
    scores, keep = args.pop("scores"), args.pop("keep")
    with pytest.raises(ValueError, match=name):
        select_top_triton(scores, keep, **args)


def test_interpreted_ladder_is_small():
    assert select_config_ladder(True)[0].block_n <= 64  # several steps per test row


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant,cfg", [("plain", c) for c in SELECT_CONFIGS + [(2048, 11, 8, 2)]] + [
    ("bounded", c) for c in BOUNDED_SELECT_CONFIGS + [(1024, 4, 4, 2), (1024, 3, 4, 2)]],
    ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_flash_sized_rows_on_gpu(variant, cfg, seed):
    """Rows of the flash shape (half of them zero after the relu, bf16-rounded: heavy ties) under each launch
    of both kernels' ladders and a few narrower digits: exactly ``select_top``'s selection."""
    cfg = SelectConfig(*cfg)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, columns, keep = 512, 16384, 512
    scores = torch.relu(torch.randn(rows, columns, device="cuda", generator=gen)).bfloat16().float()
    base = columns - 600  # causal tails: row r sees columns below base + r + 1 (clamped) ...
    visible = (base + torch.arange(rows, device="cuda") + 1).clamp(max=columns)
    visible[:8] = torch.arange(8, device="cuda") * 100  # ... and a few short rows, some below keep
    scores[torch.arange(columns, device="cuda")[None, :] >= visible[:, None]] = float("-inf")
    expected = select_top(scores, keep)
    got = select_top_triton(scores, keep, config=cfg, variant=variant)
    assert torch.equal(got, expected), f"seed={seed} {variant} {cfg}"
    limited = select_top_triton(scores, keep, config=cfg, row_limit=(base, 1, 0), variant=variant)
    assert torch.equal(limited, expected), f"seed={seed} {variant} {cfg}"


# ------------------------------------------------------------------------------- the chunked top-k
def one_document(gen: torch.Generator, t: int, hi: int, di: int):
    """Inputs of the chunked top-k for one causal document of ``t`` rows and ``t // 4`` entries (integer
    valued: exact-zero scores and ties), as in the CP = 1 layout (bound ``key_row_limit = (0, 4)``)."""
    g = t // 4
    q = torch.randint(-2, 3, (t, hi, di), generator=gen).float()
    w = torch.randint(1, 3, (t, hi), generator=gen).float()
    keys = torch.randint(-2, 3, (g, di), generator=gen).float()
    pos = torch.arange(t)
    return q, w, keys, torch.zeros(t, dtype=torch.int64), (pos + 1) // 4, torch.zeros(g, dtype=torch.int64), \
        torch.arange(g)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's defaults")
@pytest.mark.parametrize("key_row_limit", [None, (0, 4)])
def test_chunked_topk_radix_matches_torch_selection(key_row_limit, monkeypatch, seed):
    from dsv4cp.kernels.indexer_triton import TOPK_SELECT_ENV
    from dsv4cp.ops.indexer import fused_indexer_topk as indexer_topk_triton

    gen = torch.Generator().manual_seed(seed)
    inputs = one_document(gen, 96, 2, 16)
    monkeypatch.delenv(TOPK_SELECT_ENV, raising=False)  # the interpreter's default: torch.topk
    kwargs = {"chunk": 40, "budget_bytes": 4 * 24 * 20, "key_row_limit": key_row_limit, "impl": "chunked",
              "select_variant": select_top_triton.keywords["variant"]}
    expected = indexer_topk_triton(*inputs, 5, **kwargs, options=KernelOptions.resolve())
    assert (expected == -1).any() and (expected >= 0).any()
    monkeypatch.setenv(TOPK_SELECT_ENV, "radix")
    got = indexer_topk_triton(*inputs, 5, **kwargs, options=KernelOptions.resolve())
    assert torch.equal(got, expected), f"seed={seed}\n{got}\n{expected}"
    monkeypatch.setenv(TOPK_SELECT_ENV, "heap")
    with pytest.raises(ValueError, match=TOPK_SELECT_ENV):
        KernelOptions.resolve()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("key_row_limit", [None, (0, 4)], ids=["exact-plan", "static-plan"])
def test_gpu_chunked_topk_radix_selects_what_torch_selects(key_row_limit, monkeypatch, seed):
    """bf16 at T = 8192 (Hi = 64, Di = 128, k = 512): the radix selection of the fp32 buffers and the
    packed keys + ``torch.topk`` choose the same key rows bitwise (the same products; only the buffer,
    the chunking and the selection differ), with the exact plan and with the static one (row limits)."""
    from dsv4cp.kernels.indexer_triton import TOPK_SELECT_ENV
    from dsv4cp.ops.indexer import fused_indexer_topk as indexer_topk_triton

    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, hi, di = 8192, 64, 128
    q = torch.randn(t, hi, di, device="cuda", generator=gen).bfloat16()
    w = torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5
    keys = torch.randn(t // 4, di, device="cuda", generator=gen).bfloat16()
    pos = torch.arange(t, device="cuda")
    vis = (torch.zeros_like(pos), (pos + 1) // 4, torch.zeros(t // 4, dtype=torch.int64, device="cuda"),
           torch.arange(t // 4, device="cuda"))
    got = {}
    for select in ("torch", "radix"):
        monkeypatch.setenv(TOPK_SELECT_ENV, select)
        got[select] = indexer_topk_triton(q, w, keys, *vis, 512, key_row_limit=key_row_limit, impl="chunked")
    assert (got["radix"][-1] >= 0).all() and (got["radix"][0] == -1).all()
    assert torch.equal(got["radix"], got["torch"]), f"seed={seed}"
