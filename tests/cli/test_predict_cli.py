"""``dsv4cp predict`` on the records this version writes and on another machine's committed run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dsv4cp import kernel_options
from dsv4cp.cli.main import main
from dsv4cp.records import point_id, read_records

H200_RUN = Path(__file__).parents[2] / "results" / "runs" / "h200x2-overlap"
"""Two NVLinked H200s, profiled CP = 2 steps (records without a bound's machine: named by their label)."""


def _predicted(capsys, argv: list[str], csv: Path) -> tuple[str, pd.DataFrame]:
    assert main(["predict", *argv, "--csv", str(csv)]) == 0
    return capsys.readouterr().out, pd.read_csv(csv)


def test_predict_reads_records_holding_every_kernel_option(tmp_path, capsys):
    """A record of this version holds a mapping of every kernel option's value: predict keys points by
    their id, so a CP = 1 record of the same point is found (a mapping in a key raised TypeError)."""
    records = read_records(H200_RUN)
    one = {**records[0], "cp": 1, "tokens_per_rank": records[0]["tokens"], "split": None, "phases": None,
           "rank_time_ms_median": [records[0]["time_ms_median"]]}
    one["point_id"] = point_id(one)
    lines = [{**r, "kernel_options": kernel_options.resolved()} for r in [*records, one]]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out, frame = _predicted(capsys, [str(tmp_path / "run")], tmp_path / "p.csv")
    assert len(frame) == sum(r["cp"] == 2 and bool(r["phases"]) for r in records)
    first = frame[frame["point_id"] == records[0]["point_id"]].iloc[0]
    assert first["cp1_ms"] == records[0]["time_ms_median"]


def test_predict_models_a_run_at_the_machine_it_was_measured_on(tmp_path, capsys):
    out, default = _predicted(capsys, [str(H200_RUN)], tmp_path / "default.csv")
    assert "machine h200x2, the machine the records were measured on (2xNVIDIA H200; --machine overrides)" in out
    _, explicit = _predicted(capsys, [str(H200_RUN), "--machine", "h200x2"], tmp_path / "h200.csv")
    pd.testing.assert_frame_equal(default, explicit)
    out, cpu = _predicted(capsys, [str(H200_RUN), "--machine", "cpu-estimate"], tmp_path / "cpu.csv")
    assert "machine cpu-estimate, as --machine says" in out
    assert (cpu["max_comm_ms"] > 10 * default["max_comm_ms"]).all()  # a CPU's loopback is far slower than NVLink
    assert set(default["machine"]) == {"h200x2"}


def test_predict_refuses_a_run_given_twice(tmp_path, capsys):
    assert main(["predict", str(H200_RUN), f"{H200_RUN}/"]) == 2
    assert "give each run once" in capsys.readouterr().err
