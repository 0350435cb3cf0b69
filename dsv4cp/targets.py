"""Targets a sweep spec declares (its ``targets:`` list): what a run must reach, checked at load.

One target names a metric, the points it applies to and a limit:

.. code-block:: yaml

    targets:
      - name: CP = 2 time / CP = 1 time   # optional; default: the metric's name
        metric: time_ratio               # see METRICS
        where: {ratio: 4}                # optional axis filters: a value or a list of values per axis
        pair: {cp: [2, 1]}               # pair metrics only: numerator and denominator value of one axis
        comparison: "<="                 # see COMPARISONS
        value: 0.52

A point metric is judged on every measured point the filters keep; a pair metric on every such point
whose ``pair`` axis holds the numerator value, against the point that differs from it only in that axis
(with ``cp`` paired, ``tokens_per_rank`` differs too: the total ``tokens`` stay, as in strong scaling).
The report evaluates them (``dsv4cp.report.targets``); this module only defines and validates them, so
the spec loader rejects an unknown metric, axis or comparison before anything runs. Standard library only.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4cp.records import AXES

POINT_METRICS: dict[str, str] = {
    "time_ms": "median step time in ms (max over ranks per repetition)",
    "measured_over_bound": "median step time / the cost model's lower bound at the hardware's physical limits",
    "measured_over_measured_bound": "median step time / the cost model's lower bound at the measured ceilings",
    "exposed_comm_fraction": "exposed communication / communication time of rank 0 (profiled points)",
    "imbalance": "max / mean of the per-rank median step times",
    "peak_gib": "peak memory per rank in GiB, max over ranks",
    "tflops_per_gpu": "model TFLOP/s per GPU",
    "mfu": "model FLOP/s utilisation of the machine's matmul ceiling (GPU points)",
    "parity_failures": "quantities that differ from CP = 1 beyond tolerance (points run with --check)",
    "parity_max_rel_error": "largest relative error against CP = 1 over the checked quantities",
}
"""Metrics of one point -> what they are."""

PAIR_METRICS: dict[str, str] = {
    "time_ratio": "median step time of the numerator point / that of the denominator point",
    "memory_ratio": "peak memory (max over ranks) of the numerator point / that of the denominator point",
    "scaling_efficiency": "T(den) cp(den) / (T(num) cp(num)): 1 is perfect strong scaling (pair on cp)",
}
"""Metrics of a pair of points differing in one axis -> what they are."""

METRICS: tuple[str, ...] = (*POINT_METRICS, *PAIR_METRICS)

COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq,
}
"""How a measured value must compare with the target's value to meet it."""

TARGET_KEYS = ("name", "metric", "where", "pair", "comparison", "value")


@dataclass(frozen=True, kw_only=True)
class Target:
    """One declared target (see the module docstring)."""

    name: str
    metric: str
    comparison: str
    value: float
    where: Mapping[str, tuple] = field(default_factory=dict)
    """Axis -> the values a point may hold (a scalar in the YAML is a list of one)."""
    pair: tuple[str, Any, Any] | None = None
    """``(axis, numerator value, denominator value)`` of a pair metric; None for a point metric."""

    def met(self, measured: float) -> bool:
        return COMPARISONS[self.comparison](measured, self.value)

    def applies_to(self, axes: Mapping[str, Any]) -> bool:
        """Whether a point with these axis values passes the ``where`` filters (an axis left empty, None or,
        in a table's column, NaN, matches a filter's ``null``)."""
        return all(_unset_as_none(axes.get(axis)) in values for axis, values in self.where.items())

    def describe(self) -> str:
        """``time_ratio (cp 2 / cp 1) <= 0.52 where ratio=4``."""
        pair = f" ({self.pair[0]} {self.pair[1]} / {self.pair[0]} {self.pair[2]})" if self.pair else ""
        where = ", ".join(f"{a}={'|'.join(map(str, v))}" for a, v in self.where.items())
        return f"{self.metric}{pair} {self.comparison} {self.value:g}" + (f" where {where}" if where else "")


def parse_targets(data: Any, check_value: Callable[[str, Any, str], None] | None = None) -> tuple[Target, ...]:
    """Validate a spec's ``targets`` list and freeze it; ``ValueError`` naming the entry and the field.

    ``check_value(axis, value, where)``: the sweep loader's check of an axis value (unknown values
    raise); without it only axis names are checked.
    """
    if data is None:
        return ()
    if not isinstance(data, list):
        raise ValueError(f"targets: must be a list of targets, got {data!r}")
    out: list[Target] = []
    for i, entry in enumerate(data):
        where_ = f"targets[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where_}: must be a mapping of {list(TARGET_KEYS)}, got {entry!r}")
        unknown = [key for key in entry if key not in TARGET_KEYS]
        if unknown:
            raise ValueError(f"{where_}: unknown key {unknown[0]!r}; allowed: {list(TARGET_KEYS)}")
        metric = entry.get("metric")
        if metric not in METRICS:
            raise ValueError(f"{where_}.metric: unknown metric {metric!r}; allowed: {list(METRICS)}")
        comparison = entry.get("comparison")
        if comparison not in COMPARISONS:
            raise ValueError(f"{where_}.comparison: unknown comparison {comparison!r}; allowed: {list(COMPARISONS)}")
        value = entry.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where_}.value: must be a finite number, got {value!r}")
        name = entry.get("name", metric)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where_}.name: must be a non-empty string, got {name!r}")
        where = _filters(entry.get("where") or {}, f"{where_}.where", check_value)
        pair = _pair(entry.get("pair"), metric, f"{where_}.pair", check_value)
        out.append(Target(name=name, metric=metric, comparison=comparison, value=float(value), where=where,
                          pair=pair))
    names = [t.name for t in out]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"targets: two targets are named {duplicate!r}; give each its own name")
    return tuple(out)


def _unset_as_none(value: Any) -> Any:
    """None for a missing axis value as pandas holds it (NaN in a column of None / strings), else ``value``."""
    return None if isinstance(value, float) and math.isnan(value) else value


def _axis(axis: Any, where: str) -> str:
    if axis not in AXES:
        raise ValueError(f"{where}: unknown axis {axis!r}; allowed: {list(AXES)}")
    return axis


def _filters(data: Any, where: str, check_value) -> dict[str, tuple]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping of axis -> value or list of values, got {data!r}")
    out = {}
    for axis, values in data.items():
        _axis(axis, where)
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ValueError(f"{where}.{axis}: an empty list keeps no point")
        for j, value in enumerate(values):
            if check_value is not None:
                check_value(axis, value, f"{where}.{axis}[{j}]")
        out[axis] = tuple(values)
    return out


def _pair(data: Any, metric: str, where: str, check_value) -> tuple[str, Any, Any] | None:
    if metric in POINT_METRICS:
        if data is not None:
            raise ValueError(f"{where}: {metric!r} is a metric of one point; pair is for {list(PAIR_METRICS)}")
        return None
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"{where}: {metric!r} needs one axis -> [numerator, denominator], e.g. {{cp: [2, 1]}}, "
                         f"got {data!r}")
    (axis, values), = data.items()
    _axis(axis, where)
    if not isinstance(values, list) or len(values) != 2 or values[0] == values[1]:
        raise ValueError(f"{where}.{axis}: must be [numerator, denominator], two different values, got {values!r}")
    for j, value in enumerate(values):
        if check_value is not None:
            check_value(axis, value, f"{where}.{axis}[{j}]")
    if metric == "scaling_efficiency" and axis != "cp":
        raise ValueError(f"{where}: scaling_efficiency pairs points on cp, got {axis!r}")
    return axis, values[0], values[1]
