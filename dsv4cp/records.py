"""The measurement record shared by ``profile --out``, ``sweep``, ``report``, ``compare`` and the notebooks.

A run directory holds ``records.jsonl`` (one flat JSON object per measured point, columns
:data:`COLUMNS`) and ``meta.json`` (once per run: versions, hardware, the spec). This module is the
only place that defines the columns; it imports nothing but the standard library so every layer of
the package (and a notebook without torch) can use it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import warnings
from pathlib import Path

SCHEMA_VERSION: int = 1

AXES: tuple[str, ...] = (
    "preset", "ratio", "cp", "tokens", "tokens_per_rank", "packing", "loss", "overlap", "kernel_backend",
    "recompute", "pass", "dtype", "seed", "partition", "emulated_rank", "cuda_graph", "deterministic", "compile",
)
"""What was measured. ``pass``: ``fwd`` | ``fwd+bwd``; ``packing``: ``one`` | ``fixed:<len>`` |
``histogram`` | ``histogram-bestfit`` | ``adversarial`` | ``lengths:<a,b,...>``; ``partition``:
``equal`` | ``balanced`` (rank row ranges, :func:`dsv4cp.cp.partition.partition`); ``dtype``: a
``config.DTYPES`` key; ``kernel_backend``: what was asked (``auto``, ...); ``emulated_rank``: None for
a real run, else the one rank of the ``cp`` that a single process measured alone with its collectives
replaced by no-ops (:mod:`dsv4cp.cp.emulate`: compute and memory only, no communication; its per-rank
lists hold None at every other rank); ``cuda_graph``: whether the timed steps were replays of one
captured CUDA graph (no host overhead) rather than eager steps (memory and traces stay eager);
``deterministic``: whether the step ran under ``torch.use_deterministic_algorithms(True)`` with
deterministic kernel backends; ``compile``: the ``torch.compile`` backend of the layer, None when eager."""

_ADDED_AXES: dict[str, object] = {"emulated_rank": None, "cuda_graph": False, "deterministic": False, "compile": None}
"""Axes added after records were first committed -> what a record meant before the axis existed (a
real run; eager steps). An added axis at that value (or None) is left out of :func:`point_id`, so the
ids of earlier records (and of every real, eager run) do not change; :func:`make_record` and
:func:`read_records` fill a value other than None in where a record lacks it, so an old run and a new
one agree on it (a report would otherwise see ``None`` and ``False`` as two values of the axis)."""

METRICS: tuple[str, ...] = (
    "time_ms_median", "time_ms_p20", "time_ms_p80",  # max over ranks per repetition, then the statistic
    "rank_time_ms_median",  # list[float], one per rank (imbalance)
    "imbalance_max_over_mean",  # of the per-rank medians
    "tokens_per_s", "tflops_per_gpu", "mfu",  # mfu: against the machine's measured matmul ceiling
    "model_flops", "bound_ms", "measured_over_bound",
    "peak_allocated_bytes",  # list[int] per rank (host peak RSS on CPU)
    "device_used_bytes",  # list[int | None] per rank
    "exposed_comm_ms", "comm_ms", "overlap_ratio",  # totals of rank 0's overlap table; None unless profiled
    "phases",  # list[dict]: the per-phase overlap rows of every rank, per step; None unless profiled
    "parity",  # list[dict]: the CP = 1 parity check per quantity (check.Comparison); None unless checked
    "memory_phases",  # list[dict]: per rank and phase, allocated bytes at entry/exit and peak; None unless asked
    "split",  # list[int]: the ranks' row split points (0 = b_0 <= ... <= b_cp = tokens)
    "calibration",  # str: the calibration the balanced split was computed with; None: the model's bounds
    "compile_s",  # the first (compiling) step's wall time in s, apart from the timed steps; None when eager
    "graph_breaks",  # int: graph breaks Dynamo counted while compiling; None when eager
)
"""What was measured about it; a metric that was not measured is None."""

COLUMNS: tuple[str, ...] = (
    "schema", "point_id", "sweep", "status", "time_utc", "git_sha", "machine", *AXES, *METRICS,
    "resolved_backends", "error",
)

STATUS_OK = "ok"
STATUS_OOM = "oom"
STATUS_PREFIXES = ("error: ", "skipped: ")
"""A status is ``ok``, ``oom``, ``error: <one line>`` or ``skipped: <why>``."""

META_FIELDS: tuple[str, ...] = (
    "schema", "time_utc", "git_sha", "git_dirty", "host", "machine", "gpu_name", "gpu_count", "driver",
    "cuda", "torch", "triton", "nccl", "optional_backends", "spec",
)

RECORDS_FILE = "records.jsonl"
META_FILE = "meta.json"


def point_id(axes: dict) -> str:
    """A stable 12-hex-digit id of a point: the sha1 of the sorted JSON of its :data:`AXES` values.

    Keys outside :data:`AXES` are ignored; a missing axis counts as None (an axis of
    :data:`_ADDED_AXES` that is None or at its value from before it existed is left out).
    """
    values = {name: axes.get(name) for name in AXES}
    # ``is``, not ``==``: only the old value itself is left out, never a number equal to it (0 == False)
    values = {name: value for name, value in values.items()
              if name not in _ADDED_AXES or not (value is None or value is _ADDED_AXES[name])}
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(canonical.encode()).hexdigest()[:12]


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
) -> dict:
    """One record with every column of :data:`COLUMNS` (missing axes and metrics are None).

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
        "time_utc": time_utc or utc_now(), "git_sha": git_sha, "machine": machine,
    }
    record.update({name: axes.get(name) for name in AXES})
    record.update(_added_axis_defaults(record))
    record.update({name: metrics.get(name) for name in METRICS})
    record["resolved_backends"] = resolved_backends
    record["error"] = error
    return record


def utc_now() -> str:
    """The current time, ISO 8601 in UTC to the second (``2026-01-31T12:00:00Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line, atomically: one ``os.write`` of the whole line on an
    ``O_APPEND`` descriptor, then fsync, so a killed writer leaves at most a missing line, never
    half of one mixed into the next. Creates the parent directory."""
    missing = [name for name in COLUMNS if name not in record]
    if missing:
        raise ValueError(f"record: missing columns {missing}; build it with make_record")
    line = (json.dumps(record, allow_nan=True) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):  # a regular file takes the whole buffer; anything else is a disk error
            raise OSError(f"{path}: wrote {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: str | os.PathLike) -> list[dict]:
    """Every record of a ``.jsonl`` file (or of ``RUN_DIR/records.jsonl`` when given a directory).

    A trailing line without its newline (a writer killed mid-line) is skipped with a warning; any
    other unparsable line, or a record of another schema version, raises ``ValueError`` naming it.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS_FILE
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    if tail.strip():
        warnings.warn(f"{path}: skipping a partial last line ({len(tail)} characters): a writer was killed",
                      stacklevel=2)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON record ({err})") from None
        schema = record.get("schema") if isinstance(record, dict) else None
        if schema != SCHEMA_VERSION:
            raise ValueError(f"{path}:{number}: schema: expected {SCHEMA_VERSION}, got {schema!r}")
        record.update(_added_axis_defaults(record))
        records.append(record)
    return records


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


def write_meta(run_dir: str | os.PathLike, meta: dict) -> None:
    """Write ``RUN_DIR/meta.json`` (replaced atomically by a rename); fills ``schema``."""
    unknown = [name for name in meta if name not in META_FIELDS]
    if unknown:
        raise ValueError(f"meta: unknown fields {unknown}; allowed: {META_FIELDS}")
    full = {name: meta.get(name) for name in META_FIELDS}
    full["schema"] = SCHEMA_VERSION
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / f".{META_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(full, indent=2, default=str) + "\n")
    os.replace(temporary, run_dir / META_FILE)


def read_meta(run_dir: str | os.PathLike) -> dict:
    """``RUN_DIR/meta.json``; ``ValueError`` if missing or of another schema version."""
    path = Path(run_dir) / META_FILE
    if not path.exists():
        raise ValueError(f"run_dir: {run_dir} has no {META_FILE}")
    meta = json.loads(path.read_text())
    if meta.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema: expected {SCHEMA_VERSION}, got {meta.get('schema')!r}")
    return meta
