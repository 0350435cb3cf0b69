"""Why a record, a ``meta.json``, a status or a measured time is not a valid one, and which values of a
valid record no measurement can hold."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from dsv4cp.records.field_types import FieldType, _is_int, _is_number
from dsv4cp.records.ids import _id_under_former_defaults, point_id
from dsv4cp.records.schema import (
    _ADDED_AXES,
    AXES,
    COLUMN_TYPES,
    META_TYPES,
    OK_REQUIRED_AXES,
    OK_TIMES,
    SCHEMA_VERSION,
    STATUS_OK,
    STATUS_OOM,
    STATUS_PREFIXES,
    _added_axis_defaults,
)

_RELATIVE_SLACK = 1e-9
"""Rounding allowed when ordering times that were computed (percentiles of the same samples)."""


def _type_problem(fields: dict, types: dict[str, FieldType]) -> str | None:
    for name, value in fields.items():
        kind = types.get(name)
        if value is not None and kind is not None and not kind.accepts(value):
            return f"{name}: must be {kind.description} or null, got {_shown(value)}"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value, allow_nan=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_record(record: object) -> str | None:
    """Why ``record`` (a parsed JSON line) is not a valid record, or None when it is one.

    Checks the schema version, every column's type (:data:`COLUMN_TYPES`), the status, that
    ``point_id`` is the id of the record's axes, and for an ``ok`` record: every axis present,
    those of :data:`OK_REQUIRED_AXES` with a value, the :data:`OK_TIMES` that are given (None: not
    measured) finite, > 0 and ordered, and the repetitions' times (when stored) finite, > 0 and
    spanning them.
    """
    if not isinstance(record, dict):
        return f"not a JSON object record (a JSON {type(record).__name__})"
    if record.get("schema") != SCHEMA_VERSION:
        return f"schema: expected {SCHEMA_VERSION}, got {_shown(record.get('schema'))}"
    problem = _type_problem(record, COLUMN_TYPES)
    if problem is not None:
        return problem
    try:
        check_status(record.get("status"))
    except ValueError as err:
        return str(err)
    if record.get("point_id") is None:
        return "point_id: missing"
    problem = _ok_problem(record) if record["status"] == STATUS_OK else None
    if problem is not None:
        return problem
    axes = {**record, **_added_axis_defaults(record)}
    expected = point_id(axes)
    if record["point_id"] != expected and not _id_under_former_defaults(record["point_id"], axes):
        return f"point_id: {record['point_id']!r} is not the id of the record's axes ({expected!r})"
    return None


def _ok_problem(record: dict) -> str | None:
    """Why an ``ok`` record's axes or times cannot be a measurement, or None."""
    absent = [axis for axis in AXES if axis not in record and axis not in _ADDED_AXES]
    if absent:
        return f"{absent[0]}: an ok record needs every axis as a column, this one lacks {absent}"
    unset = [axis for axis in OK_REQUIRED_AXES if record.get(axis) is None]
    if unset:
        return f"{unset[0]}: an ok record needs a value of {list(OK_REQUIRED_AXES)}, this one has none of {unset}"
    low, median, high = (record.get(name) for name in OK_TIMES)
    return check_times(median, low, high, record.get("time_ms_samples"), names=(*OK_TIMES, "time_ms_samples"),
                       required=False)


def check_times(median: object, low: object, high: object, samples: list | None = None, *,
                names: tuple[str, str, str, str] = ("p20", "median", "p80", "samples"),
                required: bool = True) -> str | None:
    """Why a measured time (its median, its band ``low..high`` and, when given, the repetitions'
    times) cannot be a measurement, or None: each must be a finite number > 0, ``low <= median <=
    high``, and the band must lie within the samples' range. ``required=False``: a time given as
    None is not measured (left out of the checks). ``names``: the fields of low, median, high and
    samples, for the message."""
    low_name, median_name, high_name, samples_name = names
    given = [(name, value) for name, value in ((low_name, low), (median_name, median), (high_name, high))
             if required or value is not None]
    for name, value in given:
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            return f"{name}: a measured time must be a finite number > 0, got {_shown(value)}"
    for (first, smaller), (second, larger) in zip(given, given[1:]):
        if smaller > larger * (1 + _RELATIVE_SLACK):
            return (f"{median_name}: must lie in its band {low_name}..{high_name}, "
                    f"got {first} {smaller!r} > {second} {larger!r}")
    if samples is None:
        return None
    if not samples:
        return f"{samples_name}: a measured time's samples must not be empty"
    for value in samples:
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            return f"{samples_name}: every repetition's time must be a finite number > 0, got {_shown(value)}"
    fastest, slowest = min(samples), max(samples)
    for name, value in given:
        if not fastest * (1 - _RELATIVE_SLACK) <= value <= slowest * (1 + _RELATIVE_SLACK):
            return f"{name}: {value!r} lies outside its samples' range {fastest!r}..{slowest!r}"
    return None


def _finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)


def _at_least(low: float, what: str) -> Callable[[object], str | None]:
    def problem(value: object) -> str | None:
        if not _finite(value):
            return f"{what} must be a finite number, got {_shown(value)}"
        return None if value >= low * (1 - _RELATIVE_SLACK) else f"{what} must be >= {low:g}, got {value!r}"
    return problem


def _positive(what: str) -> Callable[[object], str | None]:
    def problem(value: object) -> str | None:
        return None if _finite(value) and value > 0 else f"{what} must be a finite number > 0, got {_shown(value)}"
    return problem


def _fraction(what: str) -> Callable[[object], str | None]:
    def problem(value: object) -> str | None:
        if _finite(value) and 0 <= value <= 1 + _RELATIVE_SLACK:
            return None
        return f"{what} must lie in 0..1 (0..100%), got {_shown(value)}"
    return problem


def _each(check: Callable[[object], str | None]) -> Callable[[object], str | None]:
    """A list's check: the first item (None skipped: a rank not measured) that fails ``check``."""
    def problem(values: object) -> str | None:
        for rank, value in enumerate(values):
            why = None if value is None else check(value)
            if why is not None:
                return f"rank {rank}: {why}"
        return None
    return problem


VALUE_RULES: dict[str, Callable[[object], str | None]] = {
    "imbalance_max_over_mean": _at_least(1.0, "the max over the mean of the ranks' times"),
    "rank_time_ms_median": _each(_positive("a measured time")),
    "tokens_per_s": _positive("a throughput"),
    "tflops_per_gpu": _positive("a throughput"),
    "mfu": _fraction("a share of the machine's matmul ceiling"),
    "model_flops": _positive("a FLOP count"),
    "bound_ms": _positive("a lower bound on the step's time"),
    "measured_over_bound": _positive("a ratio of two times"),
    "bound_measured_ms": _positive("a lower bound on the step's time"),
    "measured_over_measured_bound": _positive("a ratio of two times"),
    "peak_allocated_bytes": _each(_at_least(0, "a byte count")),
    "device_used_bytes": _each(_at_least(0, "a byte count")),
    "comm_ms": _at_least(0, "a communication time"),
    "exposed_comm_ms": _at_least(0, "a communication time"),
    "overlap_ratio": _fraction("a share of the communication time"),
    "slowest_rank_ms": _positive("a measured time"),
    "compile_s": _at_least(0, "a wall time"),
}
"""Metric -> why a value of the right type (:data:`COLUMN_TYPES`) cannot be a measurement, or None;
a metric that is None (not measured) is never checked."""


def impossible_values(record: dict) -> dict[str, str]:
    """Metric -> why its value cannot be a measurement, for every metric of ``record`` (a valid record,
    :func:`check_record`) that :data:`VALUE_RULES` rejects, or that contradicts another (more exposed
    communication than communication; a slowest rank outside the ranks). Empty for a sound record."""
    found = {name: why for name, rule in VALUE_RULES.items()
             if record.get(name) is not None and (why := rule(record[name])) is not None}
    comm, exposed = record.get("comm_ms"), record.get("exposed_comm_ms")
    if (_finite(comm) and _finite(exposed) and "comm_ms" not in found and "exposed_comm_ms" not in found
            and exposed > comm * (1 + _RELATIVE_SLACK) + 1e-9):
        found["exposed_comm_ms"] = f"exposed communication {exposed!r} ms exceeds all communication {comm!r} ms"
    slowest, cp = record.get("slowest_rank"), record.get("cp")
    if _is_int(slowest) and _is_int(cp) and slowest >= cp:
        found["slowest_rank"] = f"rank {slowest} is not one of the cp = {cp} ranks"
    return found


def check_meta(meta: object) -> str | None:
    """Why ``meta`` (a parsed ``meta.json``) is not a valid one, or None when it is."""
    if not isinstance(meta, dict):
        return f"must be a JSON object, got a JSON {type(meta).__name__}"
    if meta.get("schema") != SCHEMA_VERSION:
        return f"schema: expected {SCHEMA_VERSION}, got {_shown(meta.get('schema'))}"
    return _type_problem(meta, META_TYPES)


def check_status(status: str) -> str:
    """``status`` unchanged if valid, else ``ValueError`` naming it."""
    if not isinstance(status, str) or not (
        status in (STATUS_OK, STATUS_OOM) or (status.startswith(STATUS_PREFIXES) and "\n" not in status)
    ):
        raise ValueError(f"status: must be 'ok', 'oom', 'error: <msg>' or 'skipped: <why>' (one line), got {status!r}")
    return status
