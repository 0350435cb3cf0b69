"""The two sides of ``dsv4cp compare``: a run (directory or ``.jsonl`` of records) or a pytest-benchmark
JSON file -> one row per point with its value, band, repetition times, kernel configuration, and what
is wrong with it.

A run's points are keyed by their id without the kernel options (:func:`dsv4cp.records.match_id`: every
other axis; the options are compared as the point's configuration), a benchmark's by its ``fullname``. Nothing is
dropped silently: a record line that is not valid is kept as an ``invalid`` point when it names its
point (so a broken value of a compared point is an error, not a missing point) and otherwise listed in
``Side.skipped``; several records of one point are listed in ``Side.duplicates`` (a retry after
an error keeps its ``ok`` record; two ``ok`` records make the point ``invalid``: which one is the
measurement is unknown).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dsv4cp.records import (
    AXES,
    COLUMN_TYPES,
    CONFIG_FIELDS,
    METRICS,
    NUMBER,
    STATUS_OK,
    RecordProblem,
    check_times,
    match_id,
)
from dsv4cp.report.load import load_runs

STATUS_INVALID = "invalid"
"""The status of a point whose record (or benchmark entry) holds a value that cannot be a measurement."""


class UnusableInputError(ValueError):
    """The inputs cannot be compared (no matched point, other hardware, missing metric)."""


TIME_BANDS: dict[str, tuple[str, str]] = {"time_ms_median": ("time_ms_p20", "time_ms_p80")}
"""Metrics whose records carry their own noise band."""

INVERSE_OF_TIME: tuple[str, ...] = ("tokens_per_s", "tflops_per_gpu", "mfu")
"""Rates proportional to 1 / time: their band is the time band inverted, their samples the times."""

TIME_QUANTILES: tuple[str, ...] = ("time_ms_p20", "time_ms_p80")
"""Quantiles of the repetition times: no band of their own, judged on the times (a rank test)."""

EXACT_METRICS: tuple[str, ...] = ("model_flops", "bound_ms")
"""Computed by the cost model, not measured: any change beyond the threshold is real."""

HIGHER_IS_BETTER: frozenset[str] = frozenset({*INVERSE_OF_TIME, "overlap_ratio"})

UNITS: dict[str, str] = {"tokens_per_s": "tokens/s", "tflops_per_gpu": "TFLOP/s", "mfu": "fraction",
                         "model_flops": "FLOP", "overlap_ratio": "fraction", "measured_over_bound": "x",
                         "imbalance_max_over_mean": "x"}

BENCH_METRICS: dict[str, str] = {"time_ms_median": "median", "time_ms_mean": "mean", "time_ms_min": "min"}
"""Metrics of a pytest-benchmark JSON, by the ``stats`` field they read (seconds there, ms here)."""

SCALAR_METRICS: tuple[str, ...] = tuple(m for m in METRICS if COLUMN_TYPES.get(m) is NUMBER)

POINT_COLUMNS: tuple[str, ...] = ("name", "status", "value", "low", "high", "samples", "config", "problem")
"""Columns of ``Side.points``: ``samples`` the repetitions' times in ms (None without them), ``config``
the kernel configuration (``records.CONFIG_FIELDS`` -> value, None: unknown), ``problem`` why the
point is ``invalid`` (None otherwise)."""


def unit_of(metric: str) -> str:
    if metric.endswith("_ms") or metric.startswith("time_ms"):
        return "ms"
    return UNITS.get(metric, "")


@dataclass(frozen=True)
class Side:
    """One side's points: index ``key``, columns :data:`POINT_COLUMNS`."""

    source: str
    kind: str
    """``"run"`` or ``"pytest-benchmark"``."""
    hardware: str
    points: pd.DataFrame
    band: str
    """How the noise band was obtained, for the printed table."""
    skipped: list[str] = field(default_factory=list)
    """``file:line: reason`` of each line that is no record of any point."""
    duplicates: list[str] = field(default_factory=list)
    """One line per point measured more than once in this side."""


def _axes_name(values: dict) -> str:
    """A stable, complete point name (every axis with a value), for the JSON output and messages; the
    values may be anything JSON holds (an invalid record's)."""
    def shown(value: object) -> bool:
        return value is not None and not (isinstance(value, float) and math.isnan(value))
    return " ".join(f"{a}={values.get(a)}" for a in AXES if shown(values.get(a)))


def _finite_or_nan(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _run_point(record: dict, metric: str) -> dict:
    """A valid record -> its point row (``invalid`` when the compared metric holds a broken value)."""
    value = _finite_or_nan(record.get(metric))
    median, p20, p80 = (_finite_or_nan(record.get(name)) for name in ("time_ms_median", "time_ms_p20", "time_ms_p80"))
    samples = None
    if metric in TIME_BANDS:
        low, high = p20, p80
    elif metric in INVERSE_OF_TIME:  # rate = k / time: the time band maps onto the rate
        low, high = value * median / p80, value * median / p20
    else:
        low, high = value, value
    if metric in TIME_BANDS or metric in INVERSE_OF_TIME or metric in TIME_QUANTILES:
        samples = record.get("time_ms_samples")
    problem = None
    blanked = record.get("invalid") or {}  # the loader blanks a value no measurement can hold, naming why
    if record["status"] == STATUS_OK and metric in blanked:
        problem = f"{metric}: {blanked[metric]}"
    elif record["status"] == STATUS_OK and record.get(metric) is not None:
        positive = metric in TIME_BANDS or metric in INVERSE_OF_TIME
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            problem = f"{metric}: must be a finite number {'> 0' if positive else '>= 0'}, got {record[metric]!r}"
    return {"name": _axes_name(record), "status": STATUS_INVALID if problem else record["status"],
            "value": value, "low": low if math.isfinite(low) else value, "high": high if math.isfinite(high) else value,
            "samples": tuple(samples) if samples else None,
            "config": {name: record.get(name) for name in CONFIG_FIELDS}, "problem": problem}


def _invalid_point(problem: RecordProblem) -> dict:
    record = problem.record or {}
    return {"name": _axes_name(record) or f"point_id={problem.point_id}", "status": STATUS_INVALID,
            "value": math.nan, "low": math.nan, "high": math.nan, "samples": None,
            "config": {name: record.get(name) for name in CONFIG_FIELDS}, "problem": str(problem)}


def _one_per_key(entries: list[tuple[str, dict]]) -> tuple[pd.DataFrame, list[str]]:
    """One row per key from rows in file order: an invalid one wins, then the only ``ok`` one, else the
    last; two ``ok`` rows make the point invalid. Returns the rows and one line per repeated key."""
    grouped: dict[str, list[dict]] = {}
    for key, row in entries:
        grouped.setdefault(key, []).append(row)
    rows, duplicates = {}, []
    for key, group in grouped.items():
        invalid = [row for row in group if row["status"] == STATUS_INVALID]
        ok = [row for row in group if row["status"] == STATUS_OK]
        if len(group) > 1:
            duplicates.append(f"{group[-1]['name']}: {len(group)} records of one point in one run "
                              f"(statuses {', '.join(str(row['status']) for row in group)})")
        if invalid:
            rows[key] = invalid[0]
        elif len(ok) > 1:
            rows[key] = {**ok[-1], "status": STATUS_INVALID, "value": math.nan,
                         "problem": f"{len(ok)} ok records of this point in one run: which one is the measurement?"}
        else:
            rows[key] = ok[0] if ok else group[-1]
    frame = pd.DataFrame(list(rows.values()), columns=list(POINT_COLUMNS), index=pd.Index(list(rows), name="key"))
    return frame, duplicates


def _problem_key(problem: RecordProblem) -> str:
    """An invalid line's matching key: its point's :func:`match_id` when its axes can be read, else its id."""
    record = problem.record
    try:
        return match_id(record) if isinstance(record, dict) else problem.point_id
    except (TypeError, ValueError):  # axes of any JSON type: one a registry cannot read keeps the stored id
        return problem.point_id


def _run_side(path: Path, metric: str) -> Side:
    if metric not in SCALAR_METRICS:
        raise UnusableInputError(f"--metric: {metric!r} is not a scalar record metric; choose one of {SCALAR_METRICS}")
    problems: list[RecordProblem] = []
    df = load_runs([path], problems)
    records = df.astype(object).where(df.notna(), None).to_dict(orient="records")
    entries = [(match_id(record), _run_point(record, metric)) for record in records]
    entries += [(_problem_key(problem), _invalid_point(problem)) for problem in problems if problem.point_id]
    points, duplicates = _one_per_key(entries)
    if metric in TIME_BANDS:
        band = "p20..p80 of the record"
    elif metric in INVERSE_OF_TIME:
        band = "p20..p80 of the time, as a rate"
    else:
        band = "none (the metric has no spread)"
    machines = sorted({str(m) for m in df["machine"] if m is not None}) or ["unknown"]
    skipped = [str(problem) for problem in problems if not problem.point_id]
    return Side(str(path), "run", ", ".join(machines), points, band, skipped, duplicates)


def _bench_point(bench: dict, metric: str) -> tuple[dict, bool]:
    """One benchmark -> its point row, and whether its value came from the bench harness's own timer."""
    extra = bench.get("extra_info") or {}
    own_timer = metric == "time_ms_median" and {"median_ms", "p20_ms", "p80_ms"} <= set(extra)
    if own_timer:
        value, low, high, samples = extra["median_ms"], extra["p20_ms"], extra["p80_ms"], extra.get("times_ms")
    else:
        stats = bench["stats"]
        value = stats[BENCH_METRICS[metric]] * 1e3
        low, high = (stats["q1"] * 1e3, stats["q3"] * 1e3) if metric == "time_ms_median" else \
            (stats["min"] * 1e3, stats["max"] * 1e3)  # a mean or min need not lie between the quartiles
        data = stats.get("data")
        samples = [t * 1e3 for t in data] if isinstance(data, list) and data else None
    samples = samples if isinstance(samples, list) and samples else None
    problem = check_times(value, low, high, samples, names=("band low", metric, "band high", "samples"))
    name = bench["fullname"]
    if not isinstance(name, str):
        raise TypeError(f"fullname must be a string, got {name!r}")
    row = {"name": name, "status": STATUS_INVALID if problem else STATUS_OK,
           "value": math.nan if problem else float(value), "low": math.nan if problem else float(low),
           "high": math.nan if problem else float(high), "samples": None if problem or not samples else tuple(samples),
           "config": {option: extra.get(option) for option in CONFIG_FIELDS}, "problem": problem}
    return row, own_timer


def _bench_side(path: Path, metric: str) -> Side:
    if metric not in BENCH_METRICS:
        raise UnusableInputError(f"--metric: {metric!r} is not available in pytest-benchmark JSON {path}; "
                                 f"choose one of {tuple(BENCH_METRICS)}")
    entries, own_timer = [], 0
    try:
        data = json.loads(path.read_bytes())
        benchmarks = data["benchmarks"]
        for bench in benchmarks:
            row, own = _bench_point(bench, metric)
            entries.append((row["name"], row))
            own_timer += own
        devices = sorted({str((b.get("extra_info") or {}).get("device")) for b in benchmarks
                          if (b.get("extra_info") or {}).get("device")})
        cpu = str((data.get("machine_info") or {}).get("cpu", {}).get("brand_raw", "unknown cpu"))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as err:
        raise UnusableInputError(f"path: {path} is not a pytest-benchmark JSON file "
                                 f"({type(err).__name__}: {err})") from None
    if own_timer == len(entries):
        band = "p20..p80 of the bench harness's timer (extra_info)"
    elif own_timer == 0:
        band = "q1..q3 of pytest-benchmark's stats" if metric == "time_ms_median" else "min..max of its stats"
    else:
        band = "p20..p80 (extra_info) where stored, else q1..q3 (stats)"
    points, duplicates = _one_per_key(entries)
    return Side(str(path), "pytest-benchmark", ", ".join(devices) if devices else cpu, points, band, [], duplicates)


def load_side(path: str | Path, metric: str) -> Side:
    """One side from a run directory, a ``.jsonl`` of records, or a pytest-benchmark ``.json``."""
    path = Path(path)
    if not path.exists():
        raise UnusableInputError(f"path: {path} does not exist")
    try:
        return _bench_side(path, metric) if path.is_file() and path.suffix == ".json" else _run_side(path, metric)
    except UnusableInputError:
        raise
    except ValueError as err:  # the loader's own message names the path and the problem
        raise UnusableInputError(str(err)) from None
