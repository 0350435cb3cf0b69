"""Sweep specs: a YAML file -> a validated, frozen :class:`SweepSpec` -> ``expand(spec) -> list[Point]``.

This module loads and validates a spec (:func:`load_spec`, :func:`parse_spec`); the rest lives beside it, one
concern a module, and its public names are importable from here: the axes' value checks
(:mod:`.axis_values`), the parsed spec (:mod:`.parsed_spec`), a point, its id and its label (:mod:`.point`),
points made from axis values (:mod:`.rows`), the expansion (:mod:`.expansion`) and the shape checks
(:mod:`.validity`).

A spec names the axes of :data:`dsv4cp.records.AXES`:

.. code-block:: yaml

    name: smoke
    run: {warmup: 1, reps: 3}          # timing options shared by every point
    base: {preset: tiny, dtype: fp32}  # fixed axis values
    axes:                              # varied: their Cartesian product, in the order written
      cp: [1, 2]
      ratio: [0, 4, 8]
      tokens: [256, 512]
      packing: [one, histogram]
    zip: [[tokens, packing]]           # optional: these axes vary together (equal-length lists)
    exclude:                           # optional: drop points matching every key of a rule
      - {cp: 1, packing: adversarial}
    targets:                           # optional: what the run must reach (dsv4cp.targets), judged by the report
      - {metric: scaling_efficiency, pair: {cp: [2, 1]}, comparison: ">=", value: 0.5}

``kernel_options`` (in ``base``, or an axis whose values are mappings) sets kernel options
(:mod:`dsv4cp.kernel_options`, e.g. ``{topk_impl: stream}``) in force while the point is measured.

Every name and value is checked when the spec is loaded, before anything is launched: an unknown
key, axis or value (or a key given twice) raises ``ValueError`` naming it and what is allowed.
Whether each point's shapes work (tokens divisible by cp, enough rows per rank for the halo, a ratio
the preset can build, documents that fit the tokens, a named kernel backend that runs the preset's head
dim) is checked as it is expanded:
:func:`point_problem` says why a point cannot run, ``--dry-run`` marks such points and a sweep refuses
to start while any is left (exclude them). Expansion is lazy (:func:`iter_points`, one point at a
time), so listing a spec of a million points holds one point in memory. Whether a point can be timed
as CUDA-graph replays (``cuda_graph: [false, true]``: a CUDA device, CP = 1) depends on the device it
runs on; such a point is recorded with an ``error`` status and the sweep goes on.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from dsv4cp.records import AXES
from dsv4cp.sweeps.axis_values import MEASURED, PARTITIONS, PASSES, check_axis_value
from dsv4cp.sweeps.expansion import (
    block_axes,
    expand,
    iter_points,
    iter_row_blocks,
    iter_rows,
    with_kernel_options,
)
from dsv4cp.sweeps.parsed_spec import RunOptions, SweepSpec
from dsv4cp.sweeps.point import ALL_RANKS, LABEL_PARTS, ROW_INDEX, Point, row_label
from dsv4cp.sweeps.rows import make_point, row_axes
from dsv4cp.sweeps.strict_yaml import AliasExpansionError, DuplicateKeyError, load_strict
from dsv4cp.sweeps.validity import (
    PACKING_AXES,
    SHAPE_AXES,
    cannot_run_message,
    check_points_can_run,
    packing_problem,
    point_inputs,
    point_problem,
    row_problem,
    shape_problem,
)
from dsv4cp.targets import parse_targets

__all__ = [  # the spec's public names: its own, and those of the modules it is made of
    "ALL_RANKS", "LABEL_PARTS", "MEASURED", "PACKING_AXES", "PARTITIONS", "PASSES", "ROW_INDEX", "SHAPE_AXES",
    "SPEC_KEYS", "Point", "RunOptions", "SweepSpec", "block_axes", "cannot_run_message", "check_axis_value",
    "check_points_can_run", "check_run_name", "expand", "iter_points", "iter_row_blocks", "iter_rows",
    "load_spec", "make_point", "packing_problem", "parse_spec", "point_inputs",
    "point_problem", "row_axes", "row_label", "row_problem", "shape_problem", "with_kernel_options",
]

SPEC_KEYS: dict[str, str] = {
    "name": "the run's name: its folder under runs/ (no '/', '\\\\' or '..'; default: the file's stem)",
    "description": "free text",
    "run": "timing options shared by every point (warmup, reps, l2_flush, trace_steps, nsys_steps)",
    "base": "fixed axis values",
    "axes": "varied axes: their Cartesian product, in the order written",
    "zip": "groups of varied axes that vary together (lists of equal length)",
    "exclude": "rules: a point matching every key of one is dropped",
    "targets": "what the run must reach (dsv4cp.targets: metric, points, comparison, value), judged by the report",
}
"""The top-level keys a spec may hold (a new key: an entry here, then its parsing in :func:`parse_spec`)."""


# ------------------------------------------------------------------------------------- loading
def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML spec file (a key given twice in one mapping, or aliases expanding it
    beyond :data:`~dsv4cp.sweeps.strict_yaml.MAX_ALIASED_VALUES` values, is an error)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"spec: {path} is not a file")
    try:
        data = load_strict(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"spec: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (DuplicateKeyError, AliasExpansionError) as err:  # valid YAML, refused for a spec
        raise ValueError(f"spec: {path}: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"spec: {path} is not valid YAML ({err})") from None
    return parse_spec(data, default_name=path.stem)


def parse_spec(data: Any, default_name: str | None = None) -> SweepSpec:
    """Validate a spec given as a dict (the YAML's content) and freeze it; its points are checked as
    they are expanded (:func:`iter_points`, :func:`point_problem`)."""
    if not isinstance(data, dict):
        raise ValueError(f"spec: must be a mapping of {list(SPEC_KEYS)}, got {type(data).__name__}")
    unknown = [key for key in data if key not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"spec: unknown key {unknown[0]!r}; allowed: {list(SPEC_KEYS)}")
    name = data.get("name", default_name)
    check_run_name(name)
    run = data.get("run") or {}
    if not isinstance(run, dict):
        raise ValueError(f"run: must be a mapping of options, got {run!r}")
    allowed_run = [f.name for f in fields(RunOptions)]
    for key in run:
        if key not in allowed_run:
            raise ValueError(f"run: unknown option {key!r}; allowed: {allowed_run}")
    base = _axis_mapping("base", data.get("base") or {})
    for axis, value in base.items():
        check_axis_value(axis, value, f"base.{axis}")
    axes = _axis_mapping("axes", data.get("axes") or {})
    frozen_axes: dict[str, tuple] = {}
    for axis, values in axes.items():
        if axis in base:
            raise ValueError(f"axes.{axis}: also set in base; give an axis in one place")
        if not isinstance(values, list) or not values:
            raise ValueError(f"axes.{axis}: must be a non-empty list of values, got {values!r}")
        for i, value in enumerate(values):
            check_axis_value(axis, value, f"axes.{axis}[{i}]")
        frozen_axes[axis] = tuple(values)
    given = {axis for axis in ("tokens", "tokens_per_rank") if axis in base or axis in frozen_axes}
    if len(given) != 1:  # every point takes its tokens from the same place: checked once, here
        raise ValueError(f"tokens: give exactly one of tokens and tokens_per_rank (in base or axes), got "
                         f"{sorted(given) or 'neither'}")
    zipped = _zip_groups(data.get("zip") or [], frozen_axes)
    exclude = []
    for i, rule in enumerate(data.get("exclude") or []):
        rule = _axis_mapping(f"exclude[{i}]", rule)
        if not rule:
            raise ValueError(f"exclude[{i}]: an empty rule would exclude every point")
        for axis, value in rule.items():
            check_axis_value(axis, value, f"exclude[{i}].{axis}")
        exclude.append(dict(rule))
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"description: must be a string, got {description!r}")
    targets = parse_targets(data.get("targets"), check_axis_value)
    return SweepSpec(name=name, description=description, run=RunOptions(**run), base=dict(base), axes=frozen_axes,
                     zip=zipped, exclude=tuple(exclude), targets=targets, source=data)


def check_run_name(name: Any) -> None:
    """``ValueError`` naming ``name`` unless it names one folder inside the runs directory."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    if name in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")):
        raise ValueError(f"name: must name one folder inside runs/ (no '/', '\\', '..' or absolute path), "
                         f"got {name!r}")


def _axis_mapping(where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a mapping of axis -> value, got {value!r}")
    for axis in value:
        if axis not in AXES:
            raise ValueError(f"{where}: unknown axis {axis!r}; allowed: {list(AXES)}")
    return value


def _zip_groups(groups: Any, axes: dict[str, tuple]) -> tuple[tuple[str, ...], ...]:
    if not isinstance(groups, list):
        raise ValueError(f"zip: must be a list of lists of axis names, got {groups!r}")
    seen: set[str] = set()
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, list) or len(group) < 2:
            raise ValueError(f"zip[{i}]: must list at least two axis names, got {group!r}")
        for axis in group:
            if axis not in axes:
                raise ValueError(f"zip[{i}]: {axis!r} is not one of the varied axes {list(axes)}")
            if axis in seen:
                raise ValueError(f"zip[{i}]: axis {axis!r} is already in another zip group")
            seen.add(axis)
        lengths = {axis: len(axes[axis]) for axis in group}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"zip[{i}]: zipped axes need lists of equal length, got {lengths}")
        out.append(tuple(group))
    return tuple(out)
