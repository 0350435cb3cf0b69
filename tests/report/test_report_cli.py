"""``dsv4cp report``: summary.md, every table (CSV + markdown) and the plots, from run directories."""

from __future__ import annotations

import pandas as pd
from report_helpers import TIME_RATIO_TARGET, grid, write_run

from dsv4cp.cli.main import main
from dsv4cp.records import point_id


def test_report_of_one_run_writes_summary_tables_and_plots(scaling_run, capsys):
    assert main(["report", str(scaling_run)]) == 0
    out = scaling_run / "report"
    assert capsys.readouterr().out.strip() == str(out / "summary.md")
    names = ["headline", "targets", "diagnosis", "diagnosis_phases", "stragglers", "parity_failures", "phases",
             "strong_scaling", "weak_scaling", "overlap", "determinism_cost", "compile_cost", "memory",
             "memory_peaks", "imbalance", "model_imbalance", "measured_vs_bound", "cost_growth", "roofline",
             "failures"]
    for name in names:
        assert (out / "tables" / f"{name}.csv").is_file() and (out / "tables" / f"{name}.md").is_file(), name
    headline = pd.read_csv(out / "tables" / "headline.csv")
    assert {"time_ms_median", "time_ms_p20", "time_ms_p80", "tokens_per_s", "tflops_per_gpu", "mfu",
            "measured_over_bound", "peak_gib", "exposed_comm_pct", "parity"} <= set(headline.columns)
    pngs = sorted(p.stem for p in (out / "plots").glob("*.png"))
    assert pngs == sorted(["strong_scaling", "phase_times", "overlap_per_phase", "memory_vs_tokens",
                           "measured_vs_bound", "imbalance_per_packing", "cost_growth", "roofline"])
    summary = (out / "summary.md").read_text()
    assert "## Headline" in summary and "Hardware: 2xNVIDIA H200" in summary
    assert "weak_scaling: skipped" in summary and "## Points that did not measure" in summary
    assert "## Targets" in summary and "No target declared" in summary


def test_report_says_what_missed_its_target_and_by_how_much(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[65536], packing=["histogram"], overlap=["async"])
    run = write_run(tmp_path / "slow", points, seed=seed, slowdown={point_id(points[1]): 1.4},
                    targets=[TIME_RATIO_TARGET])
    assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    summary = (tmp_path / "r" / "summary.md").read_text()
    targets = pd.read_csv(tmp_path / "r" / "tables" / "targets.csv")
    time_row = targets[targets["target"] == TIME_RATIO_TARGET["name"]].iloc[0]
    assert time_row["verdict"] == "missed"
    assert f"MISSED by {time_row['miss_pct']:.1f}%" in summary


def test_report_compares_runs_side_by_side(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[1024])
    base = write_run(tmp_path / "base", points, seed=seed)
    new = write_run(tmp_path / "new", points, seed=seed + 1)
    assert main(["report", str(base), str(new), "--out", str(tmp_path / "cmp")]) == 0
    headline = pd.read_csv(tmp_path / "cmp" / "tables" / "headline.csv")
    assert headline["run"].tolist() == ["base", "base", "new", "new"]
    assert "# dsv4cp report: base, new" in (tmp_path / "cmp" / "summary.md").read_text()


def test_report_input_errors_exit_2_naming_the_problem(tmp_path, seed, capsys):
    points = grid(cp=[1], tokens=[1024])
    a, b = write_run(tmp_path / "a", points, seed=seed), write_run(tmp_path / "b", points, seed=seed + 1)
    assert main(["report", str(a), str(b)]) == 2
    assert "--out: required" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["report", str(a), "--out", str(tmp_path / "file")]) == 2
    assert "--out" in capsys.readouterr().err
