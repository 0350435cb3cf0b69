"""Nsight Systems SQLite exports (``nsys export --type sqlite``) into overlap records (docs/design.md §5).

Tables and columns read (names as in NVIDIA's export schema; all times in ns on one clock):

* ``CUPTI_ACTIVITY_KIND_KERNEL``: ``start``, ``end``, ``deviceId``, ``streamId``, ``correlationId``,
  ``shortName`` (-> ``StringIds.id``), and ``globalPid`` where present.
* ``CUPTI_ACTIVITY_KIND_MEMCPY`` / ``CUPTI_ACTIVITY_KIND_MEMSET`` (when present): the same columns
  but the name; device work like kernels (named ``Memcpy`` / ``Memset``), as the Kineto reader does.
* ``CUPTI_ACTIVITY_KIND_RUNTIME``: ``correlationId``, ``start`` (the launch time), ``globalTid``.
* ``NVTX_EVENTS``: ``start``, ``end``, ``eventType`` (59 push/pop range, 60 start/end range),
  ``text`` or ``textId`` (-> ``StringIds``; the ``nvtx`` package registers its messages, so
  our ranges arrive as ``textId``), ``globalTid``.
* ``StringIds``: ``id``, ``value``.

``globalPid``/``globalTid`` are serialised ids; the process id is bits 24..47
(``(globalTid >> 24) & 0xFFFFFF``). CUPTI correlation ids are unique per process only, so a
kernel is joined to its launch on (process, correlationId) when the kernel table has
``globalPid`` (it does in real exports), else on correlationId alone. A kernel with no matching
row (its launching call was not recorded in that table) is attributed by its start time instead
(overlap.py, rules 1-2); no export from this suite's GPUs has been checked yet, since the GPU
machines here have no ``nsys``.

Ranks: one file per rank (``rank`` given, or ``rank<N>`` in the file name), or else the kernel's
``deviceId``. The latter assumes one process per GPU with device = rank (``torchrun`` on one node,
device = LOCAL_RANK); NVTX ranges take the rank of the device their process launched on. Only
ranges named ``dsv4cp.*`` are phases.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pandas as pd

from dsv4cp.profiling.nvtx import DOMAIN
from dsv4cp.profiling.overlap import KernelRecord, RangeRecord, is_comm_kernel, overlap_table

NVTX_PUSH_POP = 59
NVTX_START_END = 60
RANGE_PREFIX = f"{DOMAIN}."
_PID = "(({col} >> 24) & 16777215)"  # process id inside a serialised globalPid / globalTid
_RANK_IN_NAME = re.compile(r"rank(\d+)")
_DEVICE_WORK_TABLES = (("CUPTI_ACTIVITY_KIND_MEMCPY", "Memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "Memset"))


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def load_nsys(path: str | Path, *, rank: int | None = None) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Kernels and ``dsv4cp.*`` NVTX ranges of one export; every record gets ``rank`` when given."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: {path} is not a file")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:  # a file that is not SQLite fails at the first query, not at connect
        kernel_cols = _columns(conn, "CUPTI_ACTIVITY_KIND_KERNEL")
        if not kernel_cols:
            raise ValueError(f"path: {path} has no CUPTI_ACTIVITY_KIND_KERNEL table (profile with -t cuda)")
        name_col = "shortName" if "shortName" in kernel_cols else "demangledName"
        kernel_pid = _PID.format(col="k.globalPid") if "globalPid" in kernel_cols else "NULL"
        kernel_rows = conn.execute(
            f"SELECT k.start, k.end, k.deviceId, k.streamId, k.correlationId, {kernel_pid}, s.value "
            f"FROM CUPTI_ACTIVITY_KIND_KERNEL AS k LEFT JOIN StringIds AS s ON s.id = k.{name_col}"
        ).fetchall()
        for table, name in _DEVICE_WORK_TABLES:
            cols = _columns(conn, table)
            if cols:
                pid = _PID.format(col="globalPid") if "globalPid" in cols else "NULL"
                kernel_rows += conn.execute(
                    f"SELECT start, end, deviceId, streamId, correlationId, {pid}, ? FROM {table}", (name,)
                ).fetchall()
        launch_rows = []
        if _columns(conn, "CUPTI_ACTIVITY_KIND_RUNTIME"):
            launch_rows = conn.execute(
                f"SELECT correlationId, start, {_PID.format(col='globalTid')} FROM CUPTI_ACTIVITY_KIND_RUNTIME"
            ).fetchall()
        nvtx_cols = _columns(conn, "NVTX_EVENTS")
        range_rows = []
        if nvtx_cols:
            text = "COALESCE(n.text, s.value)" if "textId" in nvtx_cols else "n.text"
            join = "LEFT JOIN StringIds AS s ON s.id = n.textId" if "textId" in nvtx_cols else ""
            range_rows = conn.execute(
                f"SELECT n.start, n.end, {text}, {_PID.format(col='n.globalTid')} FROM NVTX_EVENTS AS n {join} "
                f"WHERE n.eventType IN ({NVTX_PUSH_POP}, {NVTX_START_END}) AND n.end IS NOT NULL"
            ).fetchall()
    except sqlite3.DatabaseError as err:
        raise ValueError(f"path: {path} is not an Nsight Systems SQLite export ({err})") from None
    finally:
        conn.close()

    launch_by_pid = {(pid, corr): start for corr, start, pid in launch_rows}
    launch_pid_by_corr = {corr: (start, pid) for corr, start, pid in launch_rows}  # single-process files
    kernels: list[KernelRecord] = []
    device_of_pid: dict[int, int] = {}
    for start, end, device, stream, corr, pid, name in kernel_rows:
        if pid is None:
            launch, pid = launch_pid_by_corr.get(corr, (None, None))
        else:
            launch = launch_by_pid.get((pid, corr))
        if pid is not None:
            if device_of_pid.setdefault(pid, device) != device and rank is None:
                raise ValueError(
                    f"path: process {pid} launched kernels on devices {device_of_pid[pid]} and {device}; "
                    "rank by device needs one GPU per process (export one file per rank instead)"
                )
        name = name or ""
        kernels.append(KernelRecord(
            rank=device if rank is None else rank, stream=stream, start_ns=start, end_ns=end,
            name=name, is_comm=is_comm_kernel(name), launch_ns=launch,
        ))

    ranks = {k.rank for k in kernels}
    ranges: list[RangeRecord] = []
    for start, end, name, pid in range_rows:
        if not name or not name.startswith(RANGE_PREFIX):
            continue
        if rank is not None:
            range_rank = rank
        elif pid in device_of_pid:
            range_rank = device_of_pid[pid]
        elif len(ranks) == 1:
            range_rank = next(iter(ranks))
        else:
            raise ValueError(f"path: NVTX range {name!r} comes from process {pid}, which launched no kernel")
        ranges.append(RangeRecord(range_rank, name, start, end))
    return kernels, ranges


def nsys_files(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else the ``*.sqlite`` files directly inside it."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".sqlite")


def load_nsys_files(path: str | Path) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Records of one export, or of a directory of per-rank exports (rank from ``rank<N>`` in the name)."""
    files = nsys_files(path)
    if not files:
        raise ValueError(f"path: no nsys SQLite export (*.sqlite) at {path}")
    kernels: list[KernelRecord] = []
    ranges: list[RangeRecord] = []
    owner: dict[int, Path] = {}
    for file in files:
        match = _RANK_IN_NAME.search(file.name)
        file_kernels, file_ranges = load_nsys(file, rank=int(match.group(1)) if match else None)
        for r in {k.rank for k in file_kernels} | {r.rank for r in file_ranges}:
            if r in owner:
                raise ValueError(f"path: {owner[r].name} and {file.name} both hold rank {r}")
            owner[r] = file
        kernels += file_kernels
        ranges += file_ranges
    return kernels, ranges


def nsys_overlap_table(path: str | Path) -> pd.DataFrame:
    """The overlap table (overlap.COLUMNS) of an nsys SQLite export or a directory of them."""
    return overlap_table(*load_nsys_files(path))
