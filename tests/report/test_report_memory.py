"""The memory tables: peak labelled by device (allocator on GPU, RSS on CPU) and, per rank, the phase
at the peak with the closed phases that left the most memory allocated before it."""

from __future__ import annotations

import numpy as np
import pytest
from report_helpers import grid, write_run

from dsv4cp.records import read_records
from dsv4cp.report import sections, tables
from dsv4cp.report.load import load_runs

GIB = 2**30
BEFORE_PEAK = ("q_proj.fwd", "kv_proj.fwd", "compress.fwd", "indexer.score.fwd", "sparse_attn.fwd")


def _memory_phases(rng: np.random.Generator) -> tuple[dict, dict[str, float]]:
    """One rank's recorded phases: a step holding forward phases that each leave a random amount
    allocated (one frees some), then the backward phase where the peak sits; and what each left."""
    level = int(rng.integers(1, 4) * GIB)
    rows = [{"phase": "step", "calls": 1, "entry_bytes": level, "peak_bytes": 0, "exit_bytes": level}]
    left = {}
    for name in BEFORE_PEAK:
        change = int(rng.uniform(-0.5, 3.0) * GIB)
        rows.append({"phase": name, "calls": 1, "entry_bytes": level, "peak_bytes": level + max(change, 0) + 1,
                     "exit_bytes": level + change})
        left[name] = change / GIB
        level += change
    peak = level + int(rng.uniform(1, 5) * GIB)
    rows.append({"phase": "sparse_attn.bwd", "calls": 1, "entry_bytes": level, "peak_bytes": peak,
                 "exit_bytes": level - GIB})
    rows.append({"phase": "out_proj.bwd", "calls": 1, "entry_bytes": level - GIB, "peak_bytes": level,
                 "exit_bytes": 0})  # after the peak: never a holder
    rows[0]["peak_bytes"] = peak
    return {"rows": rows, "peak_bytes": peak, "peak_stack": ["step", "sparse_attn.bwd"]}, left


def _with_memory_phases(tmp_path, seed, machine):
    run = write_run(tmp_path / machine.replace(" ", "_"), grid(cp=[2], tokens=[4096], packing=["one"]), seed=seed,
                    machine=machine)
    df = load_runs(run)
    rng = np.random.default_rng(seed)
    ranks = [_memory_phases(rng) for _ in range(2)]
    df.at[0, "memory_phases"] = [mine for mine, _ in ranks]
    return df, [left for _, left in ranks], run


@pytest.mark.parametrize("machine", ["2xNVIDIA H200", "cpu-2core"])
def test_peak_memory_is_labelled_by_device(tmp_path, seed, machine):
    df, _, run = _with_memory_phases(tmp_path, seed, machine)
    memory = tables.memory(df)
    expected = max(read_records(run)[0]["peak_allocated_bytes"]) / GIB
    cpu = machine.startswith("cpu")
    measured, blank = ("peak_rss_gib", "peak_allocated_gib") if cpu else ("peak_allocated_gib", "peak_rss_gib")
    assert memory[measured].iloc[0] == pytest.approx(expected) and memory[blank].isna().all()
    assert memory["peak_phase"].iloc[0] == "sparse_attn.bwd"
    peaks = tables.memory_peaks(df)
    assert set(peaks["memory_kind"]) == {"host RSS (CPU)" if cpu else "CUDA allocator"}


def test_each_rank_names_its_peak_phase_and_the_largest_allocations_live_there(tmp_path, seed):
    df, lefts, _ = _with_memory_phases(tmp_path, seed, "2xNVIDIA H200")
    peaks = tables.memory_peaks(df)
    assert peaks["rank"].tolist() == [0, 1]
    for row, mine, left in zip(peaks.itertuples(index=False), df.at[0, "memory_phases"], lefts):
        assert row.peak_gib == pytest.approx(mine["peak_bytes"] / GIB)
        assert row.peak_phase == "sparse_attn.bwd" and row.open_phases == "step > sparse_attn.bwd"
        holders = sorted(((gib, name) for name, gib in left.items() if gib > 0), reverse=True)[:3]
        assert row.held_by == ", ".join(f"{name} +{gib:.3g} GiB" for gib, name in holders)
    lines = sections.memory_lines(peaks)
    assert lines[0] == "## Where the memory peak sits" and sum("rank" in line for line in lines[4:]) == 2


def test_no_memory_phases_no_peak_rows(tmp_path, seed):
    df = load_runs(write_run(tmp_path / "run", grid(cp=[1], tokens=[4096]), seed=seed))
    assert tables.memory_peaks(df).empty and tables.memory(df)["peak_phase"].isna().all()
    assert sections.memory_lines(tables.memory_peaks(df)) == []
