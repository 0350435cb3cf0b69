"""The row partitioner (DESIGN 3.1): split validation, optimality of the balanced split against brute
force on small cases, its per-row costs against a direct count, and its speed at 1M tokens."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import (
    InfeasibleSplitError, RowCosts, RowSplit, as_split, balanced_split, halo_rows, partition, row_costs,
    slice_costs,
)
from dsv4cp.packing import PackedSeqs

TINY = DSv4Config.preset("tiny")


def _brute_force(prefix: np.ndarray, cp: int, min_rows: int, align: int) -> float:
    """The smallest largest slice cost over every split (inner points on multiples of ``align``)."""
    total = prefix.size - 1
    points = range(0, total + 1, align)
    best = np.inf
    for inner in itertools.combinations_with_replacement(points, cp - 1):
        bounds = (0, *inner, total)
        rows = np.diff(bounds)
        if (rows < min_rows).any():
            continue
        best = min(best, float(np.max(prefix[list(bounds[1:])] - prefix[list(bounds[:-1])])))
    return best


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=1, max_size=14),
    cp=st.integers(1, 4),
    min_rows=st.integers(1, 3),
    align=st.integers(1, 3),
)
def test_balanced_split_is_optimal(costs: list[int], cp: int, min_rows: int, align: int) -> None:
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float))))
    want = _brute_force(prefix, cp, min_rows, align)
    if want == np.inf:
        with pytest.raises(InfeasibleSplitError):
            balanced_split(prefix, cp, min_rows, align)
        return
    split = balanced_split(prefix, cp, min_rows, align)
    split.validate(len(costs), cp, min_rows)
    assert all(b % align == 0 for b in split.bounds[1:-1]), split
    got = float(slice_costs(prefix, split).max())
    assert got <= want * (1 + 1e-12) + 1e-12, (split, got, want)


def test_min_rows_clamp_takes_the_exact_route() -> None:
    """A heavy row right after a cheap stretch: the greedy sweep cuts a slice below min_rows, the
    exact reachability test must still find the optimum."""
    costs = [1, 1, 1, 1, 100, 1, 1, 1, 1, 1]
    prefix = np.concatenate(([0.0], np.cumsum(costs, dtype=float)))
    split = balanced_split(prefix, 3, 3, 1)
    assert float(slice_costs(prefix, split).max()) == _brute_force(prefix, 3, 3, 1)


def test_row_costs_match_direct_count() -> None:
    """Per-row costs equal the formula evaluated row by row from document positions."""
    cfg = TINY.replace(index_n_heads=4)
    costs = RowCosts(per_row=3.0, per_window_key=0.5, per_visible_entry=0.25, per_compressed_key=2.0)
    lengths, total = [0, 13, 5, 40, 0, 9], 80
    cu = np.concatenate(([0], np.cumsum(lengths)))
    for ratio in (0, 4, 8):
        got = row_costs(costs, cu, total, cfg, ratio)
        want = []
        for length in lengths:
            for t in range(length):
                visible = (t + 1) // ratio if ratio else 0
                keys = min(visible, cfg.index_topk) if ratio == 4 else visible
                want.append(3.0 + 0.5 * min(t + 1, cfg.window) + 0.25 * visible + 2.0 * keys)
        want += [3.0] * (total - sum(lengths))
        np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_balanced_gives_the_end_of_a_long_document_fewer_rows() -> None:
    """One long document: the per-row cost grows with position, so later ranks hold fewer rows and
    the largest rank cost drops below the equal split's."""
    cfg = DSv4Config.preset("flash")
    lengths = [65536]
    for cp in (2, 4, 8):
        equal = partition(lengths, cp, cfg, 4, policy="equal")
        balanced = partition(lengths, cp, cfg, 4, policy="balanced", align=8)
        assert equal == RowSplit.equal(65536, cp)
        rows = balanced.rank_rows
        assert all(a > b for a, b in zip(rows, rows[1:])), rows
        assert all(b % 8 == 0 for b in balanced.bounds)
        prefix = np.concatenate(([0.0], np.cumsum(row_costs(RowCosts.for_layer(cfg, 4), np.array([0, 65536]),
                                                            65536, cfg, 4))))
        equal_max, balanced_costs = slice_costs(prefix, equal).max(), slice_costs(prefix, balanced)
        assert balanced_costs.max() < 0.97 * equal_max
        assert balanced_costs.max() / balanced_costs.mean() < 1.01


def test_w_layer_balanced_is_nearly_equal() -> None:
    """A W layer's per-row cost is flat past the window: the balanced split is the equal one to within
    the window's ramp."""
    cfg = DSv4Config.preset("flash")
    split = partition([8192], 4, cfg, 0, policy="balanced")
    assert max(abs(r - 2048) for r in split.rank_rows) <= cfg.window


def test_partition_is_identical_for_packed_and_lengths() -> None:
    cfg = TINY.replace(index_n_heads=4)
    lengths = [7, 0, 30, 3, 41]
    packed = PackedSeqs.from_lengths(lengths)
    assert partition(packed, 3, cfg, 4, policy="balanced") == partition(lengths, 3, cfg, 4, policy="balanced")


def test_machine_costs_are_seconds() -> None:
    """With a machine the costs are the FLOP costs at its peak plus the top-k's fp32 score reads."""

    class Ceilings:
        peak_flops, hbm_bandwidth = 1e12, 1e11

    cfg = TINY.replace(index_n_heads=4)
    flops, seconds = RowCosts.for_layer(cfg, 4), RowCosts.for_layer(cfg, 4, Ceilings())
    assert seconds.per_row == pytest.approx(flops.per_row / 1e12)
    assert seconds.per_visible_entry == pytest.approx(flops.per_visible_entry / 1e12 + 4 / 1e11)


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ((0, 90, 80), "non-decreasing"),
        ((0, 40, 70), "from 0 to packed.total=80"),
        ((5, 40, 80), "from 0 to packed.total=80"),
        ((0, 80), "cp \\+ 1 = 3"),
        ((0, 76, 80), "rank 1 holds 4 rows, fewer than the 8"),
        ((0, 40.5, 80), "tuple of ints"),
    ],
)
def test_bad_splits_raise_naming_the_field(bounds, message) -> None:
    with pytest.raises(ValueError, match=f"split.*{message}"):
        as_split(bounds, 80, 2, min_rows=8)


def test_partition_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="policy: must be one of"):
        partition([64], 2, TINY, 4, policy="zigzag")
    with pytest.raises(ValueError, match="align: must be a positive int"):
        partition([64], 2, TINY, 4, policy="balanced", align=0)
    with pytest.raises(ValueError, match="cp: must be a positive int"):
        partition([64], 0, TINY, 4)
    with pytest.raises(ValueError, match="packed.total: 63 rows are not divisible by cp=2"):
        partition([63], 2, TINY, 4)
    halo = halo_rows(TINY, 4, 4)
    with pytest.raises(InfeasibleSplitError, match=f"at least {halo} rows"):
        partition([4 * halo - 1], 4, TINY, 4, policy="balanced")
    with pytest.raises(InfeasibleSplitError, match="align"):
        partition([40], 2, TINY, 4, policy="balanced", align=36)  # only 0 and 36 are boundaries: 4 rows left


def test_split_accessors() -> None:
    split = RowSplit((0, 30, 42, 80))
    assert (split.cp, split.total, split.rank_rows, split.max_rows, split.min_rows) == (3, 80, (30, 12, 38), 38, 12)
    assert (split.start(2), split.rows(2), split.is_equal) == (42, 38, False)
    assert RowSplit.equal(80, 4).is_equal


# ---------------------------------------------------------------------------------- speed
def test_balanced_partition_of_1m_tokens_is_fast() -> None:
    """1M tokens of histogram-like documents over 64 ranks: well under a second of host time
    (O(T) prefix sums, then O(cp log T) per bisection step)."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 32768, size=200)
    lengths[-1] += (1 << 20) - lengths.sum() % (1 << 20)
    cfg = DSv4Config.preset("flash")
    partition(lengths.tolist(), 64, cfg, 4, policy="balanced", align=8)  # warm-up (imports, caches)
    start = time.perf_counter()
    split = partition(lengths.tolist(), 64, cfg, 4, policy="balanced", align=8)
    elapsed = time.perf_counter() - start
    assert split.total == int(lengths.sum()) and split.cp == 64
    assert elapsed < 3.0, f"balanced partition of 1M tokens took {elapsed:.2f} s"
