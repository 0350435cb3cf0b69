"""The one reader of measurement records: run directories (or bare ``.jsonl`` files) -> one DataFrame.

The CLI ``report``, ``compare`` and the notebooks all go through :func:`load_runs`, so a schema change
is handled in one place (``dsv4cp.records`` defines the columns). :func:`load_trace` reads a run's
Kineto traces for the notebooks' timelines.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from dsv4cp.profiling.overlap import KernelRecord, RangeRecord
from dsv4cp.profiling.trace import kineto_records, load_kineto_dir, read_trace_json
from dsv4cp.records import COLUMNS, META_FILE, RECORDS_FILE, RecordProblem, read_meta, read_records

RUN_COLUMNS: tuple[str, ...] = ("run", "run_path", "gpu_name", "git_dirty")
"""Columns :func:`load_runs` adds after ``records.COLUMNS``: the run's name (its directory's name, or
the file's stem for a bare ``.jsonl``), its path, and two fields of its ``meta.json`` (None without one)."""


def _records_and_meta(path: Path, problems: list[RecordProblem] | None) -> tuple[list[dict], dict]:
    """Valid records and meta (empty without ``meta.json``) of one run directory or ``.jsonl`` file;
    the lines skipped go to ``problems`` (see :func:`dsv4cp.records.read_records`)."""
    if path.is_dir():
        if not (path / RECORDS_FILE).is_file():
            raise ValueError(f"path: {path} is a directory without {RECORDS_FILE} (not a run directory)")
        meta = read_meta(path) if (path / META_FILE).is_file() else {}
        return read_records(path, problems), meta
    if path.is_file() and path.suffix == ".jsonl":
        return read_records(path, problems), {}
    if path.exists():
        raise ValueError(f"path: {path} is neither a run directory nor a .jsonl file of records")
    raise ValueError(f"path: {path} does not exist")


def _run_names(paths: list[Path]) -> list[str]:
    """Directory names (file stems for ``.jsonl``), prefixed by their parents while two would clash."""
    parts = [list(p.resolve().parts) if p.is_dir() else [*p.resolve().parent.parts, p.stem] for p in paths]
    depth = 1
    while True:
        names = ["/".join(pieces[-depth:]) for pieces in parts]
        if len(set(names)) == len(names) or all(depth >= len(pieces) for pieces in parts):
            return names
        depth += 1


def load_runs(paths: str | os.PathLike | Iterable[str | os.PathLike],
              problems: list[RecordProblem] | None = None) -> pd.DataFrame:
    """All valid records of one or more runs as a DataFrame.

    ``paths``: run directories (``records.jsonl`` + ``meta.json``) or bare ``.jsonl`` record files.
    Columns: ``records.COLUMNS`` then ``RUN_COLUMNS``; one row per valid
    record, runs in the given order. Every line is checked as it is read: the lines skipped are
    appended to ``problems`` when a list is given (else warned about), each naming ``file:line: reason``.
    A record's ``machine`` or ``git_sha`` left empty is taken from its run's ``meta.json``. List-valued
    metrics (``time_ms_samples``, ``rank_time_ms_median``, ``peak_allocated_bytes``, ...) stay Python
    lists. Raises ``ValueError`` naming a path that does not exist, is not a run, has a broken
    ``meta.json``, or holds no valid record at all.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("paths: give at least one run directory or .jsonl file")
    rows: list[dict] = []
    for path, name in zip(paths, _run_names(paths)):
        skipped: list[RecordProblem] = []
        records, meta = _records_and_meta(path, skipped)
        if not records:
            why = f" valid record ({len(skipped)} lines skipped, the first: {skipped[0]})" if skipped else " record"
            raise ValueError(f"path: {path} holds no{why}")
        if problems is None:
            for problem in skipped:
                warnings.warn(f"skipping {problem}", stacklevel=2)
        else:
            problems.extend(skipped)
        measured_only = sum(r.get("bound_ms") is None and r.get("bound_measured_ms") is not None for r in records)
        if measured_only:
            warnings.warn(f"{path}: {measured_only} record(s) written before the bound at the physical limits: "
                          "bound_ms and measured_over_bound left empty; bound_measured_ms holds their stored bound "
                          "(at the measured ceilings)", stacklevel=2)
        for record in records:
            row = {column: record.get(column) for column in COLUMNS}
            for field in ("machine", "git_sha"):
                if row[field] is None:
                    row[field] = meta.get(field)
            row.update(run=name, run_path=str(path), gpu_name=meta.get("gpu_name"), git_dirty=meta.get("git_dirty"))
            rows.append(row)
    return pd.DataFrame(rows, columns=[*COLUMNS, *RUN_COLUMNS])


def load_trace(path: str | os.PathLike) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """Kernels and ``dsv4cp.*`` ranges of Kineto traces: a directory of per-rank files (as a sweep's
    ``--profile`` writes them) or a single trace file (its rank from the trace's ``distributedInfo``,
    else 0). Raises ``ValueError`` naming a path that does not exist or holds no trace."""
    path = Path(path)
    if path.is_dir():
        return load_kineto_dir(path)
    if not path.is_file():
        raise ValueError(f"path: {path} does not exist")
    trace = read_trace_json(path)
    return kineto_records(trace, int(trace.get("distributedInfo", {}).get("rank", 0)))
