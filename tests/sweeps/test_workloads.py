"""Packing generators: exact totals, histogram shares, whole documents for best-fit, adversarial
documents and compressed groups across every rank boundary, and the packing names of the sweeps."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from dsv4cp.workloads import (
    LengthBin,
    adversarial_lengths,
    load_histogram,
    pack_lengths,
    packing_lengths,
    parse_packing,
    sample_lengths,
)

NAMES = ["one", "fixed:100", "fixed:4096", "histogram", "histogram-bestfit", "adversarial"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("total", [4096, 65536])
def test_lengths_fill_the_target_exactly(name, total, seed):
    lengths = packing_lengths(name, total, cp=4, ratio=4, seed=seed)
    assert sum(lengths) == total
    assert all(n >= 1 for n in lengths)


def test_same_seed_same_packing_other_seed_other_packing(seed):
    first = packing_lengths("histogram", 65536, cp=2, ratio=4, seed=seed)
    assert packing_lengths("histogram", 65536, cp=2, ratio=4, seed=seed) == first
    assert packing_lengths("histogram", 65536, cp=2, ratio=4, seed=seed + 1) != first


def test_histogram_shares_within_sampling_error(seed):
    bins = load_histogram()
    lengths = sample_lengths(bins, 20_000, random.Random(seed))
    total_share = sum(b.percent for b in bins)
    counts = Counter(next(i for i, b in enumerate(bins) if b.lo <= n <= b.hi) for n in lengths)
    for i, b in enumerate(bins):
        share = b.percent / total_share
        sigma = math.sqrt(share * (1 - share) / len(lengths))
        assert abs(counts[i] / len(lengths) - share) <= 5 * sigma + 1e-9, (b, counts[i])


def test_best_fit_keeps_documents_whole_where_sequential_cuts(seed):
    bins = [LengthBin(10, 10, 50.0), LengthBin(100, 100, 50.0)]
    drawn = {10, 100}
    sequential_cut = False
    for trial in range(20):
        best = pack_lengths(1005, "histogram-bestfit", histogram=bins, seed=seed + trial)
        assert sum(best) == 1005
        assert all(n in drawn for n in best[:-1])
        assert best[-1] in drawn or best[-1] < min(drawn)  # only the last, smaller than any document, is cut
        sequential = pack_lengths(1005, "histogram", histogram=bins, seed=seed + trial)
        sequential_cut |= any(n not in drawn for n in sequential[:-1]) or sequential[-1] not in drawn
    assert sequential_cut  # the property separates the two packings


def _documents(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("ratio", [0, 4, 8, 128])
def test_adversarial_straddles_every_rank_boundary(cp, ratio, seed):
    rows = max(4 * ratio, 64)
    total = cp * rows
    lengths = adversarial_lengths(total, cp, ratio, seed=seed)
    assert sum(lengths) == total
    assert max(lengths) <= max(2 * ratio, 8)  # short documents only
    for boundary in range(rows, total, rows):
        straddling = [(s, e) for s, e in _documents(lengths) if s < boundary < e]
        assert len(straddling) == 1, (boundary, straddling)
        s, e = straddling[0]
        if ratio:  # a complete compressed group of that document has rows on both ranks
            groups = [(s + j * ratio, s + (j + 1) * ratio) for j in range((e - s) // ratio)]
            assert any(a < boundary < b for a, b in groups), (boundary, s, e)


def test_adversarial_refuses_ranks_too_small_for_the_straddling_document():
    with pytest.raises(ValueError, match="tokens: adversarial packing needs at least 256 rows per rank"):
        adversarial_lengths(400, 2, 128)
    with pytest.raises(ValueError, match="not divisible by cp=3"):
        adversarial_lengths(400, 3, 4)
    with pytest.raises(ValueError, match="adversarial needs the cp and compress ratio"):
        pack_lengths(400, "adversarial")


def test_packing_names():
    assert parse_packing("one") == ("one", None, None)
    assert parse_packing("fixed:512") == ("fixed", 512, None)
    assert parse_packing("lengths:3,0,5") == ("lengths", None, [3, 0, 5])
    assert packing_lengths("lengths:3,0,5", 10, cp=1, ratio=4) == [3, 0, 5]
    for bad in ["fixed", "fixed:-1", "fixed:x", "one:2", "lengths:", "lengths:1,-2", "random", 7]:
        with pytest.raises(ValueError, match="packing: unknown packing|packing: must be a string"):
            parse_packing(bad)
    with pytest.raises(ValueError, match="holds 12 tokens, more than tokens=10"):
        packing_lengths("lengths:6,6", 10, cp=1, ratio=4)
