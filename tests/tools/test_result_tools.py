"""The tools that read measured files (bench/calibration_check.py, partition_shares.py, phase_vs_bound.py,
emulated_summary.py): on copies of the inputs they read for results/, they print what was recorded there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench import calibration_check, emulated_summary, partition_shares, phase_vs_bound
from dsv4cp.records import append_record, make_record, point_id
from dsv4cp.report.load import load_runs
from dsv4cp.report.tables import point_estimate

DATA = Path(__file__).resolve().parents[1] / "data"


def test_phase_vs_bound_reproduces_its_recorded_table(capsys):
    """Inputs: the record of results/2026-12-01-h200-radix-topk-glue/profile-auto (and its trace's overlap.csv); output:
    that folder's phase_vs_bound.txt, under a title naming the point."""
    data = DATA / "phase-vs-bound"
    expected = (data / "phase_vs_bound.txt").read_text()
    for extra in ([], ["--phases", str(data / "overlap.csv")]):
        assert phase_vs_bound.main([str(data / "records.jsonl"), *extra]) == 0
        title, _, table = capsys.readouterr().out.partition("\n")
        assert "point 8dd88e6e6397" in title and "65536 tokens one" in title
        assert table == expected
    with pytest.raises(SystemExit):
        phase_vs_bound.main([])


def test_phase_vs_bound_prices_the_records_own_packing(tmp_path, capsys):
    """The bound follows the record's configuration: the same phases under histogram packing (shorter
    documents, fewer causal pairs) get a smaller sum of bounds than under one document."""
    record = json.loads((DATA / "phase-vs-bound" / "records.jsonl").read_text())
    sums = {}
    for packing in ("one", "histogram"):
        path = tmp_path / f"{packing}.jsonl"
        changed = {**record, "packing": packing}
        path.write_text(json.dumps({**changed, "point_id": point_id(changed)}) + "\n")
        assert phase_vs_bound.main([str(path)]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        sums[packing] = float(last.rsplit("sum of bounds ", 1)[1].split()[0])
    assert sums["histogram"] < 0.95 * sums["one"], sums


def test_phase_vs_bound_sets_the_indexer_ranges_against_the_work_they_time(seed):
    """Random times on the indexer's ranges: the top-k's faces the model's scoring + selection, the loss's
    scores' ranges are summed with the loss under its label."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    point = load_runs(DATA / "phase-vs-bound" / "records.jsonl").iloc[0]
    names = ["indexer.topk.fwd", "indexer.score.fwd", "indexer.loss.fwd", "indexer.score.bwd", "indexer.loss.bwd"]
    ms = dict(zip(names, rng.uniform(0.1, 20.0, size=len(names))))
    measured = pd.DataFrame({"rank": 0, "phase": [f"dsv4cp.{n}" for n in ms], "compute_ms": list(ms.values())})
    table = phase_vs_bound.phase_table(point, measured).set_index("phase")
    bounds = point_estimate(point, phase_vs_bound.H200).phase_table().set_index(["phase", "direction"])
    bound_ms = bounds["max_rank_bound_s"] * 1e3
    assert sorted(table.index) == ["indexer.loss.bwd (+ indexer.score.bwd)", "indexer.loss.fwd (+ indexer.score.fwd)",
                                   "indexer.topk.fwd"]
    topk = table.loc["indexer.topk.fwd"]
    assert topk["measured_ms"] == pytest.approx(ms["indexer.topk.fwd"])
    assert topk["bound_ms"] == pytest.approx(bound_ms[("indexer.score", "fwd")] + bound_ms[("indexer.topk", "fwd")])
    for direction in ("fwd", "bwd"):
        loss = table.loc[f"indexer.loss.{direction} (+ indexer.score.{direction})"]
        assert loss["measured_ms"] == pytest.approx(ms[f"indexer.loss.{direction}"] + ms[f"indexer.score.{direction}"])
        assert loss["bound_ms"] == pytest.approx(bound_ms[("indexer.loss", direction)])


def test_partition_shares_reproduce_the_recorded_shares(capsys):
    """Inputs and output: results/2026-12-01-cpu-partition-prefix-topk/ (partition-cpu.csv, machine-cpu.json,
    calibration-cpu-prefix.json; per_rank.txt)."""
    data = DATA / "cpu-partition"
    assert partition_shares.main(["--table", str(data / "partition-cpu.csv"), "--machine-file",
                                  str(data / "machine-cpu.json"), "--calibration",
                                  str(data / "calibration-cpu-prefix.json"),
                                  "--indexer-loss-scores", "recompute"]) == 0  # measured before the option
    assert capsys.readouterr().out == (data / "per_rank.txt").read_text()


def test_calibration_check_compares_both_packings_and_lists_the_splits(capsys):
    data = DATA / "calibration-check"
    argv = ["--calibration", str(data / "calibration-h200.json"),
            "--one-document-phases", str(data / "one-document-overlap.csv"),
            "--histogram-records", str(data / "histogram-records.jsonl")]
    assert calibration_check.main(argv) == 0
    out = capsys.readouterr().out
    assert "== one 64K document, cp 2, equal split" in out and "== histogram packing, cp 2, equal split" in out
    assert out.count("rank 1 - rank 0: measured") == 2
    split_rows = [line.split() for line in out.split("== splits")[1].splitlines()[2:] if line.strip()]
    assert {(row[0], row[1], row[2]) for row in split_rows} == {
        (packing, cp, model) for packing in ("one", "histogram") for cp in ("2", "4", "8")
        for model in ("bound", "calibrated")}


def test_calibration_check_names_a_records_file_without_a_profiled_point(tmp_path):
    empty = tmp_path / "records.jsonl"
    empty.write_text(json.dumps({"ratio": 4, "overlap": "none", "phases": None}) + "\n")
    with pytest.raises(ValueError, match="--histogram-records"):
        calibration_check.histogram_phases(empty)


def _record(run: Path, cp: int, rank: int | None, ms: float, peak_gib: float) -> None:
    peaks = [int(peak_gib * 2**30) if r == (rank or 0) else None for r in range(cp)]
    axes = {"preset": "flash", "ratio": 4, "pass": "fwd+bwd", "cp": cp, "tokens": 65536, "emulated_rank": rank,
            "partition": "equal"}
    append_record(run / "records.jsonl", make_record(axes, {"time_ms_median": ms, "peak_allocated_bytes": peaks},
                                                     sweep="profile", status="ok", machine="1xNVIDIA H200",
                                                     git_sha="0" * 40))


def test_emulated_summary_relates_every_rank_to_cp1(tmp_path, capsys):
    cp1, equal = tmp_path / "cp1", tmp_path / "equal"
    _record(cp1, 1, None, 100.0, 10.0)
    _record(equal, 2, 0, 70.0, 8.0)  # superseded by the rank's later record
    _record(equal, 2, 0, 60.0, 6.0)
    _record(equal, 2, 1, 40.0, 5.0)
    assert emulated_summary.main([str(cp1), f"equal={equal}"]) == 0
    out = capsys.readouterr().out
    assert "CP = 1 (real): 100.0 ms, peak 10.00 GiB" in out
    assert "equal (cp 2, partition equal): rank 0 60.0 ms / 6.00 GiB, rank 1 40.0 ms / 5.00 GiB" in out
    assert "max/mean 1.200; max-rank time / CP = 1 0.600" in out and "max peak / CP = 1 peak 0.600" in out
    with pytest.raises(SystemExit):
        emulated_summary.main([str(cp1), "no-label"])
