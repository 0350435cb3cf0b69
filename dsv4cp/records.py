"""The measurement record shared by ``profile --out``, ``sweep``, ``report``, ``compare`` and the notebooks.

A run directory holds ``records.jsonl`` (one flat JSON object per measured point, columns
:data:`COLUMNS`) and ``meta.json`` (once per run: versions, hardware, the spec). This module is the
only place that defines the columns and their types (:data:`COLUMN_TYPES`, :data:`META_TYPES`), and
the only reader: every line is checked as it is read (:func:`check_record`; a bad one is named
``file:line: reason`` and skipped). It imports nothing but the standard library so every layer of the
package (and a notebook without torch) can use it.

Every line is strict JSON: a value that is not a finite number (a phase without communication has no
overlap ratio, ``nan``) is written as ``null``, which means "not measured or undefined" everywhere in a
record. JSON has no NaN or Infinity: Python writes them as bare ``NaN``, which ``jq``, JavaScript,
Go, Rust and most other strict parsers reject, so a file holding one could not be read by them at all.
Files written before hold bare ``NaN`` there; :func:`read_records` still reads them.

A value of the right type may still be one no measurement can hold (an imbalance below 1, a negative
peak, an MFU above 100%, a NaN throughput): :func:`impossible_values` names them and why; the loader
(``dsv4cp.report.load``) blanks them and reports them as invalid, so a report never shows or judges one.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsv4cp import kernel_options as kernel_option_registry

SCHEMA_VERSION: int = 1

AXES: tuple[str, ...] = (
    "preset", "ratio", "cp", "tokens", "tokens_per_rank", "packing", "loss", "overlap", "kernel_backend",
    "recompute", "pass", "dtype", "seed", "partition", "emulated_rank", "cuda_graph", "kernel_options",
    "deterministic", "compile", "fresh_batches",
)
"""What was measured. ``pass``: ``fwd`` | ``fwd+bwd``; ``packing``: ``one`` | ``fixed:<len>`` |
``histogram`` | ``histogram-bestfit`` | ``adversarial`` | ``lengths:<a,b,...>``; ``partition``:
``equal`` | ``balanced`` (rank row ranges, :func:`dsv4cp.model.partition.partition`); ``dtype``: a
``config.DTYPES`` key; ``kernel_backend``: what was asked (``auto``, ...); ``emulated_rank``: None for
a real run, else the one rank of the ``cp`` that a single process measured alone with its collectives
replaced by no-ops (:mod:`dsv4cp.cp.emulate`: compute and memory only, no communication; its per-rank
lists hold None at every other rank), or ``"all"`` for the summary of every rank emulated in turn on one
device (per-rank lists complete; times are the slowest rank's); ``cuda_graph``: whether the timed steps
were replays of one captured CUDA graph (no host overhead) rather than eager steps (memory and traces stay
eager); ``kernel_options``: in a record every option's value as the point ran
(:func:`dsv4cp.kernel_options.resolved`, the ``kernel_options=`` keyword of :func:`make_record`), so
two runs on different kernel variants never look alike; a point's id is built on the options whose value
differs from the default (:func:`dsv4cp.kernel_options.non_default`; none: left out, the id of a record
from before the axis existed); ``deterministic``: whether the step ran under
``torch.use_deterministic_algorithms(True)`` with deterministic kernel backends; ``compile``: the
``torch.compile`` backend of the layer, None when eager; ``fresh_batches``: 0 when every step ran on one
batch (its per-batch layout built once, then reused, as by the layers of a deep model), else the number
of distinct batches the steps cycled through, each step missing the layout cache (a one-layer model fed
a new batch every step); a configuration too (:data:`CONFIG_FIELDS`)."""

_ADDED_AXES: dict[str, object] = {"emulated_rank": None, "cuda_graph": False, "kernel_options": None,
                                  "deterministic": False, "compile": None, "fresh_batches": 0}
"""Axes added after records were first committed -> what a record meant before the axis existed (a
real run; eager steps). An added axis at that value (or None) is left out of :func:`point_id`, so the
ids of earlier records (and of every real, eager run) do not change; :func:`make_record` and
:func:`read_records` fill a value other than None in where a record lacks it, so an old run and a new
one agree on it (a report would otherwise see ``None`` and ``False`` as two values of the axis)."""

METRICS: tuple[str, ...] = (
    "time_ms_median", "time_ms_p20", "time_ms_p80",  # max over ranks per repetition, then the statistic
    "time_ms_samples",  # list[float]: every timed repetition's time (max over ranks), in the order they ran
    "rank_time_ms_median",  # list[float], one per rank (imbalance)
    "imbalance_max_over_mean",  # of the per-rank medians
    "tokens_per_s", "tflops_per_gpu", "mfu",  # mfu: against the machine's measured matmul ceiling
    "model_flops",
    "bound_ms", "measured_over_bound",  # the cost model's bound at the hardware's physical limits (spec sheet)
    "bound_measured_ms", "measured_over_measured_bound",  # ... and at the machine's measured ceilings
    "bound_machine",  # str: the machine whose ceilings bound_measured_ms is at (dsv4cp.model.machine); None: no bound
    "peak_allocated_bytes",  # list[int] per rank (host peak RSS on CPU)
    "device_used_bytes",  # list[int | None] per rank
    "exposed_comm_ms", "comm_ms", "overlap_ratio",  # totals of rank 0's overlap table; None unless profiled
    "phases",  # list[dict]: the per-phase overlap rows of every rank, per step; None unless profiled
    "parity",  # list[dict]: the parity check against fp64 per quantity (harness.parity.Comparison); None unless checked
    "memory_phases",  # list[dict]: per rank and phase, allocated bytes at entry/exit and peak; None unless asked
    "split",  # list[int]: the ranks' row split points (0 = b_0 <= ... <= b_cp = tokens)
    "calibration",  # str: the calibration the balanced split was computed with; None: the model's bounds
    "slowest_rank", "slowest_rank_ms",  # int, float: of an all-ranks emulation summary; None otherwise
    "compile_s",  # the first (compiling) step's wall time in s, apart from the timed steps; None when eager
    "graph_breaks",  # int: graph breaks Dynamo counted while compiling; None when eager
)
"""What was measured about it; a metric that was not measured is None.

Two bounds: ``bound_ms`` at the physical limits of the hardware
(:func:`dsv4cp.model.machine.physical_limits`: on an H200 its spec sheet, 989 TFLOP/s dense bf16, 4.8 TB/s
HBM, 450 GB/s per NVLink direction), the time no kernel can beat, and ``bound_measured_ms`` at the
ceilings of ``bound_machine`` as measured on it (784 TFLOP/s, 4.26 TB/s ...), the time the best measured
kernels could reach; ``measured_over_bound`` and ``measured_over_measured_bound`` divide the median step
time by each. A record written before the physical bound existed (no ``bound_measured_ms`` column) held
in ``bound_ms`` its bound at the measured ceilings: :func:`read_records` moves it to
``bound_measured_ms`` and leaves ``bound_ms`` None (:func:`before_the_physical_bound`)."""

_MEASURED_BOUND_COLUMNS = {"bound_ms": "bound_measured_ms", "measured_over_bound": "measured_over_measured_bound"}
"""What a record written before the physical bound held in each of today's physical-bound columns."""


def before_the_physical_bound(record: dict) -> bool:
    """Whether ``record`` (as stored) was written before records carried the physical bound: its ``bound_ms``
    is the bound at the measured ceilings."""
    return "bound_measured_ms" not in record


def _with_both_bounds(record: dict) -> None:
    """Fill the measured-ceiling columns of a record written before the physical bound from what it stored
    (its bound was at the measured ceilings) and leave its physical bound empty: it was never computed."""
    if before_the_physical_bound(record):
        for physical, measured in _MEASURED_BOUND_COLUMNS.items():
            record[measured] = record.get(physical)
            record[physical] = None

COLUMNS: tuple[str, ...] = (
    "schema", "point_id", "sweep", "status", "time_utc", "git_sha", "machine", "emulated", *AXES, *METRICS,
    "resolved_backends", "backends", "error",
)
"""``resolved_backends``: what ``kernel_backend`` resolved to (``{"sparse_attention": name}``);
``backends``: what ran per op and direction during the timed step, and the launches' tile configs
(:func:`dsv4cp.kernel_options.backends_ran`), None in records from before it existed."""

STATUS_OK = "ok"
STATUS_OOM = "oom"
STATUS_PREFIXES = ("error: ", "skipped: ")
"""A status is ``ok``, ``oom``, ``error: <one line>`` or ``skipped: <why>``."""

META_FIELDS: tuple[str, ...] = (
    "schema", "time_utc", "git_sha", "git_dirty", "host", "machine", "gpu_name", "gpu_count", "driver",
    "cuda", "torch", "triton", "nccl", "optional_backends", "spec", "kernel_options",
    "spec_hash",  # a sweep's identity: the sha256 of the spec's canonical JSON (dsv4cp.sweeps.identity)
    "point_ids",  # ... and the ids of the points it expands to, in order (what --resume may continue)
)

RECORDS_FILE = "records.jsonl"
META_FILE = "meta.json"


# ------------------------------------------------------------------------------- field types
@dataclass(frozen=True)
class FieldType:
    """What a column may hold besides None (None is always allowed: a metric not measured, an axis
    without a value, a column that an older writer did not have)."""

    description: str
    accepts: Callable[[object], bool]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(accepts: Callable[[object], bool], *, none_allowed: bool = False) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and all(
        (none_allowed and item is None) or accepts(item) for item in value)


def _mapping_of(accepts: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, dict) and all(accepts(item) for item in value.values())


def _int_at_least(low: int) -> FieldType:
    return FieldType(f"an integer >= {low}", lambda value: _is_int(value) and value >= low)


TEXT = FieldType("a string", lambda value: isinstance(value, str))
FLAG = FieldType("true or false", lambda value: isinstance(value, bool))
NUMBER = FieldType("a number", _is_number)
MAPPING = FieldType("a JSON object", lambda value: isinstance(value, dict))
TEXT_MAPPING = FieldType("a JSON object of strings", _mapping_of(lambda item: isinstance(item, str)))
SCALAR_MAPPING = FieldType("a JSON object of strings, numbers or flags",
                           _mapping_of(lambda item: isinstance(item, (str, int, float))))
NUMBERS = FieldType("a list of numbers", _list_of(_is_number))
NUMBERS_OR_NULLS = FieldType("a list of numbers or nulls", _list_of(_is_number, none_allowed=True))
INTS = FieldType("a list of integers", _list_of(_is_int))
INTS_OR_NULLS = FieldType("a list of integers or nulls", _list_of(_is_int, none_allowed=True))
OBJECTS = FieldType("a list of JSON objects", _list_of(lambda item: isinstance(item, dict)))
OBJECTS_OR_NULLS = FieldType("a list of JSON objects or nulls",
                             _list_of(lambda item: isinstance(item, dict), none_allowed=True))

COLUMN_TYPES: dict[str, FieldType] = {
    "schema": _int_at_least(1), "point_id": TEXT, "sweep": TEXT, "status": TEXT, "time_utc": TEXT,
    "git_sha": TEXT, "machine": TEXT, "emulated": FLAG,
    # axes
    "preset": TEXT, "ratio": _int_at_least(0), "cp": _int_at_least(1), "tokens": _int_at_least(1),
    "tokens_per_rank": _int_at_least(1), "packing": TEXT, "loss": TEXT, "overlap": TEXT, "kernel_backend": TEXT,
    "recompute": FLAG, "pass": TEXT, "dtype": TEXT, "seed": _int_at_least(0), "partition": TEXT,
    "emulated_rank": FieldType("an integer >= 0 or \"all\"",
                               lambda value: (_is_int(value) and value >= 0) or value == "all"),
    "cuda_graph": FLAG, "deterministic": FLAG, "compile": TEXT, "fresh_batches": _int_at_least(0),
    # metrics
    "time_ms_median": NUMBER, "time_ms_p20": NUMBER, "time_ms_p80": NUMBER, "time_ms_samples": NUMBERS,
    "rank_time_ms_median": NUMBERS_OR_NULLS, "imbalance_max_over_mean": NUMBER, "tokens_per_s": NUMBER,
    "tflops_per_gpu": NUMBER, "mfu": NUMBER, "model_flops": NUMBER, "bound_ms": NUMBER, "bound_machine": TEXT,
    "measured_over_bound": NUMBER, "bound_measured_ms": NUMBER, "measured_over_measured_bound": NUMBER,
    "peak_allocated_bytes": INTS_OR_NULLS, "device_used_bytes": INTS_OR_NULLS,
    "exposed_comm_ms": NUMBER, "comm_ms": NUMBER, "overlap_ratio": NUMBER, "phases": OBJECTS,
    "parity": OBJECTS, "memory_phases": OBJECTS_OR_NULLS, "split": INTS, "calibration": TEXT,
    "slowest_rank": _int_at_least(0), "slowest_rank_ms": NUMBER, "compile_s": NUMBER,
    "graph_breaks": _int_at_least(0),
    # how the point ran
    "resolved_backends": TEXT_MAPPING, "error": TEXT,
    "kernel_options": SCALAR_MAPPING,  # option -> value, of the kernel-option registry
    "backends": TEXT_MAPPING,  # op.direction -> the implementation that ran
}
"""The type of every column (and of columns that may be added: a column without an entry here holds
any JSON value); checked on every read by :func:`check_record`."""

CONFIG_FIELDS: tuple[str, ...] = ("kernel_options", "backends", "fresh_batches")
"""Columns saying how a point's kernels ran, beyond its axes, and which batches its steps met
(``fresh_batches``, an axis left out of :func:`match_id`): two records are measurements of the same
thing only when these agree too (``dsv4cp compare``); a record without them is "unknown"."""

OK_TIMES: tuple[str, ...] = ("time_ms_p20", "time_ms_median", "time_ms_p80")
"""The times of an ``ok`` record: each finite and > 0 when given (None: not measured), in this order."""

OK_REQUIRED_AXES: tuple[str, ...] = ("preset", "ratio", "cp", "tokens", "pass")
"""Axes an ``ok`` record must give a value (what every table, plot and the model compute with); every
other axis must be present as a column (None allowed), except an added one (:data:`_ADDED_AXES`:
records from before it existed lack it)."""

META_TYPES: dict[str, FieldType] = {
    "schema": _int_at_least(1), "time_utc": TEXT, "git_sha": TEXT, "git_dirty": FLAG, "host": TEXT,
    "machine": TEXT, "gpu_name": TEXT, "gpu_count": _int_at_least(0), "driver": TEXT, "cuda": TEXT,
    "torch": TEXT, "triton": TEXT, "nccl": TEXT, "optional_backends": MAPPING, "spec": MAPPING,
    "kernel_options": SCALAR_MAPPING, "spec_hash": TEXT,
    "point_ids": FieldType("a list of strings", _list_of(lambda item: isinstance(item, str))),
}
"""The type of every ``meta.json`` field (a field without an entry holds any JSON value)."""

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


def _id_under_former_defaults(recorded: str, axes: dict) -> bool:
    """Whether ``recorded`` is the id of ``axes`` with its kernel options read as the version that wrote the
    record may have named them (:func:`dsv4cp.kernel_options.configurations`: an option at a former default
    was not set then). A record without a mapping of options has one reading only, today's."""
    options = axes.get("kernel_options")
    if not isinstance(options, dict):
        return False
    return any(point_id({**axes, "kernel_options": named or None}) == recorded
               for named in kernel_option_registry.configurations(options)[1:])


def point_id(axes: dict) -> str:
    """A stable 12-hex-digit id of a point: the sha1 of the sorted JSON of its :data:`AXES` values
    (no spaces), built as :data:`ID_AXES`' :func:`id_fragment` texts joined (:func:`id_of_fragments`).

    Keys outside :data:`AXES` are ignored; a missing axis counts as None (an axis of
    :data:`_ADDED_AXES` that is None or at its value from before it existed is left out).
    """
    return id_of_fragments("".join(id_fragment(name, axes.get(name)) for name in ID_AXES))


ID_AXES: tuple[str, ...] = tuple(sorted(AXES))
"""The axes in the order their values appear in the JSON a point id hashes (sorted keys)."""


def id_fragment(axis: str, value: object) -> str:
    """What ``axis`` at ``value`` adds to the JSON a point id hashes: ``,"<axis>":<value as JSON>``, or
    nothing for an axis of :data:`_ADDED_AXES` at None or at its value from before it existed. A caller
    naming many points (a sweep's dry run) keeps these per value and joins its own, in :data:`ID_AXES` order."""
    if axis == "kernel_options" and isinstance(value, dict):  # a configuration: what differs from the defaults
        value = kernel_option_registry.non_default(value) or None
    # ``is``, not ``==``: only the old value itself is left out, never a number equal to it (0 == False)
    if axis in _ADDED_AXES and (value is None or value is _ADDED_AXES[axis]):
        return ""
    return f",{json.dumps(axis)}:{json.dumps(value, sort_keys=True, separators=(',', ':'))}"


def id_of_fragments(fragments: str) -> str:
    """The point id of :func:`id_fragment` texts joined in :data:`ID_AXES` order: the first 12 hex digits
    of the sha1 of ``{...}`` around them (their leading comma dropped)."""
    return hashlib.sha1(f"{{{fragments[1:]}}}".encode()).hexdigest()[:12]


def match_id(record: dict) -> str:
    """The id of a record's point without its kernel options and fresh batches: what two runs' records are
    matched on (``dsv4cp compare``), so that points differing only in their configuration meet, and the
    configuration is then compared as part of their identity (:data:`CONFIG_FIELDS`)."""
    return point_id({**record, "kernel_options": None, "fresh_batches": None})


def resolved_options(record: dict) -> dict[str, str] | None:
    """Every kernel option's value as ``record``'s point ran (its ``kernel_options`` column), or None when
    the record holds no mapping of them (written before options were recorded): unknown. An option the
    mapping lacks (added to the registry after the record was written) is read as what ran before it
    existed where that is known (:data:`dsv4cp.kernel_options.BEFORE_IT_EXISTED`), else it stays absent:
    unknown, never read as today's default (:func:`option_differences` and :func:`configuration_key` keep
    such a record apart)."""
    options = record.get("kernel_options")
    if not isinstance(options, dict):
        return None
    return {**kernel_option_registry.BEFORE_IT_EXISTED, **options}


def resolved_configuration(record: dict) -> dict[str, object]:
    """:data:`CONFIG_FIELDS` -> how ``record``'s point ran: its kernel options resolved
    (:func:`resolved_options`: what ran before an option existed, where known), the other fields as stored
    (None: unknown). What :func:`configuration_key` hashes and :func:`configuration_differences` compares."""
    values = {name: _plain(record.get(name)) for name in CONFIG_FIELDS}
    values["kernel_options"] = resolved_options(record)
    return values


def configuration_key(record: dict) -> str:
    """The identity of how ``record``'s point ran: the first 12 hex digits of the sha1 of the sorted JSON of
    its :func:`resolved_configuration` (every resolved kernel option, the backends that ran, the fresh
    batches). Two records are measurements of the same kernels only when their :func:`point_id` (the axes,
    kept for history) and this key both agree; every consumer that pairs records (``sweep --resume``, the
    report's runs side by side, ``compare`` through :func:`configuration_differences`) keys on both. An
    option one record lacks is unknown there (unless :func:`resolved_options` knows what ran before it
    existed), so such a record never shares a key with one that holds it; two records holding no options at
    all (written before options were recorded) share one, as ``compare`` treats two unknown configurations
    as equal."""
    text = json.dumps(resolved_configuration(record), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def configuration_differences(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """KEY -> (``a``'s value, ``b``'s value) for every entry on which two records'
    :func:`resolved_configuration` differ, sorted: KEY is ``column.entry`` where both hold a mapping
    (``kernel_options.topk_impl``; an entry one side lacks is :data:`UNKNOWN` there), else the column, its
    value None where unknown (equal to another unknown). Empty exactly when the records'
    :func:`configuration_key` agree (up to numbers JSON writes differently: 1 and 1.0)."""
    ours, theirs = resolved_configuration(a), resolved_configuration(b)
    found: dict[str, tuple[object, object]] = {}
    for column in CONFIG_FIELDS:
        x, y = ours[column], theirs[column]
        if not (isinstance(x, dict) and isinstance(y, dict)):
            if x != y:
                found[column] = (x, y)
            continue
        for entry in sorted(set(x) | set(y)):
            if entry not in x or entry not in y or x[entry] != y[entry]:
                found[f"{column}.{entry}"] = (x.get(entry, UNKNOWN), y.get(entry, UNKNOWN))
    return found


def _plain(value: object) -> object:
    """A column's value as its record holds it, also when read back from a DataFrame row (a numpy scalar
    as its Python number, a missing value as None), so a record and its row share a key."""
    if hasattr(value, "item") and not isinstance(value, (dict, list, str)):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def option_differences(stored: dict[str, str] | None, current: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Option -> (value in ``stored``, value in ``current``) for every option on which a record's resolved
    options (:func:`resolved_options`; None: all unknown) and the ones a point runs now differ, sorted by
    name; ``"unknown"`` for an option one side lacks (an option missing from a record is not read as
    today's default). A record without options differs in one entry, ``kernel_options``: (unknown, recorded)."""
    if stored is None:
        return {"kernel_options": (UNKNOWN, "recorded")}
    names = sorted(set(stored) | set(current))
    return {name: (stored.get(name, UNKNOWN), current.get(name, UNKNOWN)) for name in names
            if stored.get(name, UNKNOWN) != current.get(name, UNKNOWN)}


UNKNOWN = "unknown"
"""How :func:`option_differences` names the value of an option one side does not hold."""


def check_status(status: str) -> str:
    """``status`` unchanged if valid, else ``ValueError`` naming it."""
    if not isinstance(status, str) or not (
        status in (STATUS_OK, STATUS_OOM) or (status.startswith(STATUS_PREFIXES) and "\n" not in status)
    ):
        raise ValueError(f"status: must be 'ok', 'oom', 'error: <msg>' or 'skipped: <why>' (one line), got {status!r}")
    return status


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


def _emulated(record: dict) -> bool:
    """Whether the record's time is compute only (an emulated rank, or every rank emulated in turn):
    its collectives moved nothing, so it holds no communication time."""
    return record.get("emulated_rank") is not None


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


def _added_axis_defaults(record: dict) -> dict:
    """The values other than None of :data:`_ADDED_AXES` that ``record`` lacks or holds as None."""
    return {name: value for name, value in _ADDED_AXES.items() if value is not None and record.get(name) is None}


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
