"""The report on inputs a user really hands it: runs where no point measured, the same run given twice,
duplicated record lines and values no measurement can hold."""

from __future__ import annotations

import pandas as pd
from report_helpers import SCALING_POINTS, grid, write_run

from dsv4cp.cli.main import main


def test_a_run_where_no_point_measured_still_gets_a_report_that_says_what_failed(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[1024, 4096])
    statuses = {0: "oom", 1: "error: RuntimeError: the kernel failed", 2: "oom", 3: "skipped: needs a GPU"}
    run = write_run(tmp_path / "failed", points, seed=seed, statuses=statuses)
    assert main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert "**No point measured**: all 4 points did not measure (2 oom, 1 error, 1 skipped)" in summary
    failures = pd.read_csv(run / "report" / "tables" / "failures.csv")
    assert sorted(failures["status"]) == sorted(statuses.values())
    for name in ("strong_scaling", "memory_vs_tokens", "imbalance_per_packing", "roofline"):
        assert f"- {name}: skipped" in summary, name


def test_a_partly_failed_run_counts_its_failed_points_in_the_headline(tmp_path, seed):
    run = write_run(tmp_path / "scaling", SCALING_POINTS, seed=seed, statuses={0: "oom"})
    assert main(["report", str(run)]) == 0
    summary = (run / "report" / "summary.md").read_text()
    assert f"1 of {len(SCALING_POINTS)} points did not measure (1 oom)" in summary
