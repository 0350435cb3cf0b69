"""The predicted CP step: each rank's compute plus the modelled communication not hidden by the compute the
layer schedules while it flies; the slowest rank sets the step. Checked against hand sums of the cost
model's own phase bounds, on random per-rank compute from fixed seeds."""

from __future__ import annotations

import random

import pytest

from dsv4cp.config import DSv4Config
from dsv4cp.model import Machine, estimate, phase_measured_in
from dsv4cp.model.step_prediction import OVERLAP_WINDOWS, predict_step
from dsv4cp.packing import PackedSeqs
from dsv4cp.records import make_record
from dsv4cp.sweeps.prediction import prediction_frame, traced_compute
from dsv4cp.sweeps.spec import make_point

SLOW_LINKS = Machine(name="slow-links", allgather_busbw=1e6, p2p_bandwidth=1e6)
"""Links so slow that every collective outlasts its window: the exposure is then exact arithmetic."""


def _estimate(ratio: int, cp: int, machine: Machine = SLOW_LINKS):
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([700, 0, 300, 24], total=1024)
    return estimate(cfg, ratio, packed, cp, machine)


def _bounds_ms(est, resource: str | None = None) -> dict[tuple[int, str, str], float]:
    table = est.table()
    if resource is not None:
        table = table[table["resource"] == resource]
    return {(int(r), p, d): t * 1e3 for r, p, d, t in
            zip(table["rank"], table["phase"], table["direction"], table["time_lower_bound_s"])}


@pytest.mark.parametrize("ratio", [0, 4, 8])
@pytest.mark.parametrize("cp", [2, 4])
def test_no_overlap_exposes_every_transfer(ratio, cp, seed):
    print(f"seed {seed}")
    rng = random.Random(seed * 7 + ratio + cp)
    est = _estimate(ratio, cp)
    compute = [rng.uniform(1.0, 20.0) for _ in range(cp)]
    prediction = predict_step(est, compute, overlap="none")
    comm = _bounds_ms(est, "comm")
    for rank in range(cp):
        expected = sum(ms for (r, _, _), ms in comm.items() if r == rank)
        assert prediction.comm_ms[rank] == pytest.approx(expected, rel=1e-12)
        assert prediction.exposed_comm_ms[rank] == pytest.approx(expected, rel=1e-12)
    totals = [c + e for c, e in zip(compute, prediction.exposed_comm_ms)]
    assert prediction.step_ms == pytest.approx(max(totals), rel=1e-12)
    assert prediction.slowest_rank == totals.index(max(totals))


@pytest.mark.parametrize("ratio", [4, 8])
def test_async_hides_each_collective_behind_its_window(ratio, seed):
    rng = random.Random(seed + ratio)
    est = _estimate(ratio, 2)
    comm, bounds = _bounds_ms(est, "comm"), _bounds_ms(est)
    measured = {key: rng.uniform(0.0, 2.0) * ms for key, ms in bounds.items()}
    prediction = predict_step(est, [5.0, 6.0], overlap="async", phase_compute_ms=measured)
    for rank in range(2):
        expected = 0.0
        for (r, phase, direction), transfer in comm.items():
            if r != rank:
                continue
            keys = dict.fromkeys(phase_measured_in(*key) for key in OVERLAP_WINDOWS.get((phase, direction), ()))
            window = sum(measured.get((rank, *key), 0.0) for key in keys)  # a measured key's time counts once
            expected += max(0.0, transfer - window)
        assert prediction.exposed_comm_ms[rank] == pytest.approx(expected, rel=1e-12)
    halo_only = predict_step(est, [5.0, 6.0], overlap="async",
                             phase_compute_ms={key: 1e12 for key in bounds})  # windows outlast every transfer
    for rank in range(2):
        halo = sum(ms for (r, p, _), ms in comm.items() if r == rank and p == "halo")
        assert halo_only.exposed_comm_ms[rank] == pytest.approx(halo, rel=1e-12)


def test_the_kv_gathers_window_holds_the_measured_top_k_once_and_not_the_losss_scores(seed):
    """Traced ranges: ``indexer.topk.fwd`` times the model's scoring and selection, so the compressed KV
    gather's window takes its time in place of both bounds; the loss's ``indexer.score.fwd`` (run after the
    gather's wait) counts as the loss, in no window."""
    rng = random.Random(seed)
    print(f"seed {seed}")
    est = _estimate(4, 2)  # slow links: every transfer outlasts its window, so each window's time is hidden
    bounds = _bounds_ms(est)
    names = ("q_proj.fwd", "indexer.q_proj.fwd", "indexer.topk.fwd", "indexer.score.fwd", "indexer.loss.fwd")
    phases = [{"rank": rank, "phase": f"dsv4cp.{name}", "compute_ms": rng.uniform(0.1, 3.0), "idle_ms": 0.0}
              for rank in range(2) for name in names]
    phases += [{"rank": rank, "phase": "total", "compute_ms": 20.0, "idle_ms": 0.0} for rank in range(2)]
    compute, per_phase = traced_compute(phases, 2)
    traced = {(row["rank"], row["phase"]): row["compute_ms"] for row in phases}
    assert not any(phase == "indexer.score" for _, phase, _ in per_phase)
    assert per_phase[(0, "indexer.loss", "fwd")] == pytest.approx(
        traced[(0, "dsv4cp.indexer.score.fwd")] + traced[(0, "dsv4cp.indexer.loss.fwd")])

    def exposed(measured: dict) -> float:
        return predict_step(est, compute, overlap="async", phase_compute_ms=measured).exposed_comm_ms[0]

    base, delta = exposed(per_phase), rng.uniform(0.01, 0.1)
    topk = (0, "indexer.topk", "fwd")
    assert exposed({**per_phase, topk: per_phase[topk] + delta}) == pytest.approx(base - delta, rel=1e-12)
    loss = (0, "indexer.loss", "fwd")
    assert exposed({**per_phase, loss: per_phase[loss] + delta}) == pytest.approx(base, rel=1e-12)
    unmeasured = {key: ms for key, ms in per_phase.items() if key != topk}  # the model's bounds stand in
    selection = bounds[(0, "indexer.score", "fwd")] + bounds[topk]
    assert bounds[(0, "indexer.score", "fwd")] > 0
    assert exposed(unmeasured) == pytest.approx(base + per_phase[topk] - selection, rel=1e-12)


def test_forward_only_counts_forward_collectives():
    est = _estimate(4, 2)
    comm = _bounds_ms(est, "comm")
    prediction = predict_step(est, [1.0, 1.0], overlap="none", direction="fwd")
    assert prediction.comm_ms[0] == pytest.approx(sum(ms for (r, _, d), ms in comm.items() if r == 0 and d == "fwd"))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"compute_ms": [1.0]}, "compute_ms"), ({"compute_ms": [1.0, float("nan")]}, r"compute_ms\[1\]"),
    ({"compute_ms": [1.0, -2.0]}, r"compute_ms\[1\]"), ({"compute_ms": [1.0, 1.0], "overlap": "sync"}, "overlap"),
    ({"compute_ms": [1.0, 1.0], "direction": "bwd"}, "direction"),
])
def test_bad_arguments_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        predict_step(_estimate(4, 2), **kwargs)


def _phases(cp: int, rng: random.Random) -> list[dict]:
    rows = []
    for rank in range(cp):
        for phase in ("dsv4cp.q_proj.fwd", "dsv4cp.q_proj.bwd", "dsv4cp.step", "dsv4cp.compress.fwd"):
            rows.append({"rank": rank, "phase": phase, "compute_ms": rng.uniform(0.1, 3.0), "idle_ms": 0.0})
        rows.append({"rank": rank, "phase": "total", "compute_ms": rng.uniform(10, 20), "idle_ms": rng.uniform(0, 2)})
    return rows


def test_traced_compute_is_busy_plus_idle_per_rank(seed):
    rng = random.Random(seed)
    phases = _phases(3, rng)
    compute, per_phase = traced_compute(phases, 3)
    totals = [row for row in phases if row["phase"] == "total"]
    assert compute == [row["compute_ms"] + row["idle_ms"] for row in totals]
    q_fwd = next(row for row in phases if row["rank"] == 2 and row["phase"] == "dsv4cp.q_proj.fwd")
    assert per_phase[(2, "q_proj", "fwd")] == q_fwd["compute_ms"] and (0, "step", "fwd") not in per_phase
    with pytest.raises(ValueError, match=r"rank\(s\) \[3\]"):
        traced_compute(phases, 4)


def test_prediction_frame_sets_prediction_beside_measurement(seed):
    rng = random.Random(seed)
    point = make_point({"preset": "tiny", "ratio": 4, "cp": 2, "tokens": 512, "packing": "one"})
    phases = _phases(2, rng)
    real = make_record(point.axes(), {"time_ms_median": 30.0, "phases": phases, "split": [0, 256, 512]},
                       sweep="t", status="ok", machine="m", git_sha=None)
    summary_axes = {**point.axes(), "emulated_rank": "all"}
    emulated = make_record(summary_axes, {"time_ms_median": 21.0, "rank_time_ms_median": [12.0, 21.0]},
                           sweep="t", status="ok", machine="m", git_sha=None)
    base = make_record({**point.axes(), "cp": 1, "tokens_per_rank": None}, {"time_ms_median": 40.0},
                       sweep="t", status="ok", machine="m", git_sha=None)
    frame = prediction_frame([real, emulated, base], Machine())
    assert list(frame["source"]) == ["traced", "emulated"]
    traced = frame.iloc[0]
    compute, _ = traced_compute(phases, 2)
    assert traced["predicted_ms"] >= max(compute) and traced["measured_ms"] == 30.0
    assert traced["error_pct"] == pytest.approx(100 * (traced["predicted_ms"] - 30.0) / 30.0)
    row = frame.iloc[1]
    assert row["predicted_ms"] >= 21.0 and row["cp1_ms"] == 40.0
    assert row["predicted_over_cp1"] == pytest.approx(row["predicted_ms"] / 40.0)
