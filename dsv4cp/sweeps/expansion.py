"""A spec's points, in order and lazily (:func:`iter_points`, :func:`iter_rows`, in blocks for a listing):
the product of its axes, zip groups as one factor, minus the excluded points and duplicates."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator, Mapping
from operator import itemgetter
from typing import Any

from dsv4cp.records import AXES
from dsv4cp.sweeps.parsed_spec import SweepSpec
from dsv4cp.sweeps.point import AXIS_DEFAULTS, Point
from dsv4cp.sweeps.rows import check_measured, point_of_row, row_axes, row_of_values, stored_value


def iter_points(spec: SweepSpec) -> Iterator[Point]:
    """The spec's points, in order, one at a time: the product of the axes (zip groups as one factor,
    placed at their first axis), minus excluded points and duplicates. Pure: no device, no launch;
    nothing but the current point is held, so a spec of any size can be listed or counted.

    Points that cannot run are yielded too (:func:`point_problem` says why). Raises ``ValueError``
    when nothing is left after the exclude rules.
    """
    return map(point_of_row, iter_rows(spec))


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
    fixed = {axis: stored_value(axis, value) for axis, value in spec.base.items()}
    fixed.update((axis, value) for axis, value in AXIS_DEFAULTS.items()
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
            check_measured(values[partition_at], cp)
            yield in_axis_order(values + (tokens, tokens // cp if tokens % cp == 0 else None))

    entries = [[tuple(stored_value(axis, value) for axis, value in entry.items()) for entry in factor]
               for factor in factors]
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
        row = row_of_values(values)
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
