"""``dsv4cp overlap PATH [--csv OUT]`` on synthetic Kineto and nsys traces."""

from __future__ import annotations

import pandas as pd
from prof_helpers import K, R, write_kineto, write_nsys

from dsv4cp.cli.main import main
from dsv4cp.profiling.overlap import COLUMNS, TOTAL

KERNELS = [
    K(0, 7, 20, 120, "gemm", launch=1), K(0, 20, 40, 80, "ncclDevKernel_AllGather", launch=11),
    K(1, 7, 20, 60, "gemm", launch=1), K(1, 20, 60, 100, "ncclDevKernel_AllGather", launch=11),
]
RANGES = [
    R(0, "sparse_attn.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12),
    R(1, "sparse_attn.fwd", 0, 10), R(1, "allgather.kv.launch", 10, 12),
]


def _check_csv(path) -> pd.DataFrame:
    table = pd.read_csv(path)
    assert list(table.columns) == list(COLUMNS)
    totals = table[table["phase"] == TOTAL]
    assert sorted(totals["rank"]) == [0, 1]
    return table


def test_kineto_directory_to_csv(tmp_path, capsys):
    traces = write_kineto(tmp_path / "traces", KERNELS, RANGES)
    out = tmp_path / "overlap.csv"
    assert main(["overlap", str(traces), "--csv", str(out)]) == 0
    table = _check_csv(out)
    assert len(table) == 6
    printed = capsys.readouterr().out
    assert "dsv4cp.allgather.kv.launch" in printed
    # no step range: the step is first kernel start to last kernel end, [20, 120) us on rank 0
    assert "rank 0: step 0.100 ms, unattributed 0.000 ms (0.0% of the step; target <= 5%: met)" in printed


def test_nsys_sqlite_to_csv(tmp_path):
    db = write_nsys(tmp_path / "run.sqlite", KERNELS, RANGES)
    out = tmp_path / "overlap.csv"
    assert main(["overlap", str(db), "--csv", str(out)]) == 0
    table = _check_csv(out).set_index(["rank", "phase"])
    assert table.loc[(1, "dsv4cp.allgather.kv.launch"), "exposed_comm_ms"] == 0.04


def test_bad_path_is_a_clean_error(tmp_path, capsys):
    assert main(["overlap", str(tmp_path / "missing")]) == 2
    assert "path" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["overlap", str(tmp_path)]) == 2
    assert main(["overlap", str(tmp_path / "notes.txt")]) == 2
