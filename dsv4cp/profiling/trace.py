"""Kineto (torch.profiler) traces: capture one per rank, and read them into overlap records (docs/design.md §5).

Capture: ``capture_trace(step_fn, out_dir)`` runs ``warmup`` profiled-but-discarded steps and
``steps`` recorded ones, each inside the ``dsv4cp.step`` range, and writes ``out_dir/rank{R}.json``.

Reading a Chrome-trace JSON export (checked against exports of torch 2.13 on CPU and torch 2.11 +
CUDA 13 on an H200): complete events have ``ph == "X"``, times ``ts``/``dur`` in microseconds, and a
category ``cat``:

* ``kernel``: a GPU kernel; ``args.stream`` and ``args.correlation``.
* ``cuda_runtime`` / ``cuda_driver``: the host API call that launched it, with the same
  ``args.correlation``; used as the launch time. Both matter: cuBLAS (``nvjet_*``), NCCL and Triton
  kernels were launched by the driver's ``cuLaunchKernelEx`` (``cuda_driver``).
* ``user_annotation``: a ``record_function`` range on the host (our ``dsv4cp.*`` ranges);
  ``gpu_user_annotation`` is Kineto's projection of some of them onto a device stream.
* ``cpu_op``: an ATen operator on a host thread.
* ``gpu_memcpy`` / ``gpu_memset``: copies (e.g. the clone inside a non-inplace ``masked_fill``) and
  memsets, with ``args.stream`` and ``args.correlation`` like kernels and launched by
  ``cudaMemcpyAsync`` / ``cudaMemsetAsync``: device work of the phase that launched them, read as
  compute records (the device is not idle while they run).

Ranges are the ``user_annotation`` events named ``dsv4cp.*`` and kernels are attributed by launch
(overlap.py, rule 1). Only if no kernel of a file has a matching launch event are the
``gpu_user_annotation`` events used instead (when present), with kernels attributed by start time.

CPU-only traces have no kernels. Then host work stands in for them: every ``cpu_op`` is compute,
except communication, which is any ``cpu_op`` or ``user_annotation`` (other than our ranges) whose
name contains, case-insensitively, one of ``COMM_OP_TOKENS`` (``c10d::allgather_``, gloo's worker
thread ``gloo:all_gather``, ...), plus every ``cpu_op`` nested inside such an event on the same
thread (the copies a gloo worker does are part of the collective). Threads play the part of
streams; ops are attributed by start time.

Rank of a file: the number in its name (``rank3.json``), else ``distributedInfo.rank`` in the JSON,
else 0 when the directory holds a single trace.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from dsv4cp.profiling.nvtx import DOMAIN, full_name, nvtx_range
from dsv4cp.profiling.overlap import (
    KernelRecord,
    RangeRecord,
    attribution_table,
    is_comm_kernel,
    kernel_table,
    overlap_table,
)

RANGE_PREFIX = f"{DOMAIN}."
"""Only ranges whose names start with this are phases."""

COMM_OP_TOKENS: tuple[str, ...] = (
    "c10d::", "gloo", "nccl", "allgather", "all_gather", "allreduce", "all_reduce",
    "reduce_scatter", "reducescatter", "send", "recv",
)
"""Substrings (lower case) marking a host op as communication in a CPU-only trace."""

_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_DEVICE_WORK_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_RANK_IN_NAME = re.compile(r"rank(\d+)")
TRACE_SUFFIXES = (".json", ".json.gz")


# ---------------------------------------------------------------------------------------------
# Capture.


def capture_trace(
    step_fn: Callable[[], object],
    out_dir: str | Path,
    *,
    steps: int = 3,
    warmup: int = 1,
    rank: int | None = None,
) -> Path:
    """Profile ``warmup + steps`` calls of ``step_fn`` and write the last ``steps`` to ``rank{R}.json``.

    Activities are CPU plus CUDA when CUDA is available. ``rank`` defaults to the
    torch.distributed rank (0 without it). Returns the written file's path; ``OSError`` naming it when the
    profiler could not write it (Kineto only logs that).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the profiler's first steps are skewed), got {warmup}")
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rank{rank}.json"
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
        acc_events=True,  # one cycle only; silences the "clears events at the end of each cycle" warning
    )
    with kineto_usdt_dropped():  # the profiler's own calls only: the steps' output stays as it comes
        prof.__enter__()
    try:
        for _ in range(warmup + steps):
            with nvtx_range("step"):
                step_fn()
            if on_gpu:
                torch.cuda.synchronize()  # keep each step's kernels inside the step in the trace
            with kineto_usdt_dropped():
                prof.step()
    finally:
        with kineto_usdt_dropped():
            prof.__exit__(None, None, None)
    if not path.is_file():  # Kineto logs a failed write (a full disk) on stderr and returns as if it wrote
        Path(f"{path}.tmp").unlink(missing_ok=True)  # what it wrote before it stopped
        raise OSError(0, "the profiler could not write its trace (is the disk full, or the folder not writable?)",
                      str(path))
    return path


KINETO_USDT_PREFIX = b"USDT:"
"""How libkineto (inside libtorch) starts the lines it logs at its ``USDT`` level: a ``profiler_start`` and a
``profiler_stop`` per capture, on stderr, between a sweep's progress lines. That level ranks above
``ERROR``, so ``KINETO_LOG_LEVEL`` cannot drop them without dropping Kineto's errors too."""


@contextlib.contextmanager
def kineto_usdt_dropped() -> Iterator[None]:
    """While the block runs, file descriptor 2 goes to a temporary file; afterwards every line of it but
    Kineto's ``USDT:`` ones (:data:`KINETO_USDT_PREFIX`) is written to the real stderr, in order, also
    when the block raises. Wrap only the profiler's own calls (start, step, stop): a crash inside would
    take the captured text with it."""
    sys.stderr.flush()
    real = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(real, 2)
                captured.seek(0)
                kept = [line for line in captured.read().splitlines(keepends=True)
                        if not line.startswith(KINETO_USDT_PREFIX)]
                rest = memoryview(b"".join(kept))
                while rest:  # a pipe may take less than all of it at once
                    rest = rest[os.write(2, rest):]
    finally:
        os.close(real)


# ---------------------------------------------------------------------------------------------
# Reading.


def read_trace_json(path: str | Path) -> dict[str, Any]:
    """Parse a Chrome-trace JSON file (optionally gzip-compressed); ``ValueError`` naming the file if
    it is not one (bad JSON, bad gzip, not text)."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as handle:
            trace = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as err:
        raise ValueError(f"path: {path} is not a Kineto trace: {type(err).__name__}: {err}") from None
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"path: {path} is not a Kineto trace (no 'traceEvents')")
    return trace


def _ns(us: float) -> int:
    return int(round(float(us) * 1000.0))


def _span(event: dict[str, Any]) -> tuple[int, int]:
    start = _ns(event["ts"])
    return start, start + _ns(event.get("dur", 0))


def _thread(event: dict[str, Any]) -> int:
    tid = event.get("tid", 0)
    return tid if isinstance(tid, int) else 0


def _ranges(events: list[dict[str, Any]], category: str, rank: int) -> list[RangeRecord]:
    return [
        RangeRecord(rank, e["name"], *_span(e))
        for e in events
        if e.get("cat") == category and str(e.get("name", "")).startswith(RANGE_PREFIX)
    ]


def _gpu_records(events: list[dict[str, Any]], rank: int) -> tuple[list[KernelRecord], list[RangeRecord]]:
    launches = {
        e["args"]["correlation"]: _ns(e["ts"])
        for e in events
        if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    kernels = []
    for e in events:
        if e.get("cat") not in _DEVICE_WORK_CATEGORIES:
            continue
        args = e.get("args", {})
        kernels.append(KernelRecord(
            rank=rank,
            stream=int(args.get("stream", _thread(e))),
            start_ns=_span(e)[0],
            end_ns=_span(e)[1],
            name=e["name"],
            is_comm=is_comm_kernel(e["name"]),
            launch_ns=launches.get(args.get("correlation")),
        ))
    ranges = _ranges(events, "user_annotation", rank)
    if not any(k.launch_ns is not None for k in kernels):
        device_ranges = _ranges(events, "gpu_user_annotation", rank)
        ranges = device_ranges or ranges
    return kernels, ranges


def is_comm_op(name: str) -> bool:
    """Whether a host op of a CPU-only trace is communication (see ``COMM_OP_TOKENS``)."""
    lowered = name.lower()
    return any(token in lowered for token in COMM_OP_TOKENS)


def _cpu_records(events: list[dict[str, Any]], rank: int) -> tuple[list[KernelRecord], list[RangeRecord]]:
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    comm_annotations = [
        e for e in events
        if e.get("cat") == "user_annotation"
        and not str(e.get("name", "")).startswith(RANGE_PREFIX)
        and is_comm_op(str(e.get("name", "")))
    ]
    # merged communication intervals per thread, to classify ops nested inside a collective
    comm_spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in comm_annotations + [e for e in ops if is_comm_op(e["name"])]:
        comm_spans[_thread(e)].append(_span(e))
    merged = {tid: _merge(spans) for tid, spans in comm_spans.items()}

    def inside_comm(e: dict[str, Any]) -> bool:
        if _thread(e) not in merged:
            return False
        starts, ends = merged[_thread(e)]
        start, end = _span(e)
        i = int(np.searchsorted(starts, start, side="right")) - 1
        return i >= 0 and end <= ends[i]

    kernels = [
        KernelRecord(rank, _thread(e), *_span(e), name=e["name"], is_comm=is_comm_op(e["name"]) or inside_comm(e))
        for e in ops
    ]
    kernels += [KernelRecord(rank, _thread(e), *_span(e), name=e["name"], is_comm=True) for e in comm_annotations]
    return kernels, _ranges(events, "user_annotation", rank)


def _merge(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    spans = sorted(spans)
    starts, ends = [spans[0][0]], [spans[0][1]]
    for start, end in spans[1:]:
        if start > ends[-1]:
            starts.append(start)
            ends.append(end)
        else:
            ends[-1] = max(ends[-1], end)
    return np.array(starts, np.int64), np.array(ends, np.int64)


def kineto_records(trace: dict[str, Any], rank: int) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Kernels (or host ops, for a CPU-only trace) and ``dsv4cp.*`` ranges of one rank's trace."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    if any(e.get("cat") == "kernel" for e in events):
        return _gpu_records(events, rank)
    return _cpu_records(events, rank)


POINT_FILE = "point.json"
"""Written beside a trace directory's traces and ``overlap.csv`` (``profile --trace-dir``, sweep traces): the
axes of the point it measured, so a calibration can check that the trace is the point it is fitted for. Not
a trace itself."""


def trace_files(directory: str | Path) -> list[Path]:
    """Kineto trace files (``*.json``, ``*.json.gz``) directly inside ``directory``, sorted by name
    (:data:`POINT_FILE` excepted)."""
    directory = Path(directory)
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and p.name.endswith(TRACE_SUFFIXES) and p.name != POINT_FILE)


def _rank_of(path: Path, trace: dict[str, Any]) -> int | None:
    match = _RANK_IN_NAME.search(path.name)
    if match:
        return int(match.group(1))
    rank = trace.get("distributedInfo", {}).get("rank")
    return int(rank) if rank is not None else None


def load_kineto_dir(directory: str | Path) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Records of every rank's trace in ``directory`` (one file per rank)."""
    files = trace_files(directory)
    if not files:
        raise ValueError(f"path: no Kineto trace (*.json, *.json.gz) in {directory}")
    kernels: list[KernelRecord] = []
    ranges: list[RangeRecord] = []
    seen: dict[int, Path] = {}
    for path in files:
        trace = read_trace_json(path)
        rank = _rank_of(path, trace)
        if rank is None:
            if len(files) > 1:
                raise ValueError(f"path: cannot tell the rank of {path} (no 'rank<N>' in the name, no distributedInfo)")
            rank = 0
        if rank in seen:
            raise ValueError(f"path: {seen[rank].name} and {path.name} are both rank {rank}")
        seen[rank] = path
        file_kernels, file_ranges = kineto_records(trace, rank)
        kernels += file_kernels
        ranges += file_ranges
    return kernels, ranges


def kineto_overlap_table(directory: str | Path) -> pd.DataFrame:
    """The overlap table (overlap.COLUMNS) of a directory of per-rank Kineto traces."""
    return overlap_table(*load_kineto_dir(directory))


def kineto_attribution_table(directory: str | Path) -> pd.DataFrame:
    """The attribution table (overlap.ATTRIBUTION_COLUMNS) of a directory of per-rank Kineto traces, times
    per step: averaged over the ``dsv4cp.step`` ranges each rank's trace holds."""
    return attribution_table(*load_kineto_dir(directory), step_range=full_name("step"))


def kineto_kernel_table(directory: str | Path) -> pd.DataFrame:
    """Kernels per phase (overlap.KERNEL_COLUMNS: launch count and summed time over every step the traces
    hold) of a directory of per-rank Kineto traces: which kernels make up each phase's time."""
    return kernel_table(*load_kineto_dir(directory))
