"""Helpers for the profiling tests: synthetic traces in both formats, and multi-process workers.

A scenario is a list of ``K`` (kernels) and ``R`` (ranges) in MICROseconds. ``write_kineto`` turns it
into one Kineto Chrome-trace file per rank, ``write_nsys`` into one nsys-schema SQLite file, so the
same known answers check both loaders.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class K:
    """A kernel: stream, start/end in us, name, launch time in us (None: no launch information)."""

    rank: int
    stream: int
    start: float
    end: float
    name: str
    launch: float | None = None


@dataclass(frozen=True)
class R:
    """A range named ``dsv4cp.<phase>`` from start to end (us) on host thread ``tid``."""

    rank: int
    phase: str
    start: float
    end: float
    tid: int = 1

    @property
    def name(self) -> str:
        return f"dsv4cp.{self.phase}"


_PID0 = 1000  # host process id of rank r is _PID0 + r
_BASE_US = 1_700_000_000_000.0  # realistic absolute timestamps exercise float precision


def write_kineto(directory: Path, kernels: list[K], ranges: list[R], *, gpu_ranges: bool = False) -> Path:
    """One ``rank{r}.json`` per rank; ``gpu_ranges`` writes ranges as ``gpu_user_annotation`` too."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in sorted({k.rank for k in kernels} | {r.rank for r in ranges}):
        pid = _PID0 + rank
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}}]
        for corr, k in enumerate((k for k in kernels if k.rank == rank), start=1):
            events.append({
                "ph": "X", "cat": "kernel", "name": k.name, "pid": rank, "tid": k.stream,
                "ts": _BASE_US + k.start, "dur": k.end - k.start,
                "args": {"device": rank, "stream": k.stream, "correlation": corr, "External id": corr},
            })
            if k.launch is not None:
                events.append({
                    "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": 1,
                    "ts": _BASE_US + k.launch, "dur": 0.5, "args": {"correlation": corr, "External id": corr},
                })
        for r in (r for r in ranges if r.rank == rank):
            events.append({
                "ph": "X", "cat": "user_annotation", "name": r.name, "pid": pid, "tid": r.tid,
                "ts": _BASE_US + r.start, "dur": r.end - r.start, "args": {},
            })
            if gpu_ranges:
                events.append({
                    "ph": "X", "cat": "gpu_user_annotation", "name": r.name, "pid": rank, "tid": 7,
                    "ts": _BASE_US + r.start, "dur": r.end - r.start, "args": {},
                })
        # noise the loader must ignore
        events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": pid, "tid": 1,
                       "ts": _BASE_US - 5.0, "dur": 1.0, "args": {}})
        events.append({"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": _BASE_US})
        trace = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
                 "traceEvents": events}
        (directory / f"rank{rank}.json").write_text(json.dumps(trace))
    return directory


def _ns(us: float) -> int:
    return int(round(us * 1000))


def write_nsys(path: Path, kernels: list[K], ranges: list[R]) -> Path:
    """One SQLite file with the nsys export schema; rank r is process _PID0 + r on device r.

    Correlation ids restart at 1 in every process (as CUPTI's do), so a loader that joins kernels to
    launches on correlationId alone would mix ranks up.
    """
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
            start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL,
            streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
            demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (
            start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL, globalTid INTEGER,
            correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL);
        CREATE TABLE NVTX_EVENTS (
            start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, category INTEGER,
            color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER);
    """)
    strings: dict[str, int] = {}

    def sid(value: str) -> int:
        if value not in strings:
            strings[value] = len(strings) + 1
            conn.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[value], value))
        return strings[value]

    launch_name = sid("cudaLaunchKernel_v7000")
    for rank in sorted({k.rank for k in kernels}):
        gpid = (_PID0 + rank) << 24
        for corr, k in enumerate((k for k in kernels if k.rank == rank), start=1):
            conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?)",
                         (_ns(k.start), _ns(k.end), rank, 1, k.stream, corr, gpid, sid(f"void {k.name}<float>()"),
                          sid(k.name)))
            if k.launch is not None:
                conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?)",
                             (_ns(k.launch), _ns(k.launch) + 500, 1, gpid | 1, corr, launch_name, 0))
    for i, r in enumerate(ranges):
        gtid = ((_PID0 + r.rank) << 24) | r.tid
        # alternate registered strings (textId, what the nvtx package emits) and inline text
        text, text_id = (None, sid(r.name)) if i % 2 == 0 else (r.name, None)
        conn.execute("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                     (_ns(r.start), _ns(r.end), 59, None, None, None, text, gtid, None, text_id, 1))
    # noise the loader must ignore: domain creation, a foreign range, an unterminated range, a marker
    first_gtid = (_PID0 << 24) | 1
    conn.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?,?,?,?,?)", [
        (0, None, 75, None, None, None, "dsv4cp", first_gtid, None, None, 1),
        (0, 10**9, 59, None, None, None, "other.range", first_gtid, None, None, 0),
        (5, None, 60, 1, None, None, "dsv4cp.step", first_gtid, None, None, 1),
        (7, None, 34, None, None, None, "dsv4cp.step", first_gtid, None, None, 1),
    ])
    conn.commit()
    conn.close()
    return path


# ---------------------------------------------------------------------------------------------
# Workers for torch.multiprocessing.spawn (must be importable by the child processes).


def spawn(worker, *args: object, nprocs: int = 2) -> None:
    """Run ``worker(rank, nprocs, *args)`` in ``nprocs`` processes.

    Fork where there is no GPU (it skips re-importing torch: seconds on the 2-core CI machine);
    spawn where there is one, since CUDA and CUPTI do not survive a fork.
    """
    method = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(worker, args=(nprocs, *args), nprocs=nprocs, start_method=method)


def _init(rank: int, world: int, init_file: str, backend: str = "gloo") -> None:
    torch.set_num_threads(1)  # two ranks share the CI machine's two cores
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)


def cpu_profile_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A few steps of matmul (compress.fwd) and an async all_gather, captured with capture_trace."""
    from dsv4cp.profiling.nvtx import nvtx_range
    from dsv4cp.profiling.trace import capture_trace

    _init(rank, world, init_file)
    torch.manual_seed(rank)
    x, w = torch.randn(128, 256), torch.randn(256, 256)

    def step() -> None:
        with nvtx_range("compress.fwd"):
            y = x @ w
        with nvtx_range("allgather.kv.launch"):
            gathered = [torch.empty_like(y) for _ in range(world)]
            work = dist.all_gather(gathered, y, async_op=True)
        with nvtx_range("allgather.kv.wait"):
            work.wait()

    capture_trace(step, out_dir, steps=3, warmup=1)
    dist.destroy_process_group()


def timing_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank r sleeps 2 + 20 r ms per repetition; writes its TimingResult as JSON."""
    from dsv4cp.profiling.timing import benchmark

    _init(rank, world, init_file)
    result = benchmark(lambda: time.sleep(0.002 + 0.020 * rank), warmup=1, reps=5, device="cpu")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result.to_dict()))
    dist.destroy_process_group()


def gpu_profile_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """NCCL all_gather on a side stream overlapping a matmul, captured with capture_trace."""
    from dsv4cp.profiling.nvtx import nvtx_range
    from dsv4cp.profiling.trace import capture_trace

    torch.cuda.set_device(rank)
    _init(rank, world, init_file, backend="nccl")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    payload = torch.randn(32 * 2**20, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(world * payload.numel(), device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        with nvtx_range("compress.fwd"):
            b = a @ a
        with nvtx_range("allgather.kv.launch"):
            work = dist.all_gather_into_tensor(gathered, payload, async_op=True)
        with nvtx_range("indexer.score.fwd"):
            for _ in range(4):
                b = b @ a
        with nvtx_range("allgather.kv.wait"):
            work.wait()

    capture_trace(step, out_dir, steps=2, warmup=1)
    dist.destroy_process_group()
