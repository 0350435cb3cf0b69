"""``dsv4cp sweep`` and ``dsv4cp profile --out`` end to end on CPU (gloo ranks, tiny shapes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import yaml

from dsv4cp.cli.main import main
from dsv4cp.cp.launch import spawn
from dsv4cp.profiling.overlap import KERNEL_COLUMNS
from dsv4cp.records import COLUMNS, read_meta, read_records
from dsv4cp.report.load import load_runs
from dsv4cp.sweeps import runner
from dsv4cp.sweeps.identity import spec_hash
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.runner import CRASHED_STATUS, INFLIGHT_FILE, MAX_ATTEMPTS, SweepOptions
from dsv4cp.sweeps.spec import expand, load_spec

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"
TINY_BASE = {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "overlap": "async"}


def _write_spec(path: Path, **parts) -> Path:
    spec = {"name": path.stem, "run": {"warmup": 0, "reps": 2}, "base": dict(TINY_BASE)}
    for key, value in parts.items():
        spec[key] = {**spec[key], **value} if key == "base" else value
    path.write_text(yaml.safe_dump(spec))
    return path


def _check_ok(record: dict) -> None:
    cp = record["cp"]
    assert record["status"] == "ok" and record["error"] is None
    assert record["time_ms_p20"] <= record["time_ms_median"] <= record["time_ms_p80"]
    assert len(record["rank_time_ms_median"]) == cp and all(t > 0 for t in record["rank_time_ms_median"])
    assert record["imbalance_max_over_mean"] >= 1.0
    assert len(record["peak_allocated_bytes"]) == cp and all(b > 0 for b in record["peak_allocated_bytes"])
    assert record["model_flops"] > 0 and record["bound_ms"] > 0 and record["tflops_per_gpu"] > 0
    assert record["tokens_per_s"] == pytest.approx(record["tokens"] / (record["time_ms_median"] / 1e3))
    assert record["resolved_backends"] == {"sparse_attention": "torch"}


def test_sweep_records_ok_error_and_skipped_points_then_resumes(tmp_path, capsys):
    # cp 1 ok; cp 2 as CUDA-graph replays: valid in the spec, but the gloo ranks run on CPU, so both
    # ranks fail when run; then a cp 2 point runs normally on fresh groups; cp 4 needs more ranks than
    # the 2 spawned.
    spec = _write_spec(tmp_path / "mixed.yaml", axes={
        "cp": [1, 2, 2, 4], "tokens": [64, 64, 64, 64], "ratio": [4, 4, 8, 4], "pass": ["fwd", "fwd", "fwd+bwd", "fwd"],
        "packing": ["histogram", "one", "adversarial", "one"], "cuda_graph": [False, True, False, False],
    }, zip=[["cp", "tokens", "ratio", "pass", "packing", "cuda_graph"]])
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "2", "--progress", "off"]) == 1  # a point failed
    records = read_records(out)
    assert [r["point_id"] for r in records] == [p.point_id for p in expand(load_spec(spec))]
    assert [tuple(r) for r in records] == [COLUMNS] * 4
    ok_1, bad, ok_2, skipped = records
    _check_ok(ok_1)
    _check_ok(ok_2)
    assert bad["status"].startswith("error: ValueError: cuda_graph: CUDA-graph replays need a CUDA device")
    assert bad["time_ms_median"] is None and "rank 0" in bad["error"] and "rank 1" in bad["error"]
    assert skipped["status"] == "skipped: needs cp=4"
    meta = read_meta(out)
    assert meta["machine"].startswith("cpu-") and meta["spec"]["name"] == "mixed" and meta["torch"]
    assert meta["point_ids"] == [r["point_id"] for r in records]
    assert meta["spec_hash"] == spec_hash(yaml.safe_load(spec.read_text()))
    assert "4 points recorded" in capsys.readouterr().out

    # the failed point is still in the run: a resume that measures nothing still exits 1
    assert main(["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]) == 1
    assert read_records(out) == records  # nothing run twice
    printed = capsys.readouterr().out
    assert "0 points recorded" in printed and "1 of the points already there had failed" in printed


def _measure_failing_on_rank_1(point, group, device, run, **kwargs):
    """measure_point, except that at seed 1 rank 1 fails while rank 0 waits in a collective for it."""
    if point.seed == 1:
        if dist.get_rank(group) == 1:
            raise RuntimeError("injected failure on rank 1")
        dist.all_reduce(torch.ones(1), group=group)  # its peer never comes: bounded by --point-timeout
    return measure_point(point, group, device, run, **kwargs)


def _sweep_rank_with_a_failing_rank(rank, world, device, spec, points, options):
    runner.measure_under_partition = _measure_failing_on_rank_1  # in this spawned process only
    return runner.sweep_rank(rank, world, device, spec, points, options)


def test_a_rank_failing_mid_point_neither_hangs_its_peer_nor_stops_the_sweep(tmp_path):
    spec = load_spec(_write_spec(tmp_path / "flaky.yaml", base={"tokens": 32, "ratio": 0, "pass": "fwd", "cp": 2},
                                 axes={"seed": [0, 1, 2]}))
    options = SweepOptions(out=tmp_path / "run", point_timeout_s=3.0)
    spawn(_sweep_rank_with_a_failing_rank, 2, spec, expand(spec), options)
    records = read_records(options.out)
    assert [r["seed"] for r in records] == [0, 1, 2]
    assert records[1]["status"] == "error: RuntimeError: injected failure on rank 1"
    assert "rank 0:" in records[1]["error"]  # rank 0's collective gave up instead of hanging
    _check_ok(records[0])
    _check_ok(records[2])  # the next point ran on fresh groups


def test_refuses_an_existing_run_without_resume_before_launching(tmp_path, capsys):
    spec = _write_spec(tmp_path / "one.yaml", base={"tokens": 32, "cp": 1, "ratio": 0, "pass": "fwd"})
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--progress", "off"]) == 0
    assert main(["sweep", str(spec), "--out", str(out), "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "already holds records.jsonl; pass --resume" in err
    assert len(read_records(out)) == 1


def test_dist_backend_on_a_one_rank_sweep_is_refused_before_launching(tmp_path, capsys):
    spec = _write_spec(tmp_path / "one.yaml", base={"tokens": 32, "cp": 1, "ratio": 0, "pass": "fwd"})
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--dist-backend", "gloo", "--progress", "off"]) == 2
    assert "--dist-backend: gloo has no effect on a single-process run" in capsys.readouterr().err
    assert not (out / "records.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a one-rank sweep measures on CUDA there: graphs would work")
def test_one_rank_skips_larger_cp_and_retries_errors_on_request(tmp_path, capsys):
    # the second point asks for CUDA-graph replays: valid in the spec, fails when run on CPU
    spec = _write_spec(tmp_path / "small.yaml", base={"ratio": 0, "pass": "fwd"},
                       axes={"cp": [1, 1, 2], "tokens": [32, 16, 32], "cuda_graph": [False, True, False]},
                       zip=[["cp", "tokens", "cuda_graph"]])
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert all(p.point_id in listed for p in expand(load_spec(spec))) and "3 points" in listed
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1", "--progress", "off"]) == 1
    records = read_records(out)
    assert [r["status"].split(":")[0] for r in records] == ["ok", "error", "skipped"]
    assert "CUDA-graph replays need a CUDA device" in records[1]["status"]
    assert records[2]["status"] == "skipped: needs cp=2"
    args = ["sweep", str(spec), "--out", str(out), "--nproc", "1", "--resume", "--progress", "off"]
    assert main(args) == 1
    assert read_records(out) == records
    assert main([*args, "--retry-errors"]) == 1  # measured again, failed again: its new record replaces the old
    again = read_records(out)
    assert [again[0], again[2]] == [records[0], records[2]] and again[1]["point_id"] == records[1]["point_id"]
    assert again[1]["status"] == records[1]["status"]


def test_a_retried_point_replaces_its_failed_record_keeping_every_other_line(tmp_path, monkeypatch, capsys):
    spec = _write_spec(tmp_path / "retry.yaml", base={"tokens": 32, "ratio": 0, "pass": "fwd", "cp": 1},
                       axes={"seed": [0, 1, 2]})
    out = tmp_path / "run"
    args = ["sweep", str(spec), "--out", str(out), "--nproc", "1", "--progress", "off"]
    measure = runner.measure_under_partition

    def failing_at_seed_1(point, *rest, **kwargs):
        if point.seed == 1:
            raise RuntimeError("injected failure")
        return measure(point, *rest, **kwargs)

    monkeypatch.setattr(runner, "measure_under_partition", failing_at_seed_1)
    assert main(args) == 1
    first = read_records(out)
    assert [r["status"] for r in first] == ["ok", "error: RuntimeError: injected failure", "ok"]
    with (out / "records.jsonl").open("a") as file:  # a line that is no record stays as it is
        file.write("not a record\n")
    monkeypatch.setattr(runner, "measure_under_partition", measure)
    assert main([*args, "--resume", "--retry-errors"]) == 0
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 4 and lines[3] == "not a record"
    after = read_records(out, [])
    assert [r["point_id"] for r in after] == [r["point_id"] for r in first]  # one record per point, in order
    assert [after[0], after[2]] == [first[0], first[2]] and after[1]["status"] == "ok"
    assert len(load_runs(out, [])) == 3  # the report's loader counts the spec's 3 points
    assert "0 failed" in capsys.readouterr().out


def test_a_point_the_run_died_in_is_retried_once_then_recorded_as_an_error(tmp_path):
    spec = _write_spec(tmp_path / "two.yaml", base={"tokens": 32, "ratio": 0, "pass": "fwd", "cp": 1},
                       axes={"seed": [0, 1]})
    first, second = (p.point_id for p in expand(load_spec(spec)))
    out = tmp_path / "run"
    args = ["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]
    out.mkdir()
    (out / INFLIGHT_FILE).write_text(json.dumps({"point_id": first, "attempts": 1}))  # died there once
    assert main(args) == 0
    assert [r["status"] for r in read_records(out)] == ["ok", "ok"] and not (out / INFLIGHT_FILE).exists()

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / INFLIGHT_FILE).write_text(json.dumps({"point_id": second, "attempts": MAX_ATTEMPTS}))
    assert main([*args[:3], str(crashed), *args[4:]]) == 1  # the point recorded as an error
    assert [r["status"] for r in read_records(crashed)] == ["ok", CRASHED_STATUS]


def test_bad_spec_is_a_clean_error(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nbase: {tokens: 64}\naxes: {overlap: [sometimes]}\n")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "run")]) == 2
    assert "axes.overlap[0]: unknown value 'sometimes'" in capsys.readouterr().err
    assert not (tmp_path / "run" / "records.jsonl").exists()


def test_points_that_cannot_run_are_marked_by_dry_run_and_refused_before_launching(tmp_path, capsys):
    spec = _write_spec(tmp_path / "odd.yaml", base={"ratio": 0, "pass": "fwd"}, axes={"cp": [1, 2], "tokens": [255]})
    odd = expand(load_spec(spec))[1]
    assert main(["sweep", str(spec), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert f"{odd.point_id}  {odd.label()}  CANNOT RUN: tokens: 255 rows are not divisible by cp=2\n" in out
    assert out.endswith("2 points (1 cannot run), spawning 2 ranks without torchrun\n")
    refusal = (f"dsv4cp sweep: error: point {odd.point_id} ({odd.label()}) cannot run: tokens: 255 rows are not "
               "divisible by cp=2; 1 of 2 points cannot (--dry-run marks them): exclude them or change the spec\n")
    assert err == refusal
    run = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(run), "--progress", "off"]) == 2
    assert capsys.readouterr() == ("", refusal)
    assert not run.exists()  # refused before the run directory was made, let alone a rank started


def test_killed_sweep_resumes_with_every_point_exactly_once(tmp_path):
    spec = _write_spec(tmp_path / "long.yaml", base={"tokens": 64, "pass": "fwd"},
                       axes={"cp": [1, 2], "ratio": [0, 4, 8], "seed": [0, 1]})
    expected = [p.point_id for p in expand(load_spec(spec))]
    out = tmp_path / "run"
    records_file = out / "records.jsonl"
    command = [sys.executable, "-m", "dsv4cp", "sweep", str(spec), "--out", str(out), "--progress", "off"]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if records_file.exists() and records_file.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the sweep ended before it could be killed"
        os.killpg(process.pid, signal.SIGKILL)  # the CLI and its spawned ranks: one process group
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    before = read_records(out)
    assert 3 <= len(before) < len(expected)

    assert main(["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]) == 0
    after = read_records(out)
    assert after[: len(before)] == before
    assert sorted(r["point_id"] for r in after) == sorted(expected)  # each point exactly once
    assert {r["status"] for r in after} == {"ok"}


def test_profile_out_writes_the_same_record_schema(tmp_path, capsys):
    out = tmp_path / "profile_run"
    args = ["profile", "--preset", "tiny", "--ratio", "4", "--tokens", "64", "--packing", "fixed",
            "--doc-len", "24", "--warmup", "0", "--reps", "2", "--kernel-backend", "torch", "--backward",
            "--trace-dir", str(tmp_path / "trace"), "--out", str(out)]
    assert main(args) == 0
    second = [a for a in args if a != "--trace-dir" and a != str(tmp_path / "trace")]
    assert main(second) == 0  # a second invocation appends to the same run directory
    records = read_records(out)
    assert len(records) == 2 and all(tuple(r) == COLUMNS for r in records)
    record = records[0]
    _check_ok(record)
    assert record["sweep"] == "profile" and record["packing"] == "fixed:24" and record["pass"] == "fwd+bwd"
    assert records[0]["point_id"] == records[1]["point_id"]
    assert record["phases"] and record["comm_ms"] is not None  # the trace's overlap table, CP = 1
    assert records[1]["phases"] is None
    meta = read_meta(out)
    assert meta["spec"]["command"] == "profile" and meta["spec"]["tokens"] == 64 and meta["spec"]["backward"] is True
    assert (tmp_path / "trace" / "overlap.csv").exists()
    assert json.loads((tmp_path / "trace" / "point.json").read_text())["tokens"] == 64  # what model --calibrate checks
    assert record["bound_machine"] == "cpu-estimate" and record["bound_ms"] > 0  # the bound of the machine that ran
    kernels = pd.read_csv(tmp_path / "trace" / "kernels.csv")  # which kernels (host ops on CPU) make each phase
    assert list(kernels.columns) == list(KERNEL_COLUMNS) and (kernels["time_ms"] > 0).all()
    assert {"dsv4cp.q_proj.fwd", "dsv4cp.sparse_attn.fwd"} <= set(kernels["phase"])
    out_text = capsys.readouterr().out
    assert "model (bound at the physical limits " in out_text and "at cpu-estimate's measured ceilings " in out_text
    assert record["bound_measured_ms"] == record["bound_ms"]  # a CPU has no spec sheet: its ceilings are its limits


@pytest.mark.slow
def test_shipped_smoke_sweep_runs_in_under_two_minutes(tmp_path):
    start = time.monotonic()
    out = tmp_path / "smoke"
    assert main(["sweep", str(SWEEPS / "smoke.yaml"), "--out", str(out), "--progress", "off"]) == 0
    elapsed = time.monotonic() - start
    records = read_records(out)
    assert len(records) == len(expand(load_spec(SWEEPS / "smoke.yaml")))
    for record in records:
        _check_ok(record)
    assert elapsed < 120, f"smoke sweep took {elapsed:.0f} s"
