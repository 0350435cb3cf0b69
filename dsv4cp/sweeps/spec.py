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

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from operator import itemgetter
from pathlib import Path
from typing import Any

import yaml

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.choices import COMPILE_BACKENDS, OVERLAP_MODES, check_backend_name, check_head_dim
from dsv4cp.config import DTYPE_NAMES, LOSS_VARIANTS, PRESET_NAMES, DSv4Config
from dsv4cp.cp.partition import POLICIES, split_rows
from dsv4cp.records import AXES, point_id
from dsv4cp.sweeps.strict_yaml import AliasExpansionError, DuplicateKeyError, load_strict
from dsv4cp.targets import Target, parse_targets
from dsv4cp.workloads import packing_lengths, parse_packing

PASSES = ("fwd", "fwd+bwd")
MEASURED = "measured"
"""The split refined from measured rank times (:mod:`dsv4cp.sweeps.measured_split`): needs measurements, so it
is a point's partition but no policy of the model's partitioner."""
PARTITIONS = (*POLICIES, MEASURED)
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
    emulated_rank: int | str | None = None
    """The one rank a single process measures alone (``dsv4cp profile --emulate-rank``), :data:`ALL_RANKS`
    for the summary of every rank emulated in turn; None: real ranks."""
    cuda_graph: bool = False
    """Time the step as replays of one captured CUDA graph (no host overhead; CUDA, CP = 1 only:
    :func:`dsv4cp.sweeps.measure.check_cuda_graph`); peak memory and traces stay eager steps."""
    kernel_options: Mapping[str, str] | None = None
    """Kernel options in force while the point is measured (``{name: text}``, sorted; None: none)."""
    deterministic: bool = False
    """Run under ``torch.use_deterministic_algorithms(True)``; "auto" then picks deterministic backends only."""
    compile: str | None = None
    """The layer's ``torch.compile`` backend (:data:`dsv4cp.profiling.compilation.COMPILE_BACKENDS`); None: eager."""
    fresh_batches: int = 0
    """0: every step runs on the point's one batch (its layout built once, then cached). N >= 2: N distinct
    batches of the same documents, built before timing, that the steps cycle through, each step building
    its batch's layout again (:mod:`dsv4cp.harness.fresh_batches`); eager steps only (no ``cuda_graph``)."""

    @property
    def backward(self) -> bool:
        return self.direction == "fwd+bwd"

    def axes(self) -> dict[str, Any]:
        """The point as record axes (``direction`` under its axis name ``pass``; ``kernel_options`` as the
        options that differ from their defaults once the point's own are set, the environment included)."""
        values = {axis: getattr(self, attribute) for axis, attribute in _AXIS_ATTRIBUTES}
        values["kernel_options"] = kernel_option_registry.configuration(self.kernel_options)
        return values

    @property
    def point_id(self) -> str:
        return point_id(self.axes())

    def label(self) -> str:
        """A short human-readable name for progress bars and logs."""
        return row_label(self.row())

    def row(self) -> tuple:
        """The point as a row of :func:`iter_rows`."""
        return tuple(_options_pairs(value) if axis == "kernel_options" else value
                     for axis, value in zip(AXES, (getattr(self, attribute) for _, attribute in _AXIS_ATTRIBUTES)))


_AXIS_ATTRIBUTES: tuple[tuple[str, str], ...] = tuple((axis, "direction" if axis == "pass" else axis) for axis in AXES)
"""(record axis, :class:`Point` attribute) pairs, in :data:`AXES` order."""
assert {attribute for _, attribute in _AXIS_ATTRIBUTES} == {f.name for f in fields(Point)}, "a Point field per axis"

ROW_INDEX: dict[str, int] = {axis: i for i, axis in enumerate(AXES)}
"""Where each axis sits in a row of :func:`iter_rows` (:data:`AXES` order)."""

_DEFAULTS: dict[str, Any] = {axis: f.default for axis, f in zip(AXES, (Point.__dataclass_fields__[attribute]
                                                                        for _, attribute in _AXIS_ATTRIBUTES))
                             if f.default is not MISSING}
"""An axis a spec does not give -> its value in every point (tokens has none: a spec gives it or tokens_per_rank)."""


def _options_pairs(options: Mapping[str, str] | None) -> tuple[tuple[str, str], ...] | None:
    """Canonical kernel options (``{name: text}``, sorted) as a row holds them: their pairs, None for none."""
    return tuple(options.items()) if options else None


def _tokens_text(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


LABEL_PARTS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("preset", lambda value: f" {value}"),
    ("ratio", lambda value: f" r{value}"),
    ("cp", lambda value: f" cp{value}"),
    ("tokens", lambda value: f" {_tokens_text(value)}"),
    ("packing", lambda value: f" {value}"),
    ("pass", lambda value: f" {value}"),
    ("dtype", lambda value: f" {value}"),
    ("overlap", lambda value: f" {value}"),
    ("recompute", lambda value: " recompute" if value else ""),
    ("kernel_backend", lambda value: f" {value}"),
    ("partition", lambda value: "" if value == "equal" else f" {value}"),
    ("emulated_rank", lambda value: "" if value is None else f" emulated rank {value}"),
    ("cuda_graph", lambda value: " cuda-graph" if value else ""),
    ("deterministic", lambda value: " deterministic" if value else ""),
    ("compile", lambda value: "" if value is None else f" compile {value}"),
    ("fresh_batches", lambda value: f" fresh-batches {value}" if value else ""),
    ("kernel_options", lambda pairs: "".join(f" {name}={text}" for name, text in pairs or ())),
)
"""A point's label, axis by axis: each value's text (with its leading space; empty for a default the label
leaves out), in the label's order. :func:`row_label` joins them; a listing of many points keeps them per value."""


def row_label(row: Sequence) -> str:
    """The label (:meth:`Point.label`) of a row of :func:`iter_rows`."""
    return "".join(part(row[ROW_INDEX[axis]]) for axis, part in LABEL_PARTS)[1:]


ALL_RANKS = "all"
"""``emulated_rank`` of the summary record of every rank emulated in turn (:mod:`dsv4cp.sweeps.emulation`)."""


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
    targets: tuple[Target, ...] = ()
    """What the run must reach (:mod:`dsv4cp.targets`); ``dsv4cp report`` judges them."""
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


def _fresh_batches(where: str, value: Any) -> None:
    if not _is_int(value) or value < 0 or value == 1:
        raise ValueError(f"{where}: must be 0 (one batch, its layout cached) or an int >= 2 (distinct batches "
                         f"cycled, every step building its layout), got {value!r}")


def _kernel_options(where: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be a mapping of kernel option -> value, got {value!r}")
    try:
        kernel_option_registry.check_values(value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


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
    "dtype": _choice(DTYPE_NAMES),
    "seed": _int_at_least(0),
    "partition": _choice(PARTITIONS),
    "emulated_rank": _real_ranks_only,
    "cuda_graph": _boolean,  # whether the point's device can replay a graph is known when it runs
    "kernel_options": _kernel_options,
    "deterministic": _boolean,
    "compile": _compile_backend,
    "fresh_batches": _fresh_batches,
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


# ------------------------------------------------------------------------------------- expansion
def iter_points(spec: SweepSpec) -> Iterator[Point]:
    """The spec's points, in order, one at a time: the product of the axes (zip groups as one factor,
    placed at their first axis), minus excluded points and duplicates. Pure: no device, no launch;
    nothing but the current point is held, so a spec of any size can be listed or counted.

    Points that cannot run are yielded too (:func:`point_problem` says why). Raises ``ValueError``
    when nothing is left after the exclude rules.
    """
    return map(_point_of_row, iter_rows(spec))


def expand(spec: SweepSpec) -> list[Point]:
    """Every point of :func:`iter_points`, as a list (for a run, which measures them all anyway)."""
    return list(iter_points(spec))


def iter_rows(spec: SweepSpec) -> Iterator[tuple]:
    """The points of :func:`iter_points` as rows, without building a :class:`Point`: tuples of every axis
    value in :data:`AXES` order (:data:`ROW_INDEX`), ``tokens`` and ``tokens_per_rank`` derived, an axis
    the spec does not give at its default, ``kernel_options`` canonical as ``(name, text)`` pairs or None."""
    return itertools.chain.from_iterable(iter_row_blocks(spec))


def iter_row_blocks(spec: SweepSpec) -> Iterator[Iterator[tuple]]:
    """The rows of :func:`iter_rows` in blocks, each a lazy iterator: per combination of the values of every
    factor but the last, the rows of the last factor's values (only the axes :func:`block_axes` names differ
    between the rows of a block). With exclude rules, one row a block.

    A point is its fixed values followed by its factors' values as the product gives them, put in axis
    order by one ``itemgetter``: no dict per point, unless exclude rules need its values by name.
    """
    factors = _factors(spec)
    if spec.exclude:
        yield from (iter((row,)) for row in _rows_after_rules(spec, factors))
        return
    varied = [axis for factor in factors for axis in factor[0]]
    fixed = {axis: _stored(axis, value) for axis, value in spec.base.items()}
    fixed.update((axis, value) for axis, value in _DEFAULTS.items()
                 if axis not in fixed and axis not in varied and axis != "tokens_per_rank")
    layout = [*fixed, *varied]  # a point's values before its tokens and tokens_per_rank are derived
    where = {axis: i for i, axis in enumerate(layout)}
    derived = {"tokens": len(layout), "tokens_per_rank": len(layout) + 1}  # appended to each point's values
    in_axis_order = itemgetter(*(derived.get(axis, where.get(axis)) for axis in AXES))
    per_rank = "tokens" not in where
    tokens_at, cp_at = where["tokens_per_rank" if per_rank else "tokens"], where["cp"]
    partition_at = where["partition"]

    def block(start: tuple, last: list[tuple]) -> Iterator[tuple]:
        for entry in last:
            values = start + entry
            cp = values[cp_at]
            tokens = values[tokens_at] * cp if per_rank else values[tokens_at]
            _check_measured(values[partition_at], cp)
            yield in_axis_order(values + (tokens, tokens // cp if tokens % cp == 0 else None))

    entries = [[tuple(_stored(axis, value) for axis, value in entry.items()) for entry in factor] for factor in factors]
    last = entries.pop() if entries else [()]
    head = tuple(fixed.values())
    for outer in itertools.product(*entries):
        yield block(head + tuple(itertools.chain.from_iterable(outer)), last)


def block_axes(spec: SweepSpec) -> tuple[str, ...]:
    """The axes whose values differ between the rows of one block of :func:`iter_row_blocks`: the last
    factor's, and tokens and tokens_per_rank when it holds either or cp (none with exclude rules)."""
    if spec.exclude or not spec.axes:
        return ()
    last = tuple(_factors(spec)[-1][0])
    if {"cp", "tokens", "tokens_per_rank"} & set(last):
        return tuple(dict.fromkeys((*last, "tokens", "tokens_per_rank")))
    return last


def _rows_after_rules(spec: SweepSpec, factors: list[list[dict]]) -> Iterator[tuple]:
    """:func:`iter_rows` of a spec with exclude rules: each point's values by name, matched against the
    rules as written and again once derived (a rule may name a default or a derived axis)."""
    empty = True
    base = dict(spec.base)
    for combo in itertools.product(*factors):
        values = base.copy()
        for part in combo:
            values.update(part)
        if _excluded(values, spec.exclude):  # before building: a rule may drop what it rejects
            continue
        row = _row_of_values(values)
        if _excluded(row_axes(row), spec.exclude):  # rules naming a default or a derived axis
            continue
        empty = False
        yield row
    if empty:
        raise ValueError(f"spec {spec.name!r}: no point left after the exclude rules")


def _factors(spec: SweepSpec) -> list[list[dict]]:
    """One factor per axis or zip group: its value combinations, each once (a repeated value would
    name the same points again; only the first is kept, so the product holds no duplicate point)."""
    factors: list[list[dict]] = []
    placed: set[str] = set()
    for axis in spec.axes:
        if axis in placed:
            continue
        group = next((g for g in spec.zip if axis in g), (axis,))
        placed.update(group)
        entries, seen = [], set()
        for combo in zip(*(spec.axes[a] for a in group)):
            key = json.dumps(combo)  # by JSON, as point ids are: true and 1 stay apart
            if key not in seen:
                seen.add(key)
                entries.append(dict(zip(group, combo)))
        factors.append(entries)
    return factors


def with_kernel_options(spec: SweepSpec, values: Mapping[str, str]) -> SweepSpec:
    """``spec`` with the kernel options ``values`` under every point's own (``dsv4cp sweep
    --kernel-option``): merged into ``base.kernel_options`` and into each mapping of a
    ``kernel_options`` axis, where a point's own value of an option wins. The points' ids follow."""
    if not values:
        return spec
    base = dict(spec.base)
    axes = dict(spec.axes)
    if "kernel_options" in axes:
        axes["kernel_options"] = tuple({**values, **(v or {})} for v in axes["kernel_options"])
    else:
        base["kernel_options"] = {**values, **(base.get("kernel_options") or {})}
    return dataclasses.replace(spec, base=base, axes=axes)


def _excluded(values: Mapping[str, Any], rules: tuple[Mapping[str, Any], ...]) -> bool:
    """Whether every key of some exclude rule matches ``values`` (record axis names)."""
    return any(all(k in values and values[k] == v for k, v in rule.items()) for rule in rules)


def make_point(values: Mapping[str, Any]) -> Point:
    """A :class:`Point` from axis values (record names); checks the values and that the preset can
    build the ratio (the other shape checks: :func:`point_problem`, or :func:`point_inputs` when run)."""
    for axis, value in values.items():
        check_axis_value(axis, value)
    tokens, per_rank = values.get("tokens"), values.get("tokens_per_rank")
    if (tokens is None) == (per_rank is None):
        raise ValueError(f"tokens: give exactly one of tokens and tokens_per_rank per point, got tokens={tokens!r}, "
                         f"tokens_per_rank={per_rank!r}")
    point = _point_of_row(_row_of_values(values))
    _checked_config(point.preset, point.loss, point.ratio)
    return point


def _stored(axis: str, value: Any) -> Any:
    """An axis value as a row holds it: kernel options canonical (:func:`_options_pairs`), others as given."""
    if axis == "kernel_options":
        return _options_pairs(kernel_option_registry.canonical(value or {}))
    return value


def _check_measured(partition: str | None, cp: int) -> None:
    if partition == MEASURED and cp < 2:
        raise ValueError(f"partition: a measured split needs cp >= 2 ranks to measure, got cp {cp}")


def _row_of_values(values: Mapping[str, Any]) -> tuple:
    """The row of checked axis values (record names) holding exactly one of tokens and tokens_per_rank."""
    cp = values.get("cp", 1)
    tokens = values.get("tokens")
    if tokens is None:
        tokens = values["tokens_per_rank"] * cp
    _check_measured(values.get("partition"), cp)
    completed = {**_DEFAULTS, **values, "tokens": tokens, "tokens_per_rank": tokens // cp if tokens % cp == 0 else None}
    return tuple(_stored(axis, completed[axis]) for axis in AXES)


def row_axes(row: Sequence) -> dict[str, Any]:
    """A row's record axes, as :meth:`Point.axes` gives them (its kernel configuration over the environment)."""
    values = dict(zip(AXES, row))
    options = values["kernel_options"]
    values["kernel_options"] = kernel_option_registry.configuration(dict(options) if options else None)
    return values


def _point_of_row(row: Sequence) -> Point:
    return Point(**{attribute: dict(value) if attribute == "kernel_options" and value else value
                    for (_, attribute), value in zip(_AXIS_ATTRIBUTES, row)})


def cannot_run_message(point_id: str, label: str, problem: str, invalid: int, total: int) -> str:
    """The refusal of a spec with ``invalid`` of its ``total`` points unable to run, naming the first."""
    return (f"point {point_id} ({label}) cannot run: {problem}; {invalid} of {total} points cannot "
            "(--dry-run marks them): exclude them or change the spec")


def check_points_can_run(points: Sequence[Point]) -> None:
    """``ValueError`` naming the first point whose shapes cannot run (:func:`point_problem`), before any launch."""
    problems = [(point, problem) for point in points if (problem := point_problem(point)) is not None]
    if problems:
        point, problem = problems[0]
        raise ValueError(cannot_run_message(point.point_id, point.label(), problem, len(problems), len(points)))


# ------------------------------------------------------------------------------------- validity
@functools.lru_cache(maxsize=64)
def _config(preset: str, loss: str) -> DSv4Config:
    return DSv4Config.preset(preset, indexer_loss=loss)


def _checked_config(preset: str, loss: str, ratio: int) -> DSv4Config:
    """The point's config; ``ValueError`` naming the ratio when the preset cannot build it."""
    cfg = _config(preset, loss)
    try:
        cfg.check_ratio(ratio)
    except ValueError as err:
        raise ValueError(f"ratio: {ratio} with preset {preset!r}: {err}") from None
    return cfg


def _shape_config(preset: str, loss: str, ratio: int, cp: int, tokens: int, partition: str,
                  kernel_backend: str) -> DSv4Config:
    """The config of a point's shape; ``ValueError`` when the preset cannot build the ratio, a kernel backend
    named for other head dims, or (under the equal split) tokens not divisible by cp or fewer rows per rank
    than the halo."""
    cfg = _checked_config(preset, loss, ratio)
    check_head_dim(kernel_backend, cfg.head_dim)
    if partition == "equal":
        split_rows(tokens, cp, cfg, ratio, field="tokens")
    return cfg


def point_inputs(point: Point) -> tuple[DSv4Config, list[int]]:
    """The point's config and document lengths; ``ValueError`` when its shapes cannot run (a ratio
    the preset cannot build, tokens not divisible by cp or fewer rows per rank than the halo under the
    equal split, documents that do not fit the tokens, a kernel backend named for other head dims)."""
    cfg = _shape_config(point.preset, point.loss, point.ratio, point.cp, point.tokens, point.partition,
                        point.kernel_backend)
    lengths = packing_lengths(point.packing, point.tokens, cp=point.cp, ratio=point.ratio, seed=point.seed)
    return cfg, lengths


def point_problem(point: Point) -> str | None:
    """Why ``point`` cannot run (the message :func:`point_inputs` raises), None when it can."""
    return row_problem(point.row())


SHAPE_AXES = ("preset", "loss", "ratio", "cp", "tokens", "partition", "kernel_backend")
"""The axes a point's shape checks read, in :func:`shape_problem`'s order."""
PACKING_AXES = ("packing", "tokens", "cp", "ratio", "seed")
"""The axes its documents are drawn from, in :func:`packing_problem`'s order."""
_shape_of = itemgetter(*(ROW_INDEX[axis] for axis in SHAPE_AXES))
_packing_of = itemgetter(*(ROW_INDEX[axis] for axis in PACKING_AXES))


def row_problem(row: Sequence) -> str | None:
    """:func:`point_problem` of a row of :func:`iter_rows`. Only the axes that shape the step are looked at,
    in two groups whose answers are cached apart: the axes neither group reads (dtype, pass, overlap,
    recompute, ...) multiply a spec's points without multiplying this work, and the seed multiplies only
    the documents' checks."""
    return shape_problem(*_shape_of(row)) or packing_problem(*_packing_of(row))


@functools.lru_cache(maxsize=4096)
def shape_problem(preset: str, loss: str, ratio: int, cp: int, tokens: int, partition: str,
                  kernel_backend: str) -> str | None:
    """Why a point of this shape cannot run (:func:`_shape_config`), None when it can."""
    try:
        _shape_config(preset, loss, ratio, cp, tokens, partition, kernel_backend)
    except ValueError as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=4096)
def packing_problem(packing: str, tokens: int, cp: int, ratio: int, seed: int) -> str | None:
    """Why the documents of this packing do not fit the tokens, None when they do."""
    try:
        packing_lengths(packing, tokens, cp=cp, ratio=ratio, seed=seed)
    except ValueError as err:
        return str(err)
    return None
