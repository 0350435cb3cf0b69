"""Per-rank peak memory of unequal splits and the memory-capped split: equal slices give every rank the
one-rank estimate, more rows mean more memory, and a cap between the balanced and the equal split's peaks
gives a split that fits it and is no faster than balanced nor slower than equal (model times)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine
from dsv4cp.model.memory import peak_bytes_estimate, rank_peak_bytes
from dsv4cp.model.memory_split import memory_capped_split, rank_time_s, trade_off
from dsv4cp.model.partition import policy_split

CFG = DSv4Config.preset("flash")
TOKENS, CP = 262144, 8
DOCS = [TOKENS]


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_equal_slices_give_every_rank_the_estimate(ratio):
    peaks = rank_peak_bytes(CFG, ratio, DOCS, RowSplit.equal(TOKENS, CP), "fwd+bwd", torch.bfloat16)
    assert peaks == [peak_bytes_estimate(CFG, ratio, DOCS, CP, "fwd+bwd", torch.bfloat16)] * CP


def test_more_rows_hold_more_memory(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1024, TOKENS - 1024, 512), CP - 1))
    split = RowSplit((0, *cuts, TOKENS))
    peaks = rank_peak_bytes(CFG, 4, DOCS, split, "fwd+bwd", torch.bfloat16)
    order = sorted(range(CP), key=lambda r: split.rank_rows[r])
    assert [peaks[r] for r in order] == sorted(peaks)
    assert len(set(split.rank_rows)) == 1 or peaks[order[-1]] > peaks[order[0]]


def test_the_cap_sits_between_balanced_and_equal():
    machine = Machine()
    balanced = policy_split(CFG, 4, DOCS, CP, "balanced", machine, total=TOKENS)
    equal = RowSplit.equal(TOKENS, CP)
    peak_b = max(rank_peak_bytes(CFG, 4, DOCS, balanced, "fwd+bwd", torch.bfloat16))
    peak_e = max(rank_peak_bytes(CFG, 4, DOCS, equal, "fwd+bwd", torch.bfloat16))
    assert peak_b > peak_e
    cap = (peak_b + peak_e) // 2
    capped = memory_capped_split(CFG, 4, DOCS, balanced, cap, dtype=torch.bfloat16, machine=machine)
    assert max(rank_peak_bytes(CFG, 4, DOCS, capped, "fwd+bwd", torch.bfloat16)) <= cap
    slowest = {name: rank_time_s(CFG, 4, DOCS, s, machine).max() for name, s in
               (("balanced", balanced), ("capped", capped), ("equal", equal))}
    assert slowest["balanced"] <= slowest["capped"] <= slowest["equal"]
    assert memory_capped_split(CFG, 4, DOCS, balanced, peak_b, dtype=torch.bfloat16) == balanced
    with pytest.raises(ValueError, match="max_rank_memory"):
        memory_capped_split(CFG, 4, DOCS, balanced, peak_e - 1, dtype=torch.bfloat16)
    table = trade_off(CFG, 4, DOCS, {"equal": equal, "balanced": balanced, "capped": capped}, dtype=torch.bfloat16)
    assert list(table["policy"]) == ["equal", "balanced", "capped"]
    assert table["max_peak_gib"].iloc[2] <= cap / 2**30 + 1e-12
