"""Writing a run's records and its ``meta.json``: every line whole or not at all, every rewrite atomic."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from dsv4cp.records.checks import check_record, check_status
from dsv4cp.records.ids import point_id
from dsv4cp.records.reading import _parse_line
from dsv4cp.records.schema import (
    AXES,
    COLUMNS,
    META_FIELDS,
    META_FILE,
    METRICS,
    SCHEMA_VERSION,
    _added_axis_defaults,
    _emulated,
)


def make_record(
    axes: dict, metrics: dict, *, sweep: str, status: str, machine: str, git_sha: str | None,
    resolved_backends: dict | None = None, error: str | None = None, time_utc: str | None = None,
    kernel_options: dict | None = None, backends: dict | None = None,
) -> dict:
    """One record with every column of :data:`COLUMNS` (missing axes and metrics are None;
    ``kernel_options``: option -> value, ``backends``: op.direction -> the implementation that ran).

    ``kernel_options``: every option's value as the point ran (replaces the axis' value in the record;
    the id keeps the options the point set); ``backends``: what ran (:data:`COLUMNS`).

    Raises ``ValueError`` naming an unknown axis or metric name, or a malformed status.
    """
    for name in axes:
        if name not in AXES:
            raise ValueError(f"axes: unknown axis {name!r}; allowed: {AXES}")
    for name in metrics:
        if name not in METRICS:
            raise ValueError(f"metrics: unknown metric {name!r}; allowed: {METRICS}")
    check_status(status)
    record = {
        "schema": SCHEMA_VERSION, "point_id": point_id(axes), "sweep": sweep, "status": status,
        "time_utc": time_utc or utc_now(), "git_sha": git_sha, "machine": machine, "emulated": None,
    }
    record.update({name: axes.get(name) for name in AXES})
    record.update(_added_axis_defaults(record))
    if kernel_options is not None:
        record["kernel_options"] = kernel_options
    record["emulated"] = _emulated(record)
    record.update({name: metrics.get(name) for name in METRICS})
    record["resolved_backends"] = resolved_backends
    record["backends"] = backends
    record["error"] = error
    return record


def utc_now() -> str:
    """The current time, ISO 8601 in UTC to the second (``2026-01-31T12:00:00Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _record_line(record: dict) -> bytes:
    """``record`` as its line of a records file; ``ValueError`` when a column is missing."""
    missing = [name for name in COLUMNS if name not in record]
    if missing:
        raise ValueError(f"record: missing columns {missing}; build it with make_record")
    return (json.dumps(finite_or_null(record), allow_nan=False) + "\n").encode()


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line, whole or not at all (:func:`append_bytes`), so neither a killed
    writer nor a full disk leaves half a line for the next record to join. Creates the parent directory."""
    line = _record_line(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_bytes(path, line)


def append_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing) as a whole or not at all, then fsync.

    One ``os.write`` on an ``O_APPEND`` descriptor takes the whole buffer unless the disk is full (or a
    quota, or an I/O error, stops it part way): then the rest is written until the system says why, and
    the part that did land is cut off again before that error is raised, naming ``path``, so the file
    ends where it ended before. A kill between the write and the cut leaves a partial last line, which
    every reader skips (:func:`read_records`) and a resumed sweep drops (:func:`drop_partial_line`)."""
    path = Path(path)
    fd = _opened(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
        except OSError as err:
            with contextlib.suppress(OSError):  # the cut frees space: it works when the write did not
                os.ftruncate(fd, start)
            raise _naming(err, path) from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a short write is followed by the rest, until the system says why it stops),
    then fsync."""
    rest = memoryview(data)[os.write(fd, data):]  # the whole line in one call, unless the disk is full
    while rest:
        rest = rest[os.write(fd, rest):]
    os.fsync(fd)


def _opened(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except OSError as err:
        raise _naming(err, path) from None


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` naming ``path`` (an ``os.write`` or ``fsync`` error names no file): the CLI's one line is
    then ``PATH: No space left on device``."""
    return OSError(err.errno, err.strerror or str(err), str(path))


def finite_or_null(value: object) -> object:
    """``value`` with every float that is not finite (NaN, infinity), at any depth of its lists and
    objects, replaced by None: what strict JSON can hold (see the module docstring)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def replace_record(path: str | os.PathLike, record: dict) -> bool:
    """Put ``record`` in place of the records of its point in ``path`` whose status is ``error: ...`` (a
    point measured again by ``sweep --resume --retry-errors``): the first such line takes it, any later one
    is dropped; every other line, valid or not, is kept as it is. Returns False (and leaves the file alone)
    when there is no such record: append it then.

    The file is rewritten beside itself and renamed over the old one after an fsync, so a reader, or a
    writer killed at any moment, finds the old file (the failed record) or the new one (the new record),
    never neither; the records stay in the order they were first measured in."""
    path = Path(path)
    line = _record_line(record)
    kept: list[bytes] = []
    replaced = False
    for text in path.read_bytes().splitlines(keepends=True) if path.exists() else []:
        parsed, reason = _parse_line(text.rstrip(b"\n"))
        superseded = (reason is None and check_record(parsed) is None and parsed["point_id"] == record["point_id"]
                      and parsed["status"].startswith("error"))
        if not superseded:
            kept.append(text)
        elif not replaced:
            kept.append(line)
            replaced = True
    if replaced:
        write_file_atomically(path, b"".join(kept))
    return replaced


def write_file_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, fsynced, renamed over it (and
    the directory fsynced, so the rename outlives a crash); on any error (a full disk, a read-only
    directory) the temporary file is removed, ``path`` keeps its old content, and the error names ``path``."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as err:
        raise _naming(err, path) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def drop_partial_line(path: str | os.PathLike) -> bool:
    """Cut a trailing line without its newline (a killed writer) off ``path`` before appending to it
    again, so the next record does not join it; returns whether one was cut."""
    path = Path(path)
    if not path.exists():
        return False
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep == len(data):
        return False
    warnings.warn(f"{path}: dropping a partial last line ({len(data) - keep} bytes): a writer was killed",
                  stacklevel=2)
    os.truncate(path, keep)
    return True


def move_records(path: str | os.PathLike, to: str | os.PathLike, moved: Callable[[dict], bool]) -> int:
    """Move the valid records of ``path`` for which ``moved(record)`` holds to the end of ``to``, byte for
    byte (every other line, invalid ones too, stays in ``path`` in its order); returns how many moved. The
    moved lines are appended to ``to`` and synced before ``path`` is replaced (atomically, by a rename), so
    a kill in between leaves a record in both files, never in neither."""
    path, to = Path(path), Path(to)
    if not path.exists():
        return 0
    kept, taken = [], []
    for line in path.read_bytes().splitlines(keepends=True):
        record, reason = _parse_line(line) if line.strip() else (None, "blank")
        if reason is None and check_record(record) is None and moved(record):
            taken.append(line)
        else:
            kept.append(line)
    if not taken:
        return 0
    append_bytes(to, b"".join(taken))
    write_file_atomically(path, b"".join(kept))
    return len(taken)


def write_meta(run_dir: str | os.PathLike, meta: dict) -> None:
    """Write ``RUN_DIR/meta.json`` (replaced atomically by a rename); fills ``schema``."""
    unknown = [name for name in meta if name not in META_FIELDS]
    if unknown:
        raise ValueError(f"meta: unknown fields {unknown}; allowed: {META_FIELDS}")
    full = {name: meta.get(name) for name in META_FIELDS}
    full["schema"] = SCHEMA_VERSION
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomically(run_dir / META_FILE, (json.dumps(full, indent=2, default=str) + "\n").encode())
