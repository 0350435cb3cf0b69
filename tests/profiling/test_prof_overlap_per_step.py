"""``dsv4cp overlap`` reports per-step values: on a 2-step trace it prints the table ``profile`` printed."""

from __future__ import annotations

import pandas as pd
import pytest
from prof_helpers import K, R, write_kineto

from dsv4cp.cli.main import main
from dsv4cp.harness.trace import per_step as _per_step
from dsv4cp.profiling.overlap import TOTAL, overlap_table
from dsv4cp.profiling.trace import load_kineto_dir


def _approx(ms: float):
    return pytest.approx(ms, abs=1e-6)


def _two_steps() -> tuple[list[K], list[R]]:
    """Two steps per rank, 300 us apart; per step a compute kernel of 60 (rank 0) or 40 us (rank 1) in
    sparse_attn.fwd and a 40 us all-gather half hidden behind it."""
    kernels, ranges = [], []
    for rank, compute in ((0, 60), (1, 40)):
        for offset in (0, 300):
            ranges += [R(rank, "step", offset, offset + 150), R(rank, "sparse_attn.fwd", offset + 1, offset + 10),
                       R(rank, "allgather.kv.launch", offset + 10, offset + 12)]
            kernels += [K(rank, 7, offset + 20, offset + 20 + compute, "gemm", launch=offset + 2),
                        K(rank, 20, offset + compute, offset + compute + 40, "ncclDevKernel_AllGather",
                          launch=offset + 11)]
    return kernels, ranges


def test_overlap_prints_profiles_per_step_table(tmp_path, capsys):
    traces = write_kineto(tmp_path / "traces", *_two_steps())
    out = tmp_path / "overlap.csv"
    assert main(["overlap", str(traces), "--csv", str(out)]) == 0
    printed = capsys.readouterr().out

    kernels, ranges = load_kineto_dir(traces)
    profile_table = _per_step(overlap_table(kernels, ranges), 2)  # what profile prints for a 2-step trace
    pd.testing.assert_frame_equal(pd.read_csv(out), profile_table, check_dtype=False)
    assert profile_table.to_string(index=False, float_format=lambda v: f"{v:.3f}") in printed

    totals = pd.read_csv(out).set_index(["rank", "phase"])
    # per step, not summed over both: rank 0 computes 60 us, rank 1 40 us; each sends 40 us, half hidden on rank 0
    assert totals.loc[(0, TOTAL), "compute_ms"] == _approx(0.060)
    assert totals.loc[(1, TOTAL), "compute_ms"] == _approx(0.040)
    assert totals.loc[(0, TOTAL), "comm_ms"] == _approx(0.040)
    assert totals.loc[(0, TOTAL), "exposed_comm_ms"] == _approx(0.020)
    assert totals.loc[(0, TOTAL), "overlap_ratio"] == _approx(0.5)
