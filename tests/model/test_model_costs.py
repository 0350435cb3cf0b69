"""Per-rank sums, communication volumes, DESIGN 6b figures, extrapolation and measured-vs-bound."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import halo_rows
from dsv4cp.model import (
    COLUMNS,
    EXTRAPOLATE_COLUMNS,
    Machine,
    estimate,
    extrapolate,
    measured_phase,
    measured_vs_bound,
    nvtx_ranges,
    phase_measured_in,
    range_to_phase,
)
from dsv4cp.model.costs import PHASES, layer_phases, phase_directions

TINY = DSv4Config.preset("tiny")
FLASH = DSv4Config.preset("flash")
MiB = 2**20
K = 1024


def phase_sums(est, direction):
    t = est.table(direction)
    return t.groupby("phase")[["flops", "redundant_flops"]].sum()


# ------------------------------------------------------------------------------ per-rank sums
@pytest.mark.parametrize("ratio", [0, 4, 8])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("loss", ["sparse", "dense"])
def test_rank_sums_equal_cp1_plus_halo_redundancy(ratio, cp, loss):
    cfg = TINY.replace(indexer_loss=loss)
    lengths = [61, 0, 3, 45, 7, 2, 90, 31]
    total = 240  # divisible by 2, 3, 4; 24 tail rows
    one = estimate(cfg, ratio, lengths, 1, total=total)
    many = estimate(cfg, ratio, lengths, cp, total=total)
    hw = halo_rows(cfg, ratio, cp)
    D, Di, hidden = cfg.head_dim, cfg.index_head_dim, cfg.hidden
    coff = 2 if ratio == 4 else 1
    per_halo_row = {  # forward FLOPs of one projected halo row, from the layer's weight shapes
        "kv_proj": 2 * hidden * D,
        "compress": 2 * hidden * 2 * coff * D,  # wkv and wgate
        "indexer.compress": 2 * hidden * 2 * 2 * Di,
    }
    detached = {"indexer.compress"}  # weight gradient only in backward
    for direction in ("fwd", "bwd"):
        a, b = phase_sums(one, direction), phase_sums(many, direction)
        assert list(a.index) == list(b.index)
        assert (a["redundant_flops"] == 0).all()
        for phase in a.index:
            if phase in per_halo_row:
                factor = 1 if direction == "fwd" or phase in detached else 2
                expected = factor * cp * hw * per_halo_row[phase]
                assert b.loc[phase, "redundant_flops"] == pytest.approx(expected, rel=1e-12)
                assert b.loc[phase, "flops"] == pytest.approx(a.loc[phase, "flops"] + expected, rel=1e-12)
            else:  # attention, indexer scoring/top-k/loss, q and output projections: no redundancy
                assert b.loc[phase, "redundant_flops"] == 0
                assert b.loc[phase, "flops"] == pytest.approx(a.loc[phase, "flops"], rel=1e-12)
    fwd_one, fwd_many = one.summary("fwd"), many.summary("fwd")
    assert fwd_many.model_flops == pytest.approx(fwd_one.total_flops, rel=1e-12)
    assert sum(fwd_many.rank_flops) == pytest.approx(fwd_many.total_flops, rel=1e-12)


def test_owned_entries_partition_the_batch():
    lengths = [61, 0, 3, 45, 7, 2, 90, 31]
    for ratio in (4, 8):
        for cp in (1, 2, 3, 4):
            counts = estimate(TINY, ratio, lengths, cp, total=240).counts
            assert counts.owned_entries.sum() == sum(n // ratio for n in lengths)
            assert (counts.owned_entries <= counts.capacity).all()


# ------------------------------------------------------------------------------ communication
@pytest.mark.parametrize("ratio", [0, 4, 8])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_comm_bytes_follow_the_capacity_formula(ratio, cp):
    total = 240
    est = estimate(TINY, ratio, [100, 50, 90], cp, total=total)
    t = est.table()
    rows = total // cp
    capacity = -(-rows // ratio) if ratio else 0
    widths = {"allgather.kv": TINY.head_dim, "allgather.index_k": TINY.index_head_dim}
    for phase in ("allgather.kv", "allgather.index_k"):
        sub = t[t["phase"] == phase]
        expected_present = (phase == "allgather.kv" and ratio > 0) or ratio == 4
        assert (len(sub) > 0) == expected_present
        for direction in ("fwd", "bwd"):  # reduce-scatter bytes = all-gather bytes
            got = sub[sub["direction"] == direction]["comm_bytes"]
            assert (got == (cp - 1) * capacity * widths[phase] * 2).all()
    halo = t[t["phase"] == "halo"].set_index(["direction", "rank"])["comm_bytes"]
    hw = halo_rows(TINY, ratio, cp)
    for rank in range(cp):
        assert halo[("fwd", rank)] == (hw * TINY.hidden * 2 if rank > 0 else 0)
        assert halo[("bwd", rank)] == (hw * TINY.hidden * 2 if rank < cp - 1 else 0)
    if cp == 1:
        assert (t["comm_bytes"] == 0).all() and (t[t["resource"] == "comm"]["time_lower_bound_s"] == 0).all()


def test_allgather_time_uses_bus_bandwidth_convention():
    machine = Machine(allgather_busbw=100e9)
    est = estimate(FLASH, 4, [1 << 16], 4, machine)
    rec = est.table("fwd", 0).set_index("phase")
    gathered = 4 * est.counts.capacity * FLASH.head_dim * 2  # the whole gathered buffer
    assert rec.loc["allgather.kv", "time_lower_bound_s"] == pytest.approx(3 / 4 * gathered / 100e9)
    assert machine.collective_time(gathered, 1) == 0.0


def test_machine_presets():
    assert Machine.preset("h200x2") == Machine()
    inter = Machine.preset("internode")
    assert inter.allgather_busbw == inter.p2p_bandwidth == 40e9 and inter.peak_flops == 784e12
    assert Machine.preset("internode", 25e9).allgather_busbw == 25e9
    assert Machine.preset("h200x2", 100e9).p2p_bandwidth == 100e9
    with pytest.raises(ValueError, match="machine"):
        Machine.preset("tpu")
    with pytest.raises(ValueError, match="bandwidth"):
        Machine().with_bandwidth(0)


# ------------------------------------------------------------------------------ DESIGN 6b figures
def test_design_6b_cp2_64k_flash_c_layer():
    """cp = 2, 64K tokens, one document: ~8K compressed rows (8 MiB) and ~2 MiB of indexer keys per
    rank, ~50 us of gathers at NVLink bandwidth against ~5 ms of attention at FlashMLA speed, a
    1 MiB halo, and the later rank doing ~3x the indexer work of the earlier one."""
    tokens, cp, D = 1 << 16, 2, FLASH.head_dim
    est = estimate(FLASH, 4, [tokens], cp, Machine.preset("h200x2"))
    assert est.counts.capacity == 8 * K
    t = est.table("fwd").set_index(["phase", "rank"])
    kv = t.loc[("allgather.kv", 1), "comm_bytes"]
    ik = t.loc[("allgather.index_k", 1), "comm_bytes"]
    assert 7.5 * MiB < kv < 8.5 * MiB and 1.8 * MiB < ik < 2.2 * MiB
    gathers_s = t.loc[("allgather.kv", 1), "time_lower_bound_s"] + t.loc[("allgather.index_k", 1), "time_lower_bound_s"]
    assert 20e-6 < gathers_s < 60e-6  # "about 50 us" at 258 GB/s
    assert gathers_s == pytest.approx((kv + ik) / 258e9)
    assert t.loc[("halo", 1), "comm_bytes"] == 1 * MiB
    # per-rank attention: 32K queries x 64 heads x ~640 keys x 2048 FLOPs; at FlashMLA's 561 TFLOP/s ~5 ms
    attn = t.loc[("sparse_attn", 1), "flops"]
    assert attn <= (tokens // cp) * FLASH.n_heads * (FLASH.window + FLASH.index_topk) * 4 * D
    assert 4e-3 < attn / 561e12 < 6e-3
    s = est.summary("fwd")
    assert s.comm_s < 0.05 * s.compute_s  # intra-node, communication is a few percent
    score = t.xs("indexer.score", level="phase")["flops"]
    assert 2.8 < score[1] / score[0] < 3.2  # sum of t/4 over the second half vs the first: 3x


def test_design_6b_cp64_crossover_at_40GBps():
    """cp = 64, 4K tokens per rank (256K): a rank receives ~64 MiB of compressed KV per C layer,
    ~1.6 ms at 40 GB/s, against ~0.6 ms of attention: communication takes over."""
    cp, per_rank = 64, 4 * K
    est = estimate(FLASH, 4, [cp * per_rank], cp, Machine.preset("internode", 40e9))
    t = est.table("fwd").set_index(["phase", "rank"])
    kv = t.loc[("allgather.kv", 5), "comm_bytes"]
    assert 60 * MiB < kv < 66 * MiB
    assert 1.4e-3 < t.loc[("allgather.kv", 5), "time_lower_bound_s"] < 1.8e-3
    attn_flops = t.xs("sparse_attn", level="phase")["flops"].max()
    assert 0.5e-3 < attn_flops / 561e12 < 0.7e-3  # ~0.6 ms at FlashMLA speed
    s = est.summary("fwd")
    assert s.comm_s > s.attention_s
    # same point intra-node (258 GB/s) stays below the attention bound
    fast = estimate(FLASH, 4, [cp * per_rank], cp, Machine.preset("h200x2")).summary("fwd")
    assert fast.comm_s < fast.attention_s


# ------------------------------------------------------------------------------ extrapolation
def test_extrapolate_shows_the_crossover_and_is_fast():
    start = time.perf_counter()
    table = extrapolate(FLASH, 4, "one", cps=(2, 8, 16, 32, 64), tokens_per_rank=(4 * K, 32 * K),
                        machine=Machine.preset("internode"))
    assert list(table.columns) == list(EXTRAPOLATE_COLUMNS)
    assert len(table) == 10
    point = table[(table["cp"] == 64) & (table["tokens_per_rank"] == 4 * K)].iloc[0]
    assert point["comm_exceeds_attention"] and point["comm_over_attention"] > 2
    small = table[(table["cp"] == 2) & (table["tokens_per_rank"] == 32 * K)].iloc[0]
    assert not small["comm_exceeds_attention"]
    # comm per rank grows with cp at fixed tokens per rank (O(total)); attention does not
    col = table[table["tokens_per_rank"] == 4 * K].sort_values("cp")
    assert col["comm_bytes_per_rank"].is_monotonic_increasing
    big = extrapolate(FLASH, 4, "histogram", cps=(8, 16, 32, 64), tokens=(1 << 9, 1 << 20))
    assert set(big["tokens"]) == {1 << 20}  # 512 tokens leave fewer rows per rank than the halo: skipped
    assert time.perf_counter() - start < 10


def test_h_and_w_layers():
    w = estimate(FLASH, 0, [1 << 14], 4)
    assert set(w.table()["phase"]) == set(layer_phases("W"))
    assert w.summary("fwd").comm_s > 0  # the halo only
    h = estimate(FLASH, 128, [1 << 14], 4)
    assert set(h.table()["phase"]) == set(layer_phases("H"))
    t = h.table("fwd").set_index(["phase", "rank"])
    # rank 3: queries at positions [12K, 16K): every one sees W window keys and (pos+1)//128 entries
    pos = np.arange(3 * 4096, 4 * 4096)
    keys = (np.minimum(pos + 1, 128) + (pos + 1) // 128).sum()
    assert t.loc[("sparse_attn", 3), "flops"] == keys * FLASH.n_heads * 4 * FLASH.head_dim


# ------------------------------------------------------------------------------ schema, measured vs bound
def test_table_schema_and_nvtx_names():
    from dsv4cp.profiling.nvtx import PHASES as NVTX_PHASES

    est = estimate(TINY, 4, [100, 28], 2)
    table = est.table()
    assert list(table.columns) == list(COLUMNS)
    assert set(table["direction"]) == {"fwd", "bwd"}
    assert set(table["phase"]) == set(PHASES)
    assert (table[["flops", "hbm_bytes", "comm_bytes", "time_lower_bound_s"]] >= 0).all().all()
    for phase in PHASES:
        for direction in phase_directions(phase):
            for name in nvtx_ranges(phase, direction):
                assert name in NVTX_PHASES
                assert range_to_phase("dsv4cp." + name) == (phase, direction)
    assert range_to_phase("dsv4cp.step") is None
    frame = est.summary_frame()
    assert list(frame["direction"]) == ["fwd", "bwd", "fwd+bwd"]


def test_measured_ranges_face_the_phases_whose_work_they_time():
    """The top-k's range times the model's scoring and selection; the loss's score ranges count as the loss.
    Every other range and phase pair as :func:`nvtx_ranges` names them."""
    from dsv4cp.profiling.nvtx import PHASES as NVTX_PHASES

    for direction in ("fwd", "bwd"):
        assert measured_phase(f"dsv4cp.indexer.score.{direction}") == ("indexer.loss", direction)
        assert measured_phase(f"indexer.loss.{direction}") == ("indexer.loss", direction)
    assert measured_phase("dsv4cp.indexer.topk.fwd") == ("indexer.topk", "fwd")
    assert measured_phase("dsv4cp.indexer.score.total") is None and measured_phase("dsv4cp.step") is None
    assert phase_measured_in("indexer.score", "fwd") == ("indexer.topk", "fwd")
    keys = {measured_phase(name) for name in NVTX_PHASES} - {None}
    for phase in PHASES:
        for direction in phase_directions(phase):
            key = phase_measured_in(phase, direction)
            assert key in keys, (phase, direction)  # some range's time faces every phase's bound
            if (phase, direction) != ("indexer.score", "fwd"):
                assert key == (phase, direction)
                assert all(measured_phase(name) == key for name in nvtx_ranges(phase, direction))
    for name in NVTX_PHASES:  # a key a range is measured under is a model phase's, measured there
        key = measured_phase(name)
        assert key is None or phase_measured_in(*key) == key, name
    with pytest.raises(ValueError, match="unknown pair"):
        phase_measured_in("indexer.topk", "bwd")


def test_measured_vs_bound():
    est = estimate(FLASH, 4, [1 << 16], 2)
    s = est.summary("fwd")
    rec = measured_vs_bound(2 * s.bound_overlap_s, est)
    assert rec["efficiency"] == pytest.approx(0.5)
    assert rec["model_tflops_per_gpu"] == pytest.approx(s.model_flops / (2 * s.bound_overlap_s * 2) / 1e12)
    per_rank = measured_vs_bound([1e-2, 3e-2], est)
    assert per_rank["measured_s"] == 3e-2 and per_rank["measured_time_imbalance"] == pytest.approx(1.5)
    phases = measured_vs_bound({"sparse_attn": 1e-2}, est)
    assert phases.iloc[0]["efficiency"] == pytest.approx(s.attention_s / 1e-2)
    breakdown = pd.DataFrame({
        "rank": [0, 0, 1, 1], "compute_ms": [4.0, 0.0, 5.0, 0.1], "comm_ms": [0.0, 0.2, 0.0, 0.0],
        "phase": ["dsv4cp.sparse_attn.fwd", "dsv4cp.allgather.kv.wait", "dsv4cp.sparse_attn.fwd", "total"],
    })
    out = measured_vs_bound(breakdown, est).set_index(["rank", "phase", "direction"])
    assert len(out) == 3
    assert out.loc[(0, "allgather.kv", "fwd"), "measured_s"] == pytest.approx(2e-4)
    bound = est.table("fwd", 1).set_index("phase").loc["sparse_attn", "time_lower_bound_s"]
    assert out.loc[(1, "sparse_attn", "fwd"), "efficiency"] == pytest.approx(bound / 5e-3)
    with pytest.raises(ValueError, match="measured"):
        measured_vs_bound([1.0], est)


def test_a_breakdown_faces_the_bounds_of_the_work_its_ranges_time(seed):
    """The top-k's range against the model's scoring + selection, the loss's score ranges with the loss."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    est = estimate(FLASH, 4, [1 << 14, 1 << 13], 2)
    names = ["dsv4cp.indexer.topk.fwd", "dsv4cp.indexer.score.fwd", "dsv4cp.indexer.loss.fwd",
             "dsv4cp.indexer.score.bwd", "dsv4cp.indexer.loss.bwd"]
    ms = rng.uniform(0.1, 20.0, size=(2, len(names)))
    breakdown = pd.DataFrame([{"rank": r, "phase": n, "compute_ms": ms[r, i], "comm_ms": 0.0}
                              for r in range(2) for i, n in enumerate(names)])
    out = measured_vs_bound(breakdown, est).set_index(["rank", "phase", "direction"])
    bounds = est.records.set_index(["rank", "phase", "direction"])["time_lower_bound_s"]
    assert sorted({p for _, p, _ in out.index}) == ["indexer.loss", "indexer.topk"]
    for r in range(2):
        topk = out.loc[(r, "indexer.topk", "fwd")]
        assert topk["measured_s"] == pytest.approx(ms[r, 0] / 1e3)
        both = bounds[(r, "indexer.score", "fwd")] + bounds[(r, "indexer.topk", "fwd")]
        assert topk["bound_s"] == pytest.approx(both, rel=1e-12) and both > 2 * bounds[(r, "indexer.topk", "fwd")]
        for direction, (score, loss) in (("fwd", (1, 2)), ("bwd", (3, 4))):
            row = out.loc[(r, "indexer.loss", direction)]
            assert row["measured_s"] == pytest.approx((ms[r, score] + ms[r, loss]) / 1e3)
            assert row["bound_s"] == pytest.approx(bounds[(r, "indexer.loss", direction)], rel=1e-12)


# ------------------------------------------------------------------------------ what runs, at which limits
SELECTED_64K = 523_264 + (65536 - 2047) * 512
"""Sum over the queries of one 65536-token document of the keys a ratio-4 sparse loss scores, by hand:
``min(K, (t + 1) // 4)`` with K = 512; below t + 1 = 2048 the sum of ``n // 4`` is 4 (1 + ... + 510) + 4 * 511
= 523264, then 63489 queries of 512."""


def test_the_sparse_loss_on_the_selections_scores_prices_no_rescoring():
    cfg = FLASH
    D, H, Hi, Di, K = cfg.head_dim, cfg.n_heads, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    L = 65536
    by_variant = {}
    for selection in (True, False):
        est = estimate(cfg, 4, [L], 1, Machine.preset("h200x2"), selection_scores=selection)
        rows = est.table("fwd").set_index("phase")
        by_variant[selection] = rows
        rescoring = 0 if selection else 2 * Hi * Di * SELECTED_64K
        assert rows.loc["indexer.loss", "flops"] == 2 * D * H * SELECTED_64K + rescoring
    selection, recompute = by_variant[True], by_variant[False]
    gathered = est.counts.gathered_rows
    # recompute reads the indexer's queries, head weights and keys; selection reads [L, K] fp32 scores ...
    assert (recompute.loc["indexer.loss", "hbm_bytes"] - selection.loc["indexer.loss", "hbm_bytes"]
            == 2 * (L * Hi * Di + L * Hi + gathered * Di) - 4 * L * K)
    # ... which the top-k writes beside its indices
    assert selection.loc["indexer.topk", "hbm_bytes"] - recompute.loc["indexer.topk", "hbm_bytes"] == 4 * L * K
    backward = [estimate(cfg, 4, [L], 1, Machine.preset("h200x2"), selection_scores=s).table("bwd")
                for s in (True, False)]
    pd.testing.assert_frame_equal(*backward)  # the scores' backward runs either way


def test_the_default_bound_follows_the_kernel_options_given_and_the_dense_loss_always_rescores():
    from dsv4cp import kernel_options
    from dsv4cp.kernel_options import KernelOptions

    machine = Machine.preset("h200x2")
    def loss_flops(cfg, **kwargs):
        return estimate(cfg, 4, [65536], 1, machine, **kwargs).table("fwd").set_index("phase").loc["indexer.loss",
                                                                                                    "flops"]
    assert KernelOptions().indexer_loss_scores == "selection"
    assert loss_flops(FLASH) == loss_flops(FLASH, selection_scores=True)
    recompute = KernelOptions.resolve({"indexer_loss_scores": "recompute"})
    assert loss_flops(FLASH, kernel_options=recompute) == loss_flops(FLASH, selection_scores=False) \
        > loss_flops(FLASH, selection_scores=True)
    with kernel_options.overrides({"indexer_loss_scores": "recompute"}):  # the model reads no global: as given
        assert loss_flops(FLASH) == loss_flops(FLASH, selection_scores=True)
    dense = FLASH.replace(indexer_loss="dense")
    assert loss_flops(dense, selection_scores=True) == loss_flops(dense, selection_scores=False)


def test_the_physical_bound_is_at_the_h200_spec_sheet():
    from dsv4cp.model.machine import H200_SPEC, physical_limits

    measured = Machine.preset("h200x2")
    spec = physical_limits(measured)
    assert (spec.peak_flops, spec.hbm_bandwidth, spec.allgather_busbw, spec.p2p_bandwidth) == (
        989e12, 4.8e12, 450e9, 450e9) == (H200_SPEC.peak_flops, H200_SPEC.hbm_bandwidth, H200_SPEC.allgather_busbw,
                                          H200_SPEC.p2p_bandwidth)
    assert physical_limits(measured.with_bandwidth(40e9)).allgather_busbw == 40e9  # a stated link limit stays
    cpu = Machine.preset("cpu-estimate")
    assert physical_limits(cpu) == cpu  # no spec sheet: its own ceilings
    # every compute phase is bound by FLOPs or by HBM bytes: at CP = 1 the physical bound is the measured one
    # scaled by 784/989 (FLOP-bound phases) to 4.26/4.8 (HBM-bound ones)
    at = {m.name: estimate(FLASH, 4, [65536], 1, m).summary("fwd+bwd").bound_overlap_s for m in (measured, spec)}
    ratio = at[spec.name] / at[measured.name]
    assert 784 / 989 <= ratio <= 4.26 / 4.8 and ratio < 0.85
