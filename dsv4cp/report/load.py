"""The one reader of measurement records: run directories (or bare ``.jsonl`` files) -> one DataFrame.

The CLI ``report``, ``compare`` and the notebooks all go through :func:`load_runs` (``predict`` and
``model --calibrate`` through :func:`read_runs`, the same reading as records), so a schema change, a
duplicated input and an impossible value are handled in one place (``dsv4cp.records`` defines the
columns). :func:`load_trace` reads a run's
Kineto traces for the notebooks' timelines.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dsv4cp.profiling.overlap import KernelRecord, RangeRecord
from dsv4cp.profiling.trace import kineto_records, load_kineto_dir, read_trace_json
from dsv4cp.records import COLUMNS, META_FILE, RECORDS_FILE, RecordProblem, impossible_values, read_meta, read_records

RUN_COLUMNS: tuple[str, ...] = ("run", "run_path", "gpu_name", "git_dirty", "invalid")
"""Columns :func:`load_runs` adds after ``records.COLUMNS``: the run's name (its directory's name, or
the file's stem for a bare ``.jsonl``), its path, two fields of its ``meta.json`` (None without one), and
``invalid``: the record's metrics that no measurement can hold, ``metric -> why``
(:func:`dsv4cp.records.impossible_values`; None when there is none), their values blanked to None."""


@dataclass(frozen=True)
class LoadedRun:
    """One run as read: its name, the path given, its meta (empty without ``meta.json``) and its records."""

    name: str
    path: Path
    meta: dict
    records: list[dict]


def _records_file(path: Path) -> Path:
    """The records file a path names: ``RUN_DIR/records.jsonl`` or the ``.jsonl`` itself; ``ValueError``
    naming a path that is neither."""
    if path.is_dir():
        if not (path / RECORDS_FILE).is_file():
            raise ValueError(f"path: {path} is a directory without {RECORDS_FILE} (not a run directory)")
        return path / RECORDS_FILE
    if path.is_file() and path.suffix == ".jsonl":
        return path
    if path.exists():
        raise ValueError(f"path: {path} is neither a run directory nor a .jsonl file of records")
    raise ValueError(f"path: {path} does not exist")


def _check_distinct(paths: list[Path]) -> None:
    """``ValueError`` naming two of ``paths`` that are one run: the same records file (``runs/X`` and
    ``./runs/X``, a link), two files of the same records, or two run directories whose ``meta.json``
    says they are one run (a copy: the same start time, host and spec). Read twice, every point would count twice."""
    seen: dict[tuple, Path] = {}
    for path in paths:
        records_file = _records_file(path)
        stat = records_file.stat()
        keys = [("file", stat.st_dev, stat.st_ino), ("content", hashlib.sha256(records_file.read_bytes()).digest())]
        if path.is_dir() and (path / META_FILE).is_file():
            meta = read_meta(path)
            identity = tuple(meta.get(field) for field in ("time_utc", "host", "spec_hash"))
            if all(identity):
                keys.append(("run", *identity))
        for key in keys:
            if key in seen:
                if key[0] == "run":
                    what = f"copies of one run (meta.json: started {key[1]} on {key[2]}, the same spec)"
                else:
                    what = "the same records file" if key[0] == "file" else "copies of one run (the same records)"
                raise ValueError(f"runs: {seen[key]} and {path} are {what}: give each run once")
            seen[key] = path


def _read_run(path: Path, name: str, problems: list[RecordProblem]) -> LoadedRun:
    """One run's valid records, each once: a line repeating an earlier line's record exactly (a file
    concatenated with itself, a copied line) is counted once and named in ``problems``."""
    records_file = _records_file(path)
    meta = read_meta(path) if path.is_dir() and (path / META_FILE).is_file() else {}
    lines: list[int] = []
    records = read_records(records_file, problems, lines)
    first_line: dict[str, int] = {}
    kept = []
    for record, line in zip(records, lines):
        key = json.dumps(record, sort_keys=True, default=str)
        if key in first_line:
            why = f"a duplicate of line {first_line[key]} (the same record twice): counted once"
            problems.append(RecordProblem(str(records_file), line, why))  # no point_id: the record itself counts once
            continue
        first_line[key] = line
        kept.append(record)
    return LoadedRun(name, path, meta, kept)


def _run_names(paths: list[Path]) -> list[str]:
    """Directory names (file stems for ``.jsonl``), prefixed by their parents while two would clash."""
    parts = [list(p.resolve().parts) if p.is_dir() else [*p.resolve().parent.parts, p.stem] for p in paths]
    depth = 1
    while True:
        names = ["/".join(pieces[-depth:]) for pieces in parts]
        if len(set(names)) == len(names) or all(depth >= len(pieces) for pieces in parts):
            return names
        depth += 1


def read_runs(paths: str | os.PathLike | Iterable[str | os.PathLike],
              problems: list[RecordProblem] | None = None) -> list[LoadedRun]:
    """Every run of ``paths`` (run directories or bare ``.jsonl`` record files), checked as
    :func:`load_runs` says, as records (dicts) rather than a DataFrame: for the commands that compute on
    records (``predict``, ``model --calibrate``). A record's ``machine`` or ``git_sha`` left empty is
    taken from its run's ``meta.json``; its impossible values are left as written
    (:func:`dsv4cp.records.impossible_values` names them)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("paths: give at least one run directory or .jsonl file")
    _check_distinct(paths)
    runs = []
    for path, name in zip(paths, _run_names(paths)):
        skipped: list[RecordProblem] = []
        run = _read_run(path, name, skipped)
        if not run.records:
            why = f" valid record ({len(skipped)} lines skipped, the first: {skipped[0]})" if skipped else " record"
            raise ValueError(f"path: {path} holds no{why}")
        if problems is None:
            for problem in skipped:
                warnings.warn(f"skipping {problem}", stacklevel=2)
        else:
            problems.extend(skipped)
        measured_only = sum(r.get("bound_ms") is None and r.get("bound_measured_ms") is not None
                            for r in run.records)
        if measured_only:
            warnings.warn(f"{path}: {measured_only} record(s) written before the bound at the physical limits: "
                          "bound_ms and measured_over_bound left empty; bound_measured_ms holds their stored bound "
                          "(at the measured ceilings)", stacklevel=2)
        for record in run.records:
            for field in ("machine", "git_sha"):
                if record.get(field) is None:
                    record[field] = run.meta.get(field)
        runs.append(run)
    return runs


def load_runs(paths: str | os.PathLike | Iterable[str | os.PathLike],
              problems: list[RecordProblem] | None = None) -> pd.DataFrame:
    """All valid records of one or more runs as a DataFrame.

    ``paths``: run directories (``records.jsonl`` + ``meta.json``) or bare ``.jsonl`` record files.
    Columns: ``records.COLUMNS`` then ``RUN_COLUMNS``; one row per valid
    record, runs in the given order. Every line is checked as it is read: the lines skipped are
    appended to ``problems`` when a list is given (else warned about), each naming ``file:line: reason``;
    a line repeating an earlier one's record exactly is one of them (the record counts once). A
    record's metric that no measurement can hold (:func:`dsv4cp.records.impossible_values`: a NaN
    throughput, an imbalance below 1, a negative peak) is blanked to None and named, with why, in the
    row's ``invalid``, so no table shows it and no target is judged on it.
    A record's ``machine`` or ``git_sha`` left empty is taken from its run's ``meta.json``. List-valued
    metrics (``time_ms_samples``, ``rank_time_ms_median``, ``peak_allocated_bytes``, ...) stay Python
    lists. Raises ``ValueError`` naming a path that does not exist, is not a run, has a broken
    ``meta.json``, holds no valid record at all, or is a run given before (the same file, or a copy).
    """
    rows: list[dict] = []
    for run in read_runs(paths, problems):
        for record in run.records:
            row = {column: record.get(column) for column in COLUMNS}
            invalid = impossible_values(record)
            row.update(dict.fromkeys(invalid))
            row.update(run=run.name, run_path=str(run.path), gpu_name=run.meta.get("gpu_name"),
                       git_dirty=run.meta.get("git_dirty"), invalid=invalid or None)
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
