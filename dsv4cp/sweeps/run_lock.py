"""One writer per run directory: ``RUN_DIR/sweep.lock``, held for a sweep's whole life.

Two sweeps writing one run directory would each measure while the other competes for the machine
and interleave their records. The lock is an ``fcntl.flock`` on ``RUN_DIR/sweep.lock``: the kernel
drops it when the holding process ends, however it ends (SIGKILL included), so a dead run never
blocks the next one. The file's content names the holder (host, pid, the pid's start time, when and
what it started) for the error a second sweep gets; a clean release empties it, so a file that still
names a holder whose lock is free was left by a killed run. Such a lock is taken over
(:attr:`RunDirLock.taken_over` names the dead run), after checking that its holder is really gone when
it ran on this host (its pid no longer runs the same process): on a filesystem where ``flock`` does
not exclude, a live holder is still refused. The file is never deleted (deleting a locked file would
let two writers lock two different files of one name).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv4cp.records import utc_now

LOCK_FILE = "sweep.lock"


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    pid_start: int | None
    """The pid's start time (clock ticks after boot, /proc/PID/stat): tells a reused pid apart; None off Linux."""
    start_utc: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.start_utc}: {self.command}"

    @classmethod
    def of_this_process(cls) -> LockHolder:
        return cls(host=socket.gethostname(), pid=os.getpid(), pid_start=_process_start(os.getpid()),
                   start_utc=utc_now(), command=" ".join(sys.argv) or sys.executable)

    def is_running_here(self) -> bool:
        """Whether the holder is a live process of this host: its pid runs, and started when the holder
        did (not a reuse of its pid). Without /proc (off Linux) this cannot be told and is False: the
        flock alone decides there."""
        if self.host != socket.gethostname() or self.pid == os.getpid():
            return False
        start = _process_start(self.pid)
        return start is not None and (self.pid_start is None or start == self.pid_start)


class RunDirLockedError(ValueError):
    """Another sweep holds the run directory's lock (a bad-input error: choose another ``--out``)."""


class RunDirLock:
    """``with RunDirLock(run_dir):`` this process is the run directory's only writer, or
    :class:`RunDirLockedError` names the one that is. Creates ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.taken_over: LockHolder | None = None
        """The holder of a lock left by a killed run, which this one took over (None: the lock was free)."""
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._held_by(_read_holder(fd)) from None
            previous = _read_holder(fd)
            if previous is not None and previous.is_running_here():  # a filesystem whose flock does not exclude
                raise self._held_by(previous)
            holder = json.dumps(asdict(LockHolder.of_this_process())).encode()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder, 0)
                os.fsync(fd)
            except OSError as err:  # a full disk: named, so the one-line error says which file
                raise OSError(err.errno, err.strerror or str(err), str(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.taken_over = fd, previous
        return self

    def __exit__(self, *exc_info) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty lock file: released cleanly, nobody to take over from
        finally:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def _held_by(self, holder: LockHolder | None) -> RunDirLockedError:
        who = holder.describe() if holder is not None else "its holder has not written its name yet"
        return RunDirLockedError(f"--out: {self.run_dir} is being written by another sweep ({who}); wait for it "
                                 "to end or choose another directory")


def _read_holder(fd: int) -> LockHolder | None:
    """The holder named in the lock file; None when it is empty (released cleanly) or unreadable."""
    data = os.pread(fd, 1 << 16, 0)
    if not data.strip():
        return None
    try:
        return LockHolder(**json.loads(data.decode("utf-8")))
    except (ValueError, TypeError):  # written by something else: nobody it could name
        return None


def _process_start(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (the start time in clock ticks after boot); None without one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # the fields after the command name, which may hold spaces
