"""The CPU partition measurement (bench/cpu_partition.py): per-phase thread CPU time charged to the
innermost range, per-rank step times under gloo, and the model columns beside them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from bench import cpu_partition
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit

DATA = Path(__file__).resolve().parents[1] / "data" / "cpu-partition"
"""The CPU machine and the prefix-scan calibration of results/2026-12-01-cpu-partition-prefix-topk (copies)."""


def test_phase_clock_charges_the_innermost_open_range(monkeypatch):
    ticks = iter([0.0, 0.001, 0.003, 0.006])  # seconds of thread CPU time at each call
    monkeypatch.setattr(cpu_partition.time, "thread_time", lambda: next(ticks))
    clock = cpu_partition.PhaseCpuClock()
    clock.enter("outer")  # t = 0
    clock.enter("inner")  # t = 1 ms: outer charged 1
    clock.exit("inner")  # t = 3 ms: inner charged 2
    clock.exit("outer")  # t = 6 ms: outer charged 3 more
    assert dict(clock.ms) == pytest.approx({"outer": 4.0, "inner": 2.0})


def test_phases_of_one_step_sum_to_at_most_its_cpu_time():
    clock = cpu_partition.PhaseCpuClock()
    step_ms = cpu_partition.rank_cpu_ms(DSv4Config.preset("tiny"), 4, [256], 256, RowSplit.equal(256, 1),
                                        warmup=0, reps=1, seed=3, clock=clock)
    assert step_ms > 0
    assert {"sparse_attn.fwd", "sparse_attn.bwd", "indexer.topk.fwd"} <= set(clock.ms)
    assert 0 < sum(clock.ms.values()) <= step_ms * (1 + 1e-9)  # every range lies inside the step


def test_phases_out_writes_the_calibration_table(tmp_path, capsys):
    out = tmp_path / "phases.csv"
    cpu_partition.main(["--phases-out", str(out), "--tokens", "256", "--warmup", "0", "--reps", "1"])
    table = pd.read_csv(out)
    assert list(table.columns) == ["rank", "phase", "compute_ms"]
    assert table["phase"].iloc[-1] == "total" and (table["compute_ms"] > 0).all()
    assert table["phase"].iloc[:-1].str.startswith("dsv4cp.").all()
    assert "total" in capsys.readouterr().out


def test_two_gloo_ranks_measure_equal_and_balanced_splits(tmp_path):
    out = tmp_path / "partition.csv"
    cpu_partition.main(["--calibration", str(DATA / "calibration-cpu-prefix.json"),
                        "--machine-file", str(DATA / "machine-cpu.json"), "--tokens", "512", "--cps", "2",
                        "--packings", "one", "--warmup", "0", "--reps", "1", "--out", str(out)])
    table = pd.read_csv(out)
    assert table["policy"].tolist() == ["equal", "balanced:prefix"]
    for row in table.itertuples():
        rows = [int(n) for n in row.rows_per_rank.split("/")]
        per_rank = [float(v) for v in row.per_rank_ms.split("/")]
        assert sum(rows) == 512 and len(per_rank) == 2 and min(per_rank) >= 0
        assert row.measured_max_over_mean >= 1 and row.model_bound_max_over_mean >= 1
    assert table.loc[0, "rows_per_rank"] == "256/256"
    # one causal document: the later rank attends to more keys, so the balanced split gives it fewer rows
    first, second = map(int, table.loc[1, "rows_per_rank"].split("/"))
    assert first > second
