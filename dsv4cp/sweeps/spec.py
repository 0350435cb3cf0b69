"""Sweep specs: a YAML file -> a validated, frozen :class:`SweepSpec` -> ``expand(spec) -> list[Point]``.

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

Every name and value is checked when the spec is loaded, before anything is launched: an unknown
axis or value raises ``ValueError`` naming it and what is allowed. Whether a point's shapes work
(tokens divisible by cp, enough rows per rank for the halo), or whether it can be timed as CUDA-graph
replays (``cuda_graph: [false, true]``: a CUDA device, CP = 1), is only known when it runs; such a
point is recorded with an ``error`` status and the sweep goes on.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from dsv4cp.config import DTYPES, LOSS_VARIANTS, PRESET_NAMES, DSv4Config
from dsv4cp.cp.comm import OVERLAP_MODES
from dsv4cp.cp.partition import POLICIES
from dsv4cp.ops.sparse_attention import check_backend_name
from dsv4cp.profiling.compilation import COMPILE_BACKENDS
from dsv4cp.records import AXES, point_id
from dsv4cp.workloads import parse_packing

PASSES = ("fwd", "fwd+bwd")
PARTITIONS = POLICIES
SPEC_KEYS = ("name", "description", "run", "base", "axes", "zip", "exclude")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How every point of a sweep is measured."""

    warmup: int = 3
    """Untimed steps before timing."""
    reps: int = 10
    """Timed steps (median, p20, p80)."""
    l2_flush: bool = False
    """Zero a 256 MiB buffer before each timed step (GPU)."""
    trace_steps: int = 2
    """Steps recorded in the Kineto trace of a profiled point."""
    nsys_steps: int = 2
    """Steps run inside the nsys capture range when asked for."""

    def __post_init__(self) -> None:
        for name, low in (("warmup", 0), ("reps", 1), ("trace_steps", 1), ("nsys_steps", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"run.{name}: must be an int >= {low}, got {value!r}")
        if not isinstance(self.l2_flush, bool):
            raise ValueError(f"run.l2_flush: must be true or false, got {self.l2_flush!r}")


@dataclass(frozen=True, kw_only=True)
class Point:
    """One measurement: a value for every axis. ``tokens`` is the whole batch over ``cp`` ranks;
    ``tokens_per_rank`` is ``tokens // cp`` (None when ``cp`` does not divide it)."""

    preset: str = "tiny"
    ratio: int = 4
    cp: int = 1
    tokens: int
    tokens_per_rank: int | None = None
    packing: str = "one"
    loss: str = "sparse"
    overlap: str = "async"
    kernel_backend: str = "auto"
    recompute: bool = False
    direction: str = "fwd+bwd"
    """The ``pass`` axis (a Python keyword): ``fwd`` or ``fwd+bwd``."""
    dtype: str = "fp32"
    seed: int = 0
    partition: str = "equal"
    emulated_rank: int | None = None
    """The one rank a single process measures alone (``dsv4cp profile --emulate-rank``); None: real ranks."""
    cuda_graph: bool = False
    """Time the step as replays of one captured CUDA graph (no host overhead; CUDA, CP = 1 only:
    :func:`dsv4cp.sweeps.measure.check_cuda_graph`); peak memory and traces stay eager steps."""
    deterministic: bool = False
    """Run under ``torch.use_deterministic_algorithms(True)``; "auto" then picks deterministic backends only."""
    compile: str | None = None
    """The layer's ``torch.compile`` backend (:data:`dsv4cp.profiling.compilation.COMPILE_BACKENDS`); None: eager."""

    @property
    def backward(self) -> bool:
        return self.direction == "fwd+bwd"

    def axes(self) -> dict[str, Any]:
        """The point as record axes (``direction`` under its axis name ``pass``)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["pass"] = values.pop("direction")
        return {name: values[name] for name in AXES}

    @property
    def point_id(self) -> str:
        return point_id(self.axes())

    def label(self) -> str:
        """A short human-readable name for progress bars and logs."""
        tokens = f"{self.tokens // 1024}K" if self.tokens % 1024 == 0 else str(self.tokens)
        return (f"{self.preset} r{self.ratio} cp{self.cp} {tokens} {self.packing} {self.direction} {self.dtype} "
                f"{self.overlap}{' recompute' if self.recompute else ''} {self.kernel_backend}"
                f"{'' if self.partition == 'equal' else ' ' + self.partition}"
                f"{'' if self.emulated_rank is None else f' emulated rank {self.emulated_rank}'}"
                f"{' cuda-graph' if self.cuda_graph else ''}{' deterministic' if self.deterministic else ''}"
                f"{'' if self.compile is None else ' compile ' + self.compile}")


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """A parsed, validated sweep spec (see the module docstring for the YAML form)."""

    name: str
    description: str = ""
    run: RunOptions = field(default_factory=RunOptions)
    base: Mapping[str, Any] = field(default_factory=dict)
    axes: Mapping[str, tuple] = field(default_factory=dict)
    zip: tuple[tuple[str, ...], ...] = ()
    exclude: tuple[Mapping[str, Any], ...] = ()
    source: dict = field(default_factory=dict, compare=False)
    """The spec as loaded (recorded in meta.json)."""


# ------------------------------------------------------------------------------------- values
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(allowed: tuple) -> Any:
    def check(where: str, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{where}: unknown value {value!r}; allowed: {list(allowed)}")
    return check


def _int_at_least(low: int) -> Any:
    def check(where: str, value: Any) -> None:
        if not _is_int(value) or value < low:
            raise ValueError(f"{where}: must be an int >= {low}, got {value!r}")
    return check


def _boolean(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: must be true or false, got {value!r}")


def _packing(where: str, value: Any) -> None:
    try:
        parse_packing(value)
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).removeprefix('packing: ')}") from None


def _real_ranks_only(where: str, value: Any) -> None:
    if value is not None:
        raise ValueError(f"{where}: a sweep measures its real ranks; emulate one rank with "
                         f"'dsv4cp profile --cp N --emulate-rank R', got {value!r}")


def _compile_backend(where: str, value: Any) -> None:
    if value is not None and value not in COMPILE_BACKENDS:
        raise ValueError(f"{where}: must be null (eager) or one of {list(COMPILE_BACKENDS)}, got {value!r}")


def _kernel_backend(where: str, value: Any) -> None:
    try:
        check_backend_name(value)
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).removeprefix('backend: ')}") from None


_CHECKS = {
    "preset": _choice(PRESET_NAMES),
    "ratio": _int_at_least(0),
    "cp": _int_at_least(1),
    "tokens": _int_at_least(1),
    "tokens_per_rank": _int_at_least(1),
    "packing": _packing,
    "loss": _choice(LOSS_VARIANTS),
    "overlap": _choice(OVERLAP_MODES),
    "kernel_backend": _kernel_backend,
    "recompute": _boolean,
    "pass": _choice(PASSES),
    "dtype": _choice(tuple(DTYPES)),
    "seed": _int_at_least(0),
    "partition": _choice(PARTITIONS),
    "emulated_rank": _real_ranks_only,
    "cuda_graph": _boolean,  # whether the point's device can replay a graph is known when it runs
    "deterministic": _boolean,
    "compile": _compile_backend,
}
assert set(_CHECKS) == set(AXES), "every record axis needs a check"


def check_axis_value(axis: str, value: Any, where: str | None = None) -> None:
    """``ValueError`` naming ``where`` (default: the axis) for an unknown axis or a bad value."""
    where = where or axis
    if axis not in _CHECKS:
        raise ValueError(f"{where}: unknown axis {axis!r}; allowed: {list(AXES)}")
    _CHECKS[axis](where, value)


# ------------------------------------------------------------------------------------- loading
def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML spec file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"spec: {path} is not a file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"spec: {path} is not valid YAML ({err})") from None
    return parse_spec(data, default_name=path.stem)


def parse_spec(data: Any, default_name: str | None = None) -> SweepSpec:
    """Validate a spec given as a dict (the YAML's content) and freeze it."""
    if not isinstance(data, dict):
        raise ValueError(f"spec: must be a mapping of {list(SPEC_KEYS)}, got {type(data).__name__}")
    unknown = [key for key in data if key not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"spec: unknown key {unknown[0]!r}; allowed: {list(SPEC_KEYS)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
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
    spec = SweepSpec(name=name, description=description, run=RunOptions(**run), base=dict(base), axes=frozen_axes,
                     zip=zipped, exclude=tuple(exclude), source=data)
    expand(spec)  # every point's combination (tokens, ratio vs preset) is checked now, before any launch
    return spec


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


# ------------------------------------------------------------------------------------- expansion
def expand(spec: SweepSpec) -> list[Point]:
    """The spec's points, in order: the product of the axes (zip groups as one factor, placed at
    their first axis), minus excluded points and duplicates. Pure: no device, no launch.

    Raises ``ValueError`` when a point gives both or neither of ``tokens`` and ``tokens_per_rank``,
    when a preset cannot build a ratio, or when nothing is left.
    """
    factors: list[list[dict]] = []
    placed: set[str] = set()
    for axis in spec.axes:
        if axis in placed:
            continue
        group = next((g for g in spec.zip if axis in g), (axis,))
        placed.update(group)
        factors.append([dict(zip(group, combo)) for combo in zip(*(spec.axes[a] for a in group))])
    points: list[Point] = []
    seen: set[str] = set()
    for combo in itertools.product(*factors):
        values = dict(spec.base)
        for part in combo:
            values.update(part)
        if _excluded(values, spec.exclude):  # before make_point: a rule may drop a combination it rejects
            continue
        point = make_point(values)
        if _excluded(point.axes(), spec.exclude):  # rules naming a default or a derived axis (tokens_per_rank)
            continue
        if point.point_id not in seen:
            seen.add(point.point_id)
            points.append(point)
    if not points:
        raise ValueError(f"spec {spec.name!r}: no point left after the exclude rules")
    return points


def _excluded(values: Mapping[str, Any], rules: tuple[Mapping[str, Any], ...]) -> bool:
    """Whether every key of some exclude rule matches ``values`` (record axis names)."""
    return any(all(k in values and values[k] == v for k, v in rule.items()) for rule in rules)


def make_point(values: Mapping[str, Any]) -> Point:
    """A :class:`Point` from axis values (record names); checks values and their combination."""
    for axis, value in values.items():
        check_axis_value(axis, value)
    values = dict(values)
    cp = values.get("cp", 1)
    tokens, per_rank = values.get("tokens"), values.get("tokens_per_rank")
    if (tokens is None) == (per_rank is None):
        raise ValueError(f"tokens: give exactly one of tokens and tokens_per_rank per point, got tokens={tokens!r}, "
                         f"tokens_per_rank={per_rank!r}")
    if tokens is None:
        tokens = per_rank * cp
    values["tokens"] = tokens
    values["tokens_per_rank"] = tokens // cp if tokens % cp == 0 else None
    preset = values.get("preset", "tiny")
    ratio = values.get("ratio", 4)
    try:
        DSv4Config.preset(preset).check_ratio(ratio)
    except ValueError as err:
        raise ValueError(f"ratio: {ratio} with preset {preset!r}: {err}") from None
    values["direction"] = values.pop("pass", "fwd+bwd")
    return Point(**values)
