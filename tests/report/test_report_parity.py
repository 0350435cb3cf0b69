"""Parity with CP = 1 (``sweep --check``) in the report: the headline's column and the failures section."""

from __future__ import annotations

import numpy as np
import pandas as pd
from report_helpers import grid, point_metrics

from dsv4cp.records import append_record, make_record
from dsv4cp.report import load_runs, tables, write_report
from dsv4cp.report.parity import NOT_CHECKED, parity_failures

QUANTITIES = ("out", "x_grad", "indexer_loss", "param_grads")


def _comparisons(rng: np.random.Generator, failed: set[str]) -> list[dict]:
    """One check's comparisons: random errors, above the fp32 tolerance for the ``failed`` quantities."""
    return [{"quantity": q, "max_rel_error": float(rng.uniform(1e-3, 1e-1) if q in failed else rng.uniform(1e-8, 1e-6)),
             "cosine": float(1 - rng.uniform(1e-9, 1e-7)), "passed": q not in failed,
             "worst": "wq_a.weight" if q == "param_grads" else ""} for q in QUANTITIES]


def _run(tmp_path, seed: int):
    """CP = 1 (never checked), a CP = 2 point that passed and one whose input gradient and parameter
    gradients failed."""
    rng = np.random.default_rng(seed)
    points = grid(cp=[1, 2, 2], tokens=[4096])
    points[2]["packing"] = "adversarial"
    parities = [None, _comparisons(rng, set()), _comparisons(rng, {"x_grad", "param_grads"})]
    for axes, parity in zip(points, parities):
        metrics = {**point_metrics(rng, axes), "parity": parity}
        append_record(tmp_path / "run" / "records.jsonl",
                      make_record(axes, metrics, sweep="s", status="ok", machine="cpu-2core", git_sha="0" * 40))
    return tmp_path / "run", parities


def test_headline_has_a_parity_column(tmp_path, seed):
    run, _ = _run(tmp_path, seed)
    headline = tables.headline(load_runs(run))
    assert headline["parity"].tolist() == [NOT_CHECKED, "passed (4)", "FAILED 2/4: x_grad, param_grads"]


def test_failures_section_lists_every_failed_quantity(tmp_path, seed):
    run, parities = _run(tmp_path, seed)
    df = load_runs(run)
    failed = parity_failures(df, ["cp", "packing"])
    want = [c for c in parities[2] if not c["passed"]]
    assert failed["quantity"].tolist() == [c["quantity"] for c in want]
    assert failed["max_rel_error"].tolist() == [c["max_rel_error"] for c in want]
    assert failed["worst"].tolist() == ["", "wq_a.weight"]
    assert (failed["point_id"] == df["point_id"].iloc[2]).all()
    summary = write_report(df, tmp_path / "r").read_text()
    section = summary.split("## Parity with CP = 1", 1)[1].split("\n## ", 1)[0]
    assert "1 of 2 checked points differ from CP = 1" in section
    assert f"{want[0]['max_rel_error']:.4g}" in section and "wq_a.weight" in section
    assert pd.read_csv(tmp_path / "r" / "tables" / "parity_failures.csv")["quantity"].tolist() == ["x_grad",
                                                                                                   "param_grads"]


def test_no_parity_section_claims_a_check_that_did_not_run(tmp_path, seed):
    rng = np.random.default_rng(seed)
    for axes in grid(cp=[1, 2], tokens=[4096]):
        append_record(tmp_path / "run" / "records.jsonl", make_record(
            axes, point_metrics(rng, axes), sweep="s", status="ok", machine="cpu-2core", git_sha="0" * 40))
    summary = write_report(load_runs(tmp_path / "run"), tmp_path / "r").read_text()
    assert "No point was checked (`sweep --check`" in summary
    assert (tables.headline(load_runs(tmp_path / "run"))["parity"] == NOT_CHECKED).all()
