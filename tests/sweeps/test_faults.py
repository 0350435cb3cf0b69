"""Signals and disk faults during a sweep (CPU, tiny shapes): a full disk leaves every record whole and
ends in one line; a killed rank is named in one line; an interrupt stops the run promptly, keeping
every recorded point and not counting the point in flight as a death."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dsv4cp.cli.main import main
from dsv4cp.cp.launch import RankExited, spawn
from dsv4cp.records import RECORDS_FILE, append_record, make_record, read_records, writing
from dsv4cp.stopping import Stopped
from dsv4cp.sweeps import runner
from dsv4cp.sweeps.runner import INFLIGHT_FILE, SweepOptions
from dsv4cp.sweeps.spec import expand, load_spec

BASE = {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "tokens": 32, "ratio": 0, "pass": "fwd"}


def _spec(path: Path, cp: int, seeds: int) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "run": {"warmup": 0, "reps": 2},
                                    "base": {**BASE, "cp": cp}, "axes": {"seed": list(range(seeds))}}))
    return path


def _record(seed: int) -> dict:
    axes = {**BASE, "cp": 1, "seed": seed}
    return make_record(axes, {"time_ms_median": 1.0}, sweep="t", status="ok", machine="m", git_sha=None)


def _disk_filling_after(monkeypatch, allowed: int) -> None:
    """``os.write`` of the records writer (:mod:`dsv4cp.records.writing`) takes ``allowed`` more bytes, then
    half of a buffer once, then fails with ENOSPC (what a filling disk does)."""
    real = os.write
    left = {"bytes": allowed}

    def write(fd: int, data) -> int:
        if left["bytes"] >= len(data):
            left["bytes"] -= len(data)
            return real(fd, data)
        if left["bytes"] > 0 or len(data) > 1:
            taken, left["bytes"] = max(left["bytes"], len(data) // 2), -1
            if taken and left["bytes"] != -2:
                left["bytes"] = -2
                return real(fd, bytes(data[:taken]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writing.os, "write", write)


def test_an_append_a_full_disk_stops_part_way_is_cut_off_again_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / RECORDS_FILE
    append_record(path, _record(0))
    before = path.read_bytes()
    _disk_filling_after(monkeypatch, 0)
    with pytest.raises(OSError) as raised:
        append_record(path, _record(1))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert path.read_bytes() == before  # not half a line for the next append to join
    monkeypatch.undo()
    append_record(path, _record(2))
    assert [r["seed"] for r in read_records(path)] == [0, 2]


def test_a_sweep_on_a_full_disk_ends_in_one_line_keeping_every_record_whole(tmp_path, monkeypatch, capsys):
    spec = _spec(tmp_path / "full.yaml", cp=1, seeds=3)
    out = tmp_path / "run"
    real = writing.append_bytes
    calls = {"n": 0}

    def filling(path, data):  # the second record meets a full disk
        calls["n"] += 1
        if calls["n"] == 2:
            _disk_filling_after(monkeypatch, 0)
        return real(path, data)

    monkeypatch.setattr(writing, "append_bytes", filling)
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1", "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert err == f"dsv4cp sweep: error: {out / RECORDS_FILE}: No space left on device\n", err
    assert (out / RECORDS_FILE).read_bytes().count(b"\n") == 1
    assert [r["seed"] for r in read_records(out)] == [0]  # whole: a resume continues from it


def _raise_disk_full_on_rank_0(rank, world, device):
    if rank == 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/records.jsonl")
    time.sleep(300)  # stopped by the spawner, not waited for


def _kill_rank_1(rank, world, device):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def test_spawn_raises_a_ranks_disk_error_as_itself_and_names_a_killed_rank():
    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        spawn(_raise_disk_full_on_rank_0, 2)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == "/runs/x/records.jsonl"
    with pytest.raises(RankExited) as died:
        spawn(_kill_rank_1, 2)
    assert str(died.value).startswith("rank 1 (pid ") and "was killed by SIGKILL" in str(died.value)
    assert time.monotonic() - started < 250  # the other rank was stopped, not waited for (300 s)


@pytest.mark.parametrize(("target", "signum", "last_line"), [
    ("process", signal.SIGINT, "dsv4cp sweep: interrupted"),
    ("group", signal.SIGINT, "dsv4cp sweep: interrupted"),
    ("process", signal.SIGTERM, "dsv4cp sweep: stopped by SIGTERM"),
    ("group", signal.SIGTERM, "dsv4cp sweep: stopped by SIGTERM"),
    ("process", signal.SIGHUP, "dsv4cp sweep: stopped by SIGHUP"),
])
def test_a_stop_signal_ends_the_sweep_promptly_keeping_its_records(tmp_path, target, signum, last_line):
    spec = _spec(tmp_path / "long.yaml", cp=2, seeds=30)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dsv4cp", "sweep", str(spec), "--out", str(out), "--progress", "off"]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            if (out / RECORDS_FILE).exists() and (out / RECORDS_FILE).read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the sweep ended before it could be interrupted"
        (os.kill if target == "process" else os.killpg)(process.pid, signum)
        stdout, stderr = process.communicate(timeout=60)  # every remaining point would take minutes
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == last_line, stderr
    problems = []
    kept = read_records(out, problems)
    assert 2 <= len(kept) < 30 and not problems
    assert not (out / INFLIGHT_FILE).exists() or json.loads((out / INFLIGHT_FILE).read_text())["attempts"] == 0


def test_a_trace_the_profiler_could_not_write_is_an_error_naming_it(tmp_path, monkeypatch):
    import torch

    from dsv4cp.profiling import trace

    def failing_export(prof, path: str) -> None:  # what Kineto does on a full disk: a partial file, no error
        Path(f"{path}.tmp").write_text('{"traceEvents": [')

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", failing_export)
    with pytest.raises(OSError) as raised:
        trace.capture_trace(lambda: torch.ones(4).sum(), tmp_path, steps=1, rank=0)
    assert raised.value.filename == str(tmp_path / "rank0.json") and "could not write its trace" in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # the partial file removed


def test_the_profilers_usdt_lines_are_dropped_and_its_other_output_kept(tmp_path, monkeypatch, capfd):
    import torch

    from dsv4cp.profiling import trace

    export = torch.profiler.profile.export_chrome_trace

    def noisy_export(prof, path: str) -> None:  # a line of the profiler's that is no USDT noise stays
        os.write(2, b"ERROR: a profiler error to keep\n")
        export(prof, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", noisy_export)
    trace.capture_trace(lambda: torch.ones(4).sum(), tmp_path, steps=1, rank=0)
    err = capfd.readouterr().err
    assert "USDT" not in err and "ERROR: a profiler error to keep\n" in err, err


def test_a_lock_a_full_disk_cannot_take_is_an_error_naming_it(tmp_path, monkeypatch):
    from dsv4cp.sweeps import run_lock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_lock.os, "pwrite", full)
    with pytest.raises(OSError) as raised:
        with run_lock.RunDirLock(tmp_path / "run"):
            pass
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "run" / run_lock.LOCK_FILE)


@pytest.mark.parametrize("attempts_before", [0, 1])
@pytest.mark.parametrize("stop_at", ["marked", "before-marking"])
def test_a_stop_takes_back_only_the_attempt_this_run_added(tmp_path, monkeypatch, attempts_before, stop_at):
    """The run directory's lock holder takes back the attempt of the point it was measuring when a stop
    reached it, whichever exception its rank ended with (here a stop raised while a peer's closed
    connection unwinds), and leaves an earlier run's death counted when the stop comes before this run
    marked anything (during start-up, a resume's checks, the ranks' spawning)."""
    spec = load_spec(_spec(tmp_path / "one.yaml", cp=1, seeds=1))
    points = list(expand(spec))
    out = tmp_path / "run"
    out.mkdir()
    if attempts_before:  # an earlier run died in this point
        (out / INFLIGHT_FILE).write_text(json.dumps({"point_id": points[0].point_id, "attempts": attempts_before}))

    def stopped(rank, world, device, spec, points, options, run_id):
        if stop_at == "before-marking":
            raise Stopped(signal.SIGINT)
        runner._mark_inflight(options.out, points[0].point_id, run_id)
        try:
            raise RuntimeError("Connection closed by peer")
        finally:
            raise Stopped(signal.SIGTERM)  # the handler fires during the unwinding

    monkeypatch.setattr(runner, "sweep_rank", stopped)
    with pytest.raises(Stopped):
        runner.run_sweep(spec, points, SweepOptions(out=out, resume=bool(attempts_before), progress=False))
    left = json.loads((out / INFLIGHT_FILE).read_text())["attempts"] if (out / INFLIGHT_FILE).exists() else 0
    assert left == attempts_before, f"stop {stop_at}: {left} attempts left, {attempts_before} before the run"
