"""A run directory: one writer at a time (its lock), no rank outliving its sweep, ``meta.json`` as the
run's identity (``--resume`` with another spec is refused) and an unreadable ``meta.json`` named by
every reader (``sweep --resume``, ``report``, ``compare``)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dsv4cp.cli.main import main
from dsv4cp.records import META_FILE, RECORDS_FILE, append_record, make_record, read_meta, read_records
from dsv4cp.sweeps.identity import differences_between, spec_hash
from dsv4cp.sweeps.run_lock import LOCK_FILE, LockHolder, RunDirLock, RunDirLockedError
from dsv4cp.sweeps.spec import expand, load_spec

TINY_BASE = {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "overlap": "async", "ratio": 0,
             "pass": "fwd"}


def _write_spec(path: Path, axes: dict, reps: int = 2, **base) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "run": {"warmup": 0, "reps": reps},
                                    "base": {**TINY_BASE, **base}, "axes": axes}))
    return path


def _stderr_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------------------------------ the lock
def test_a_held_lock_refuses_a_second_writer_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path / "run") as held:
        assert held.taken_over is None
        with pytest.raises(RunDirLockedError) as refused:
            RunDirLock(tmp_path / "run").__enter__()  # another open file: flock excludes it, in this process too
        message = str(refused.value)
        assert message.startswith(f"--out: {tmp_path / 'run'} is being written by another sweep (pid {os.getpid()} "
                                  f"on {socket.gethostname()}, started 20")
    assert (tmp_path / "run" / LOCK_FILE).read_bytes() == b""  # a clean release names nobody
    with RunDirLock(tmp_path / "run") as again:
        assert again.taken_over is None


def _holder_of(process: subprocess.Popen) -> LockHolder:
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return LockHolder(host=socket.gethostname(), pid=process.pid, pid_start=int(stat.rpartition(")")[2].split()[19]),
                      start_utc="2026-01-01T00:00:00Z", command="dsv4cp sweep other.yaml")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process start times from /proc")
def test_a_lock_left_by_a_dead_run_is_taken_over_and_a_live_holder_is_not(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = _holder_of(sleeper)
        (run / LOCK_FILE).write_text(json.dumps(holder.__dict__))
        # its flock is free (it never took one: a filesystem where flock does not exclude), but it runs here
        with pytest.raises(RunDirLockedError, match=f"pid {sleeper.pid} on "):
            RunDirLock(run).__enter__()
        # the same pid started at another time is a reuse of the pid, not the holder
        (run / LOCK_FILE).write_text(json.dumps({**holder.__dict__, "pid_start": holder.pid_start + 1}))
        with RunDirLock(run) as lock:
            assert lock.taken_over.pid == sleeper.pid
    finally:
        os.kill(sleeper.pid, signal.SIGKILL)  # the one process this test started
        sleeper.wait()
    (run / LOCK_FILE).write_text(json.dumps(holder.__dict__))  # its holder is gone now
    with RunDirLock(run) as lock:
        assert lock.taken_over == holder
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


# ------------------------------------------------------------------------------------------ one writer, no orphans
def _children(pid: int) -> list[int]:
    """The spawned ranks of ``pid`` (not multiprocessing's resource tracker), from /proc."""
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == pid and b"spawn_main" in command:
            ranks.append(int(entry.name))
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_one_writer_at_a_time_and_no_rank_outlives_a_killed_sweep(tmp_path, capsys):
    spec = _write_spec(tmp_path / "long.yaml", {"cp": [1, 2], "seed": list(range(8))}, tokens=64)
    out = tmp_path / "run"
    records = out / RECORDS_FILE
    command = [sys.executable, "-m", "dsv4cp", "sweep", str(spec), "--out", str(out), "--progress", "off"]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and sweep.poll() is None and _lines(records) < 2:
            time.sleep(0.05)
        assert sweep.poll() is None and _lines(records) >= 2, "the sweep ended (or never started) before the checks"
        ranks = _children(sweep.pid)
        assert len(ranks) == 2

        # a second sweep into the same directory, while the first one runs: refused, naming it
        assert main(["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]) == 2
        assert f"is being written by another sweep (pid {sweep.pid} on {socket.gethostname()}, started " in (
            _stderr_line(capsys))

        os.kill(sweep.pid, signal.SIGKILL)  # the parent only: its ranks must go with it
        sweep.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its sweep"
        written = records.read_bytes()
        time.sleep(2.0)
        assert records.read_bytes() == written, "a line was appended after the sweep died"
    finally:
        for pid in [sweep.pid, *ranks]:  # only the processes this test started (and their ranks), by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        sweep.wait()

    before = read_records(out)
    assert main(["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]) == 0
    assert f"taking over the lock of a run that died (pid {sweep.pid} on " in capsys.readouterr().err
    after = read_records(out)
    assert after[: len(before)] == before
    assert sorted(r["point_id"] for r in after) == sorted(p.point_id for p in expand(load_spec(spec)))


def test_a_rank_whose_spawner_is_gone_writes_nothing(tmp_path, monkeypatch):
    import torch

    from dsv4cp.cp.launch import PARENT_PID_ENV, parent_alive
    from dsv4cp.sweeps.runner import SweepOptions, sweep_rank

    assert parent_alive()  # no spawner recorded: not a spawned rank
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid()))
    assert parent_alive()
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid() + 1))  # another parent than the one this process has
    assert not parent_alive()
    spec = load_spec(_write_spec(tmp_path / "s.yaml", {"seed": [0]}, tokens=32))
    options = SweepOptions(out=tmp_path / "run")
    with pytest.raises(RuntimeError, match="the process that spawned this rank is gone: stopping without writing"):
        sweep_rank(0, 1, torch.device("cpu"), spec, expand(spec), options)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ identity
def test_resume_with_another_spec_is_refused_naming_what_differs(tmp_path, capsys):
    first = _write_spec(tmp_path / "first.yaml", {"seed": [0, 1]}, tokens=32)
    out = tmp_path / "run"
    assert main(["sweep", str(first), "--out", str(out), "--progress", "off"]) == 0
    meta = read_meta(out)
    assert meta["spec_hash"] == spec_hash(yaml.safe_load(first.read_text()))
    assert meta["point_ids"] == [p.point_id for p in expand(load_spec(first))]
    records = read_records(out)
    capsys.readouterr()

    other = _write_spec(tmp_path / "first.yaml", {"seed": [0, 2]}, tokens=32)  # same file, other seeds
    assert main(["sweep", str(other), "--out", str(out), "--resume", "--progress", "off"]) == 2
    line = _stderr_line(capsys)
    assert line.startswith(f"dsv4cp sweep: error: --resume: {out} was run with another spec (axes.seed: [0, 1] in "
                           "the run, [0, 2] now)"), line
    slower = _write_spec(tmp_path / "first.yaml", {"seed": [0, 1]}, reps=3, tokens=32)
    assert main(["sweep", str(slower), "--out", str(out), "--resume", "--progress", "off"]) == 2
    assert "(run.reps: 2 in the run, 3 now)" in _stderr_line(capsys)
    assert read_records(out) == records and read_meta(out) == meta  # nothing appended, nothing rewritten


def test_resume_refuses_records_of_points_the_spec_lacks(tmp_path, capsys):
    spec = _write_spec(tmp_path / "s.yaml", {"seed": [0]}, tokens=32)
    out = tmp_path / "run"
    stranger = make_record({"preset": "tiny", "tokens": 32, "cp": 1, "seed": 7}, {}, sweep="other", status="ok",
                           machine="cpu-2core", git_sha=None)
    append_record(out / RECORDS_FILE, stranger)  # a run directory without meta.json
    assert main(["sweep", str(spec), "--out", str(out), "--resume", "--progress", "off"]) == 2
    assert f"holds 1 record(s) of points the spec does not have (e.g. {stranger['point_id']})" in _stderr_line(capsys)


def test_differences_name_each_path():
    old = {"name": "a", "axes": {"cp": [1, 2], "seed": [0]}, "run": {"reps": 2}}
    new = {"name": "a", "axes": {"cp": [1, 4], "ratio": [0]}, "exclude": []}
    assert differences_between(old, new) == [
        "axes.cp: [1, 2] in the run, [1, 4] now", "axes.seed: only in the run", "axes.ratio: only in the new spec",
        "run: only in the run", "exclude: only in the new spec"]
    assert differences_between(old, json.loads(json.dumps(old))) == []


BAD_META = [
    ("not-utf8", b"\xff\xfe{\"schema\": 1}", r"meta.json: not UTF-8 text \(invalid start byte at byte 0\)$"),
    ("truncated", b'{"schema": 1, "spec": {"name": "x"', r"meta.json: not valid JSON, truncated or corrupted "),
    ("a-list", b"[1, 2]\n", r"meta.json: must hold a JSON object, got list$"),
]


def _run_with_meta(tmp_path: Path, meta: bytes) -> Path:
    run = tmp_path / "run"
    record = make_record({"preset": "tiny", "tokens": 32, "cp": 1}, {"time_ms_median": 1.5, "time_ms_p20": 1.4,
                                                                      "time_ms_p80": 1.6},
                         sweep="s", status="ok", machine="cpu-2core", git_sha=None)
    append_record(run / RECORDS_FILE, record)
    (run / META_FILE).write_bytes(meta)
    return run


@pytest.mark.parametrize("meta,message", [c[1:] for c in BAD_META], ids=[c[0] for c in BAD_META])
def test_an_unreadable_meta_json_is_named_by_every_reader(tmp_path, capsys, meta, message):
    run = _run_with_meta(tmp_path, meta)
    spec = _write_spec(tmp_path / "s.yaml", {"seed": [0]}, tokens=32)
    path = re.escape(str(run / META_FILE)).replace(re.escape(META_FILE), "")
    for argv in (["sweep", str(spec), "--out", str(run), "--resume", "--progress", "off"], ["report", str(run)],
                 ["compare", str(run), str(run)]):
        assert main(argv) == 2, argv
        line = _stderr_line(capsys)
        assert re.match(rf"dsv4cp {argv[0]}: error: {path}{message}", line), line
    assert len(read_records(run)) == 1  # the refused resume appended nothing
