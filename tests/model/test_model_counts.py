"""The cost model's key counts and FLOPs equal brute-force counts on the real CP layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.layout import build_layout, halo_rows
from dsv4cp.model import estimate, rank_counts
from dsv4cp.model.counts import clamped_floor_prefix, floor_prefix, window_prefix
from dsv4cp.packing import PackedSeqs

TINY = DSv4Config.preset("tiny")


def config_for(ratio: int, topk: int = 8) -> DSv4Config:
    """Tiny config able to run ``ratio`` (H layers need window >= ratio)."""
    return TINY.replace(window=max(TINY.window, ratio), index_topk=topk)


def make_batch(cfg, ratio, cp, lengths, pad, tail) -> PackedSeqs:
    """Documents padded to ``pad``, ``tail`` extra rows, total rounded up to a multiple of cp that
    leaves every rank at least the halo."""
    base = sum(-(-n // pad) * pad for n in lengths)
    need = max(base + tail, cp * halo_rows(cfg, ratio, cp), 1)
    return PackedSeqs.from_lengths(lengths, pad_to_multiple=pad, total=-(-need // cp) * cp)


def brute_force(packed, cfg, ratio, cp):
    """Per rank: (window keys, visible entries, compressed keys, owned entries) from build_layout."""
    out = []
    for rank in range(cp):
        lay = build_layout(packed, cfg, ratio, rank, cp)
        window = int((lay.window_idx >= 0).sum())
        if ratio == 0:
            out.append((window, 0, 0, 0, lay.ext_rows))
            continue
        visible = lay.visible_entries()
        used = visible.clamp(max=cfg.index_topk) if layer_kind(ratio) == "C" else visible
        out.append((window, int(visible.sum()), int(used.sum()), int(lay.group_valid.sum()), lay.ext_rows))
    return out


def check_against_layout(cfg, ratio, cp, packed) -> None:
    counts = rank_counts(cfg, ratio, packed, cp)
    est = estimate(cfg, ratio, packed, cp)
    fwd = est.table("fwd")
    per_key = 4 * cfg.head_dim * cfg.n_heads  # 2 (D_qk + D_v) per (query, head, key), times heads
    for rank, (window, visible, used, owned, ext) in enumerate(brute_force(packed, cfg, ratio, cp)):
        got = (counts.window_keys[rank], counts.visible_entries[rank], counts.compressed_keys[rank],
               counts.owned_entries[rank], counts.ext_rows)
        assert tuple(int(v) for v in got) == (window, visible, used, owned, ext), (rank, packed)
        row = fwd[(fwd["rank"] == rank)].set_index("phase")
        assert row.loc["sparse_attn", "flops"] == (window + used) * per_key
        bwd = est.table("bwd", rank).set_index("phase")
        assert bwd.loc["sparse_attn", "flops"] == 2.5 * (window + used) * per_key
        if layer_kind(ratio) == "C":
            assert row.loc["indexer.score", "flops"] == 2 * cfg.index_n_heads * cfg.index_head_dim * visible


LENGTH = st.one_of(st.just(0), st.integers(1, 7), st.integers(8, 90))  # empty, shorter than r, longer


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ratio=st.sampled_from([0, 4, 8, 16]),
    cp=st.sampled_from([1, 2, 3, 4]),
    lengths=st.lists(LENGTH, min_size=0, max_size=7),
    pad=st.sampled_from([1, 2, 4, 8]),
    tail=st.integers(0, 24),
    topk=st.sampled_from([1, 3, 8]),
)
def test_counts_and_flops_match_layout(ratio, cp, lengths, pad, tail, topk):
    cfg = config_for(ratio, topk)
    check_against_layout(cfg, ratio, cp, make_batch(cfg, ratio, cp, lengths, pad, tail))


@pytest.mark.parametrize("ratio", [0, 4, 8])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths,pad,tail", [
    ([240], 1, 0),  # one long document straddling every rank boundary
    ([3, 0, 5, 2, 0, 7, 1, 6] * 4, 1, 0),  # many documents shorter than r, empty ones between
    ([37, 0, 91, 13], 8, 17),  # padding inside documents plus a tail segment
    ([], 1, 64),  # nothing but tail padding
])
def test_edge_packings_match_layout(ratio, cp, lengths, pad, tail):
    cfg = config_for(ratio)
    check_against_layout(cfg, ratio, cp, make_batch(cfg, ratio, cp, lengths, pad, tail))


def test_prefix_sums_against_loops():
    for n in range(0, 80):
        u = np.arange(1, n + 1)
        assert window_prefix(n, 8) == np.minimum(u, 8).sum()
        for r in (1, 4, 7, 128):
            assert floor_prefix(n, r) == (u // r).sum()
            for k in (1, 3, 8):
                assert clamped_floor_prefix(n, r, k) == np.minimum(u // r, k).sum()


def test_lengths_and_packed_agree():
    cfg = config_for(4)
    lengths = [50, 7, 0, 33, 12]
    a = estimate(cfg, 4, lengths, 2, total=104).table()
    b = estimate(cfg, 4, PackedSeqs.from_lengths(lengths, total=104), 2).table()
    assert a.equals(b)


def test_rejects_what_the_layout_rejects():
    cfg = config_for(4)
    with pytest.raises(ValueError, match="total"):
        rank_counts(cfg, 4, [99], 2)  # not divisible
    with pytest.raises(ValueError, match="halo"):
        rank_counts(cfg, 4, [16], 4)  # 4 rows per rank < halo 8
    with pytest.raises(ValueError, match="window"):
        rank_counts(TINY, 16, [64], 1)  # H layer with window < ratio
    with pytest.raises(ValueError, match="lengths"):
        rank_counts(cfg, 4, [5, -1], 1)
    with pytest.raises(ValueError, match="total"):
        rank_counts(cfg, 4, [50], 1, total=40)
