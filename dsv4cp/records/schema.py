"""The columns of a record and the fields of ``meta.json``: their names, what they mean, their types, and
what a record written before a column existed meant by its absence."""

from __future__ import annotations

from dsv4cp.records.field_types import (
    FLAG,
    INTS,
    INTS_OR_NULLS,
    MAPPING,
    NUMBER,
    NUMBERS,
    NUMBERS_OR_NULLS,
    OBJECTS,
    OBJECTS_OR_NULLS,
    SCALAR_MAPPING,
    TEXT,
    TEXT_MAPPING,
    FieldType,
    _int_at_least,
    _is_int,
    _list_of,
)

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


def _emulated(record: dict) -> bool:
    """Whether the record's time is compute only (an emulated rank, or every rank emulated in turn):
    its collectives moved nothing, so it holds no communication time."""
    return record.get("emulated_rank") is not None


def _added_axis_defaults(record: dict) -> dict:
    """The values other than None of :data:`_ADDED_AXES` that ``record`` lacks or holds as None."""
    return {name: value for name, value in _ADDED_AXES.items() if value is not None and record.get(name) is None}
