"""Diagnosis of one step (docs/design.md §5): the parts of each rank's step, on synthetic traces with known
waits, idle time and communication, and on a real tiny CPU profiled sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prof_helpers import K, R, write_kineto
from report_helpers import grid, point_metrics, write_run

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.model import LayerEstimate, estimate
from dsv4cp.profiling.overlap import KernelRecord, RangeRecord, attribution_table, step_decomposition
from dsv4cp.records import append_record, make_record, point_id, read_records
from dsv4cp.report import diagnosis as diagnosis_module
from dsv4cp.report import load_runs, write_report
from dsv4cp.report.load import load_trace
from dsv4cp.report.tables import record_machine, record_selection_scores
from dsv4cp.workloads import packing_lengths

NS_MS = 5e-6
"""Tolerance of a time read back from a trace, in ms: its events' times are rounded to the nanosecond."""
STEPS = 2
STEP_GAP_US = 3000.0
START_US = 10.0
"""Kernels of a step start this long after its range opens (the host launches them first)."""


def _scenario(seed: int, unmatched: bool = False) -> tuple[list[K], list[R], dict]:
    """Two ranks, two steps, GPU-style (kernels attributed by launch). Per rank and step:
    compute ``a`` (with a concurrent kernel over its [0.2a, 0.4a]), an all-gather of ``c``, an idle gap
    ``g``, compute ``b``; rank 1 also computes ``w`` = 30% of the transfer inside its transfer.
    ``unmatched``: rank 0 also runs a send of ``u`` after its gather, in its idle gap, that no peer has.
    Returns kernels, ranges and the known per-step means of every part."""
    rng = np.random.default_rng(seed)
    draw = {name: rng.uniform(low, high, size=(2, STEPS)) for name, low, high in
            (("a", 100, 300), ("c", 50, 300), ("g", 40, 100), ("b", 100, 400))}
    transfer = draw["c"].min(axis=0)
    kernels, ranges = [], []
    known = {rank: {k: 0.0 for k in ("step", "compute", "wait", "exposed", "unmatched", "idle", "q_proj.fwd",
                                     "indexer.q_proj.fwd", "allgather.kv.launch", "sparse_attn.fwd")}
             for rank in (0, 1)}
    for rank in (0, 1):
        for step in range(STEPS):
            a, c, g, b = (float(draw[n][rank, step]) for n in "acgb")
            t = float(transfer[step])
            o = step * STEP_GAP_US
            k0 = o + START_US
            span = a + c + g + b
            ranges += [R(rank, "step", o, k0 + span), R(rank, "q_proj.fwd", o, o + 1.5),
                       R(rank, "indexer.q_proj.fwd", o + 1.5, o + 3), R(rank, "allgather.kv.launch", o + 3, o + 4.5),
                       R(rank, "sparse_attn.fwd", o + 4.5, o + 6)]
            kernels += [
                K(rank, 7, k0, k0 + a, "gemm", launch=o + 1),
                K(rank, 9, k0 + 0.2 * a, k0 + 0.4 * a, "concurrent", launch=o + 2),
                K(rank, 8, k0 + a, k0 + a + c, "ncclDevKernel_AllGather_RING_LL", launch=o + 3.5),
                K(rank, 7, k0 + a + c + g, k0 + span, "attn", launch=o + 5),
            ]
            w = 0.0
            if rank == 1:  # compute covering part of the transfer: the end t of the instance
                w = 0.3 * t
                start = k0 + a + c - t + 0.1 * t
                kernels.append(K(rank, 9, start, start + w, "cover", launch=o + 4))
            u = 0.0
            if unmatched and rank == 0:
                u = 0.5 * g
                kernels.append(K(rank, 10, k0 + a + c, k0 + a + c + u, "ncclDevKernel_SendRecv", launch=o + 4))
            mine = known[rank]
            mine["step"] += span / STEPS
            mine["compute"] += (a + b + w) / STEPS
            mine["wait"] += (c - t) / STEPS
            mine["exposed"] += (t - w + u) / STEPS
            mine["unmatched"] += u / STEPS
            mine["idle"] += (g - u) / STEPS
            mine["q_proj.fwd"] += 0.8 * a / STEPS
            mine["indexer.q_proj.fwd"] += 0.2 * a / STEPS
            mine["allgather.kv.launch"] += w / STEPS
            mine["sparse_attn.fwd"] += b / STEPS
    return kernels, ranges, known


@pytest.mark.parametrize("unmatched", [False, True])
def test_decomposition_of_synthetic_traces_recovers_every_known_part(tmp_path, seed, unmatched):
    kernels, ranges, known = _scenario(seed, unmatched)
    write_kineto(tmp_path, kernels, ranges)
    table, phases = step_decomposition(*load_trace(tmp_path), "dsv4cp.step")
    us = 1e-3  # the scenario is in microseconds, the tables in ms
    for row in table.itertuples(index=False):
        want = known[row.rank]
        assert row.steps == STEPS
        assert row.step_ms == pytest.approx(want["step"] * us, abs=NS_MS)
        assert row.compute_ms == pytest.approx(want["compute"] * us, abs=NS_MS)
        assert row.imbalance_wait_ms == pytest.approx(want["wait"] * us, abs=NS_MS)
        assert row.exposed_comm_ms == pytest.approx(want["exposed"] * us, abs=NS_MS)
        assert row.unmatched_comm_ms == pytest.approx(want["unmatched"] * us, abs=NS_MS)
        assert row.host_idle_ms == pytest.approx(want["idle"] * us, abs=NS_MS)
        parts = row.compute_ms + row.imbalance_wait_ms + row.exposed_comm_ms + row.host_idle_ms
        assert parts == pytest.approx(row.step_ms, rel=1e-9)
        mine = phases[phases["rank"] == row.rank].groupby("phase")["compute_ms"].sum()
        assert mine.sum() == pytest.approx(row.compute_ms, rel=1e-9)  # the split is exclusive
        for phase in ("q_proj.fwd", "indexer.q_proj.fwd", "sparse_attn.fwd"):
            assert mine[f"dsv4cp.{phase}"] == pytest.approx(want[phase] * us, abs=NS_MS)
        assert mine.get("dsv4cp.allgather.kv.launch", 0.0) == pytest.approx(want["allgather.kv.launch"] * us, abs=NS_MS)


def test_a_host_op_blocked_in_a_nested_collective_is_communicating(seed):
    """CPU-style records (no launch times): an autograd op encloses a blocking send; a worker thread's
    gather runs beside the main thread's compute and is hidden by it."""
    rng = np.random.default_rng(seed)
    send, recv = rng.uniform(200, 400), rng.uniform(50, 150)  # rank 0 blocks longer: it waits for rank 1
    lead, tail, span = rng.uniform(50, 100), rng.uniform(50, 100), 1000.0

    def us(x: float) -> int:
        return int(round(x * 1000))

    kernels, ranges = [], []
    for rank, comm in ((0, send), (1, recv)):
        ranges.append(RangeRecord(rank, "dsv4cp.step", 0, us(span)))
        ranges.append(RangeRecord(rank, "dsv4cp.halo.fwd", us(lead / 2), us(lead + comm + tail / 2)))
        kernels += [
            KernelRecord(rank, 1, 0, us(lead + comm + tail), "_HaloExchange", is_comm=False),
            KernelRecord(rank, 1, us(lead), us(lead + comm), "c10d::send" if rank == 0 else "c10d::recv_", True),
            KernelRecord(rank, 1, us(lead + comm + tail), us(span), "aten::mm", is_comm=False),
            KernelRecord(rank, 2, us(lead / 4), us(lead / 2), "gloo:all_gather", is_comm=True),  # hidden
        ]
    table, _ = step_decomposition(kernels, ranges, "dsv4cp.step")
    table = table.set_index("rank")
    transfer = recv
    assert table.loc[0, "imbalance_wait_ms"] == pytest.approx((send - transfer) / 1e3, abs=2e-6)
    for rank, comm in ((0, send), (1, recv)):
        assert table.loc[rank, "compute_ms"] == pytest.approx((span - comm) / 1e3, abs=2e-6)
        assert table.loc[rank, "exposed_comm_ms"] == pytest.approx(transfer / 1e3, abs=2e-6)
        assert table.loc[rank, "host_idle_ms"] == pytest.approx(0.0, abs=1e-9)
    assert table.loc[1, "imbalance_wait_ms"] == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------------------------- with the model
def _model_estimates(point: dict) -> tuple[LayerEstimate, LayerEstimate]:
    """The cost model of a point with and without capacity padding, built directly from its axes."""
    cfg = DSv4Config.preset(point["preset"], indexer_loss=point["loss"])
    lengths = packing_lengths(point["packing"], point["tokens"], cp=point["cp"], ratio=point["ratio"],
                              seed=int(point["seed"]))
    machine = record_machine(pd.Series(point))  # the record's bound machine (h200x2 for records without one)
    scores = record_selection_scores(pd.Series(point))  # what the record's loss ran (no options: re-scoring)
    return tuple(estimate(cfg, point["ratio"], lengths, point["cp"], machine, total=point["tokens"], padding=padding,
                          selection_scores=scores) for padding in (True, False))


def _model_reference(point: dict, bound_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the compute bound without padding and the padding's time (ms), from the cost model
    directly, scaled so the slowest rank's padded bound equals ``bound_ms`` (the record's)."""
    padded, plain = (est.summary(point["pass"]) for est in _model_estimates(point))
    scale = bound_ms / (padded.bound_overlap_s * 1e3)
    bound = np.array(plain.rank_compute_s) * 1e3 * scale
    return bound, np.array(padded.rank_compute_s) * 1e3 * scale - bound


def _profiled_run(tmp_path: Path, seed: int) -> tuple[Path, dict, dict]:
    """A run of one profiled CP = 2 point (flash C, 256 tokens of short documents: their tails leave
    capacity padding) whose traces are the synthetic scenario."""
    (point,) = grid(cp=[2], tokens=[256], packing=["adversarial"], overlap=["async"])
    run = write_run(tmp_path / "run", [point], seed=seed)
    kernels, ranges, known = _scenario(seed)
    write_kineto(run / "traces" / point_id(point), kernels, ranges)
    return run, point, known


def test_diagnosis_parts_sum_to_the_step_and_each_matches_its_known_value(tmp_path, seed):
    run, point, known = _profiled_run(tmp_path, seed)
    (record,) = read_records(run)
    tables = diagnosis_module.diagnosis_tables(load_runs(run))
    ranks = tables["diagnosis"].set_index("rank")
    bound, padding = _model_reference(point, record["bound_ms"])
    assert (padding > 0).all()
    for rank in (0, 1):
        row, want = ranks.loc[rank], known[rank]
        assert row["kind"] == diagnosis_module.MEASURED
        parts = sum(row[p] for p in diagnosis_module.PARTS)
        assert parts == pytest.approx(row["step_ms"], rel=0.02)
        assert row["step_ms"] == pytest.approx(want["step"] / 1e3, abs=NS_MS)
        assert row["bound_ms"] == pytest.approx(bound[rank], rel=1e-6)
        assert row["padding_ms"] == pytest.approx(padding[rank], rel=1e-6)
        assert row["kernel_excess_ms"] == pytest.approx(want["compute"] / 1e3 - bound[rank] - padding[rank], abs=NS_MS)
        assert row["imbalance_wait_ms"] == pytest.approx(want["wait"] / 1e3, abs=NS_MS)
        assert row["exposed_comm_ms"] == pytest.approx(want["exposed"] / 1e3, abs=NS_MS)
        assert row["host_idle_ms"] == pytest.approx(want["idle"] / 1e3, abs=NS_MS)
        assert abs(row["unattributed_ms"]) < 1e-6
        parts_above = {p: row[p] for p in diagnosis_module.CAUSES}
        assert row["cause"] == diagnosis_module.CAUSES[max(parts_above, key=parts_above.get)]
        assert row["cause_share"] == pytest.approx(max(parts_above.values()) / (row["step_ms"] - row["bound_ms"]))
    phases = tables["diagnosis_phases"]
    for rank in (0, 1):
        mine = phases[phases["rank"] == rank].set_index("phase")
        # the phase split of the excess sums to the rank's excess; a measured phase against its own bound
        assert mine["excess_ms"].sum() == pytest.approx(ranks.loc[rank, "kernel_excess_ms"], rel=1e-6)
        attn = mine.loc["sparse_attn.fwd"]
        assert attn["compute_ms"] == pytest.approx(known[rank]["sparse_attn.fwd"] / 1e3, abs=NS_MS)
        assert attn["measured_over_bound"] == pytest.approx(
            attn["compute_ms"] / (attn["bound_ms"] + attn["padding_ms"]), rel=1e-9)
    stragglers = tables["stragglers"].set_index("phase")
    attn = [known[r]["sparse_attn.fwd"] for r in (0, 1)]
    assert stragglers.loc["sparse_attn.fwd", "max_over_mean"] == pytest.approx(max(attn) / np.mean(attn), rel=1e-4)
    assert stragglers.loc["sparse_attn.fwd", "slowest_rank"] == int(np.argmax(attn))


INDEXER_RANGES: tuple[tuple[str, float, float], ...] = (
    ("indexer.topk.fwd", 100.0, 200.0), ("indexer.loss.fwd", 300.0, 600.0), ("indexer.score.fwd", 400.0, 500.0),
    ("indexer.score.bwd", 700.0, 800.0), ("indexer.loss.bwd", 900.0, 1000.0),
)
"""(range, host start, host end) in us of one step; the loss's forward scores run nested inside its range."""


def test_the_indexer_ranges_face_the_bounds_of_the_work_they_time(tmp_path, seed):
    """Random kernel times under the top-k's, the loss's and the loss's scores' ranges (one rank, one step):
    ``indexer.topk.fwd`` faces the model's scoring + selection bounds, the loss's classes hold its scores."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    (point,) = grid(cp=[1], tokens=[4096], packing=["one"])
    run = write_run(tmp_path / "run", [point], seed=seed)
    (record,) = read_records(run)
    kernel_us = {name: float(rng.uniform(10.0, 60.0)) for name, _, _ in INDEXER_RANGES}
    kernel_us["indexer.topk.fwd"] *= 2000.0  # above the whole bound: the excess the summary names
    kernels, ranges, t = [], [R(0, "step", 0.0, 1e6)], 2000.0
    for corr, (name, start, end) in enumerate(INDEXER_RANGES):
        ranges.append(R(0, name, start, end))
        kernels.append(K(0, 7, t, t + kernel_us[name], f"kernel{corr}", launch=start + 10.0))  # inside the range
        t += kernel_us[name]
    write_kineto(run / "traces" / point_id(point), kernels, ranges)
    tables = diagnosis_module.diagnosis_tables(load_runs(run))
    phases = tables["diagnosis_phases"].set_index("phase")
    assert not any(name.startswith("indexer.score") for name in phases.index)
    padded, plain = (est.records.set_index(["phase", "direction"])["time_lower_bound_s"] * 1e3
                     for est in _model_estimates(point))
    scale = record["bound_ms"] / (_model_estimates(point)[0].summary(point["pass"]).bound_overlap_s * 1e3)
    assert tables["diagnosis"]["bound_scale"].iloc[0] == pytest.approx(scale, rel=1e-9)
    topk = phases.loc["indexer.topk.fwd"]
    selection = [("indexer.score", "fwd"), ("indexer.topk", "fwd")]
    assert topk["compute_ms"] == pytest.approx(kernel_us["indexer.topk.fwd"] / 1e3, abs=NS_MS)
    assert topk["bound_ms"] == pytest.approx(scale * sum(plain[k] for k in selection), rel=1e-9)
    assert topk["bound_ms"] > 2 * scale * plain[("indexer.topk", "fwd")]  # the scoring is most of it
    assert topk["padding_ms"] == pytest.approx(scale * sum(padded[k] - plain[k] for k in selection), abs=1e-12)
    for direction in ("fwd", "bwd"):
        loss = phases.loc[f"indexer.loss.{direction}"]
        both = kernel_us[f"indexer.loss.{direction}"] + kernel_us[f"indexer.score.{direction}"]
        assert loss["compute_ms"] == pytest.approx(both / 1e3, abs=NS_MS)
        assert loss["bound_ms"] == pytest.approx(scale * plain[("indexer.loss", direction)], rel=1e-9)
    (rank,) = tables["diagnosis"].itertuples(index=False)
    assert rank.cause_phase == "indexer.topk.fwd"
    assert rank.cause_phase_over_bound == pytest.approx(
        topk["compute_ms"] / (topk["bound_ms"] + topk["padding_ms"]), rel=1e-9)


def test_summary_names_the_slowest_ranks_largest_cause_and_who_waits(tmp_path, seed):
    run, _, known = _profiled_run(tmp_path, seed)
    summary = write_report(load_runs(run), tmp_path / "report").read_text()
    ranks = pd.read_csv(tmp_path / "report" / "tables" / "diagnosis.csv").set_index("rank")
    slow = diagnosis_module.slowest_rank(ranks.reset_index())
    other = 1 - int(slow["rank"])
    (line,) = [ln for ln in summary.splitlines() if ln.startswith("- ") and "of the gap above the bound is" in ln]
    assert f"rank {int(slow['rank'])}: step {slow['step_ms']:.3g} ms" in line
    assert f"{100 * slow['cause_share']:.0f}% of the gap above the bound is {slow['cause']}" in line
    wait = ranks.loc[other, "imbalance_wait_ms"]
    if wait > 0:
        assert f"rank {other} waits {wait:.3g} ms for rank {int(slow['rank'])}" in line
    else:  # the other rank's transfers were the shortest in every step: nobody waits, and no wait is named
        assert " waits " not in line, line
    assert "stragglers (max / mean over ranks): " in line
    assert "No profiled point" not in summary and "`step` is the range around the whole step" in summary


def test_an_emulated_point_is_compute_only(tmp_path, seed):
    (axes,) = grid(cp=[2], tokens=[256], packing=["histogram"], overlap=["async"])
    axes = {**axes, "emulated_rank": 1}
    metrics = point_metrics(np.random.default_rng(seed), axes)
    metrics.update(comm_ms=None, exposed_comm_ms=None, overlap_ratio=None)
    record = make_record(axes, metrics, sweep="profile", status="ok", machine="1xNVIDIA H200", git_sha="0" * 40)
    append_record(tmp_path / "run" / "records.jsonl", record)
    kernels, ranges, known = _scenario(seed)
    write_kineto(tmp_path / "run" / "traces" / record["point_id"], [k for k in kernels if k.rank == 1],
                 [r for r in ranges if r.rank == 1])
    (row,) = diagnosis_module.diagnosis_tables(load_runs(tmp_path / "run"))["diagnosis"].itertuples(index=False)
    assert row.kind == diagnosis_module.EMULATED and row.rank == 1
    assert math.isnan(row.imbalance_wait_ms) and math.isnan(row.exposed_comm_ms)
    # the gather's communication-only time is not a transfer (no peer): it is left unattributed
    assert row.unattributed_ms == pytest.approx((known[1]["wait"] + known[1]["exposed"]) / 1e3, abs=NS_MS)
    parts = sum(getattr(row, p) for p in diagnosis_module.PARTS if not math.isnan(getattr(row, p)))
    assert parts == pytest.approx(row.step_ms, rel=0.02)
    assert "compute only" in diagnosis_module.point_causes(
        diagnosis_module.diagnosis_tables(load_runs(tmp_path / "run"))["diagnosis"])[record["point_id"]]


# ------------------------------------------------------------------------------------- a real run
def test_diagnosis_of_a_real_cpu_profiled_sweep(tmp_path, seed):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""name: tiny
run: {{warmup: 1, reps: 2, trace_steps: 1}}
base: {{preset: tiny, tokens: 256, dtype: fp32, kernel_backend: torch, packing: histogram, seed: {seed % 1000}}}
axes:
  cp: [1, 2]
  ratio: [4]
""")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "run"), "--profile", "--progress", "off"]) == 0
    df = load_runs(tmp_path / "run")
    ranks = diagnosis_module.diagnosis_tables(df)["diagnosis"]
    assert sorted(ranks["cp"].map(int).tolist()) == [1, 2, 2]
    for _, row in ranks.iterrows():
        parts = sum(row[p] for p in diagnosis_module.PARTS)
        assert parts == pytest.approx(row["step_ms"], rel=0.02)
        for part in ("bound_ms", "padding_ms", "imbalance_wait_ms", "exposed_comm_ms", "host_idle_ms"):
            assert row[part] >= -1e-9, part
        point = df[df["point_id"] == row["point_id"]].iloc[0]
        bound, padding = _model_reference(point.to_dict(), point["bound_ms"])
        assert row["bound_ms"] == pytest.approx(bound[row["rank"]], rel=1e-6)
        assert row["padding_ms"] == pytest.approx(padding[row["rank"]], rel=1e-6, abs=1e-12)
        # the step and the idle time as the attribution table (another computation) sees them
        attribution = attribution_table(*load_trace(diagnosis_module.trace_directory(point)), "dsv4cp.step")
        mine = attribution[attribution["rank"] == row["rank"]].iloc[0]
        assert row["step_ms"] == pytest.approx(mine["step_ms"], rel=1e-9)
        assert row["host_idle_ms"] == pytest.approx(mine["idle_ms"], rel=1e-9, abs=1e-9)
    cp2 = ranks[ranks["cp"] == 2]
    assert (cp2["exposed_comm_ms"] + cp2["imbalance_wait_ms"] > 0).all()  # gloo's halo and gathers block


def test_a_missed_target_names_the_cause_its_diagnosis_finds(tmp_path, seed):
    run, point, _ = _profiled_run(tmp_path, seed)
    (record,) = read_records(run)
    meta = json.loads((run / "meta.json").read_text())
    limit = 0.5 * record["time_ms_median"]
    meta["spec"]["targets"] = [{"name": "fast", "metric": "time_ms", "comparison": "<=", "value": limit}]
    (run / "meta.json").write_text(json.dumps(meta))
    summary = write_report(load_runs(run), tmp_path / "report").read_text()
    ranks = pd.read_csv(tmp_path / "report" / "tables" / "diagnosis.csv")
    (line,) = [ln for ln in summary.splitlines() if ln.startswith("- ") and "fast (time_ms" in ln]
    assert f"MISSED by {100 * (record['time_ms_median'] / limit - 1):.1f}%" in line
    assert line.endswith(diagnosis_module.cause_text(ranks))


def test_the_unpadded_estimate_prices_the_owned_entries_only(seed):
    """``estimate(padding=False)``: the gathered buffer holds the entries the ranks own, not cp x capacity."""
    cfg = DSv4Config.preset("flash")
    lengths = packing_lengths("adversarial", 1024, cp=4, ratio=4, seed=seed % 1000)
    padded = estimate(cfg, 4, lengths, 4, total=1024)
    plain = estimate(cfg, 4, lengths, 4, total=1024, padding=False)
    owned = sum(padded.counts.owned_entries)
    assert owned < padded.counts.gathered_rows  # short documents leave empty slots
    gather = plain.table("fwd")
    received = gather[gather["phase"] == "allgather.kv"]["comm_bytes"].to_numpy()
    assert received == pytest.approx(np.full(4, 3 * owned / 4 * cfg.head_dim * 2))
    assert all(a <= b for a, b in zip(plain.step.rank_compute_s, padded.step.rank_compute_s))
    assert sum(plain.step.rank_compute_s) < sum(padded.step.rank_compute_s)
    assert plain.step.rank_flops == padded.step.rank_flops  # padding costs bytes, never FLOPs
