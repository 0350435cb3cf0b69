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
from dsv4cp.cp.partition import RowSplit, as_split, halo_rows
from dsv4cp.model import Machine
from dsv4cp.model.balanced_split import InfeasibleSplitError, balanced_split, partition
from dsv4cp.model.row_costs import RowCosts, row_costs, slice_costs
from dsv4cp.packing import PackedSeqs

TINY = DSv4Config.preset("tiny")
H200 = Machine.preset("h200x2")


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
    with pytest.raises(ValueError, match="direction: must be one of"):
        partition([64], 2, TINY, 4, direction="both")
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="^min_rows: must be a positive int"):
            partition([64], 2, TINY, 4, policy="balanced", min_rows=bad)
    with pytest.raises(ValueError, match="^total: 63 rows are not divisible by cp=2"):
        partition([63], 2, TINY, 4)
    with pytest.raises(ValueError, match="^packed.total: 63 rows are not divisible by cp=2"):
        partition(PackedSeqs.from_lengths([63]), 2, TINY, 4)
    halo = halo_rows(TINY, 4, 4)
    with pytest.raises(InfeasibleSplitError, match=f"at least {halo} rows"):
        partition([4 * halo - 1], 4, TINY, 4, policy="balanced")
    with pytest.raises(InfeasibleSplitError, match="align"):
        partition([40], 2, TINY, 4, policy="balanced", align=36)  # only 0 and 36 are boundaries: 4 rows left


def test_check_case_rejects_a_malformed_split_before_slicing() -> None:
    """check-cp's ranks slice their rows with the case's split: a malformed one is a ValueError first."""
    from dsv4cp.harness.case import Case

    case = Case(ratio=4, lengths=(60,), total=60, split=(0, 60))
    with pytest.raises(ValueError, match="^split.bounds: must hold cp \\+ 1 = 3"):
        case.row_split(2)
    assert Case(ratio=4, lengths=(60,), total=60, split=(0, 20, 60)).row_split(2).bounds == (0, 20, 60)


def test_split_accessors() -> None:
    split = RowSplit((0, 30, 42, 80))
    assert (split.cp, split.total, split.rank_rows, split.max_rows, split.min_rows) == (3, 80, (30, 12, 38), 38, 12)
    assert (split.start(2), split.rows(2), split.is_equal) == (42, 38, False)
    assert RowSplit.equal(80, 4).is_equal


# ---------------------------------------------------------------------------------- speed
def test_balanced_partition_of_1m_tokens_is_fast() -> None:
    """1M tokens of random documents over 64 ranks: O(T) prefix sums, then O(cp log T) per bisection
    step; about 0.1 s on an idle core, so the bound is loose (the test host's cores are shared)."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 32768, size=200)
    lengths[-1] += (1 << 20) - lengths.sum() % (1 << 20)
    cfg = DSv4Config.preset("flash")
    partition(lengths.tolist(), 64, cfg, 4, policy="balanced", align=8)  # warm-up (imports, caches)
    start = time.perf_counter()
    split = partition(lengths.tolist(), 64, cfg, 4, policy="balanced", align=8)
    elapsed = time.perf_counter() - start
    assert split.total == int(lengths.sum()) and split.cp == 64
    assert elapsed < 10.0, f"balanced partition of 1M tokens took {elapsed:.2f} s"


# ---------------------------------------------------------------------------------- cost model
@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    tail=st.integers(0, 10),
    ratio=st.sampled_from([0, 4, 8]),
    cuts=st.lists(st.integers(0, 1000), min_size=2, max_size=2),
)
def test_model_counts_on_unequal_slices_match_the_layout(lengths, tail, ratio, cuts) -> None:
    """The model's closed-form counts on an arbitrary split equal brute-force counts on the layout
    that the layer builds for that split (owned groups follow the last row's rank)."""
    from dsv4cp.cp.layout import build_layout
    from dsv4cp.model import rank_counts

    cfg = TINY.replace(index_topk=3)
    cp, halo = 3, halo_rows(cfg, ratio, 3)
    total = max(sum(lengths) + tail, cp * halo)
    free = total - cp * halo  # rows left once every rank has its halo
    first, second = sorted(c % (free + 1) for c in cuts)
    split = RowSplit((0, halo + first, 2 * halo + second, total))
    packed = PackedSeqs.from_lengths(lengths, total=total)
    counts = rank_counts(cfg, ratio, packed, cp, split=split)
    assert tuple(counts.rank_rows) == split.rank_rows
    owned_total = 0
    for rank in range(cp):
        lay = build_layout(packed, cfg, ratio, rank, cp, split=split)
        assert (lay.start, lay.rows) == (split.start(rank), split.rows(rank))
        assert counts.window_keys[rank] == int((lay.window_idx >= 0).sum())
        if ratio:
            visible = lay.visible_entries()
            assert counts.visible_entries[rank] == int(visible.sum())
            assert counts.owned_entries[rank] == int(lay.group_valid.sum())
            assert lay.capacity == counts.capacity  # one static gather size on every rank
            owned_total += int(lay.group_valid.sum())
    if ratio:
        assert owned_total == sum((n // ratio) for n in lengths)  # every group owned exactly once


@pytest.mark.parametrize("direction", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("loss", ["sparse", "dense"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_row_costs_sum_to_the_model_flops(ratio: int, loss: str, direction: str) -> None:
    """Per-row FLOP costs summed over each rank's slice equal the cost model's FLOPs of that rank in
    ``direction`` without the halo's (the only difference: compressor pooling counted per owned
    group, not per row over r, a few parts per million)."""
    from dsv4cp.model import estimate

    cfg = DSv4Config.preset("flash", indexer_loss=loss)
    lengths, total = [30000, 5, 0, 20000, 15531], 66536
    split = partition(lengths, 4, cfg, ratio, policy="balanced", total=total, direction=direction)
    est = estimate(cfg, ratio, lengths, 4, total=total, split=split)
    records = est.records if direction == "fwd+bwd" else est.table(direction)
    halo = records.groupby("rank")["redundant_flops"].sum().to_numpy()
    model = np.asarray(est.summary(direction).rank_flops) - halo
    cu = np.concatenate(([0], np.cumsum(lengths)))
    costs = RowCosts.for_layer(cfg, ratio, direction=direction)
    prefix = np.concatenate(([0.0], np.cumsum(row_costs(costs, cu, total, cfg, ratio))))
    np.testing.assert_allclose(slice_costs(prefix, split), model, rtol=1e-5)


def test_balancing_one_pass_leaves_the_other_unequal() -> None:
    """The indexer scores in forward only: the forward-balanced split gives the last rank of a long
    document fewer rows than the step-balanced one, and each equalises its own direction."""
    from dsv4cp.model.partition import compare_policies

    cfg = DSv4Config.preset("flash")
    rows = {d: partition([65536], 4, cfg, 4, policy="balanced", direction=d).rank_rows for d in ("fwd", "fwd+bwd")}
    assert rows["fwd"][-1] < rows["fwd+bwd"][-1]
    for direction in ("fwd", "bwd", "fwd+bwd"):
        table = compare_policies(cfg, 4, [65536], 4, H200, direction=direction).set_index("policy")
        assert table.loc["balanced", "compute_imbalance"] < 1.005, direction


def test_model_compares_the_policies() -> None:
    """One long document at cp 2 and 8: the balanced split's predicted max/mean compute is near 1 and
    below the equal split's; its slowest rank is faster."""
    from dsv4cp.model.partition import compare_policies

    cfg = DSv4Config.preset("flash")
    for cp in (2, 8):
        table = compare_policies(cfg, 4, [65536], cp, H200, align=8).set_index("policy")
        equal, balanced = table.loc["equal"], table.loc["balanced"]
        assert equal["split"] == RowSplit.equal(65536, cp).bounds
        assert equal["compute_imbalance"] > 1.05
        assert balanced["compute_imbalance"] < 1.005
        assert balanced["max_compute_s"] < equal["max_compute_s"]
        assert balanced["mean_compute_s"] == pytest.approx(equal["mean_compute_s"], rel=0.01)  # same work
