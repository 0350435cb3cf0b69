"""Reading a run's records (every line checked, a bad one named and skipped) and its ``meta.json``."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from dsv4cp.records.checks import check_meta, check_record
from dsv4cp.records.schema import META_FILE, RECORDS_FILE, _added_axis_defaults, _emulated, _with_both_bounds


@dataclass(frozen=True)
class RecordProblem:
    """A line of a records file that :func:`read_records` skipped, and why."""

    path: str
    line: int
    reason: str
    point_id: str | None = None
    """The line's ``point_id`` when it is a record that names one (so a reader can tell which point
    holds a broken value); None for a line that is no record at all."""
    record: dict | None = None
    """The parsed JSON object, when the line is one."""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def read_records(path: str | os.PathLike, problems: list[RecordProblem] | None = None,
                 line_numbers: list[int] | None = None) -> list[dict]:
    """Every valid record of a ``.jsonl`` file (or of ``RUN_DIR/records.jsonl`` when given a directory).

    Every line is checked (:func:`check_record`); a line that is not a valid record (not UTF-8, not
    JSON, another schema version, a field of the wrong type, an ``ok`` record with a broken time, a
    trailing line without its newline left by a killed writer) is skipped: appended to ``problems``
    as a :class:`RecordProblem` (``file:line: reason``) when a list is given, else warned about.
    Never raises for the file's content. ``line_numbers``, when given, receives the line (from 1) of
    each record returned, in order (what names a duplicated line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS_FILE
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    found: list[RecordProblem] = []
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record, reason = _parse_line(line)
        if reason is None:
            reason = check_record(record)
        if reason is None:
            record.update(_added_axis_defaults(record))
            record.setdefault("emulated", _emulated(record))
            _with_both_bounds(record)
            records.append(record)
            if line_numbers is not None:
                line_numbers.append(number)
            continue
        named = record.get("point_id") if isinstance(record, dict) else None
        found.append(RecordProblem(str(path), number, reason, named if isinstance(named, str) else None,
                                   record if isinstance(record, dict) else None))
    if tail.strip():
        found.append(RecordProblem(str(path), len(lines) + 1,
                                   f"a partial last line ({len(tail)} bytes): a writer was killed"))
    if problems is None:
        for problem in found:
            warnings.warn(f"skipping {problem}", stacklevel=2)
    else:
        problems.extend(found)
    return records


def _parse_line(line: bytes) -> tuple[object, str | None]:
    """The JSON value of one line, or None and why it is not one."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text ({err.reason} at byte {err.start})"
    try:
        return json.loads(text), None
    except RecursionError:
        return None, "not a JSON record (nested too deeply)"
    except ValueError as err:  # JSONDecodeError, or an integer too long to convert
        return None, f"not a JSON record ({err})"


def read_meta(run_dir: str | os.PathLike) -> dict:
    """``RUN_DIR/meta.json``; ``ValueError`` naming the file if it is missing, not UTF-8 JSON, not an
    object, of another schema version or holds a field of the wrong type (:data:`META_TYPES`)."""
    path = Path(run_dir) / META_FILE
    if not path.exists():
        raise ValueError(f"run_dir: {run_dir} has no {META_FILE}")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (RecursionError, ValueError) as err:  # JSONDecodeError, nesting, an integer too long to convert
        raise ValueError(f"{path}: not valid JSON, truncated or corrupted ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(meta).__name__}")
    reason = check_meta(meta)
    if reason is not None:
        raise ValueError(f"{path}: {reason}")
    return meta
