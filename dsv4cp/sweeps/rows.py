"""Axis values, rows and points: a point made from axis values (:func:`make_point`), a row's record axes,
and the conversions between the three the expansion uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.records import AXES
from dsv4cp.sweeps.axis_values import MEASURED, check_axis_value
from dsv4cp.sweeps.point import AXIS_ATTRIBUTES, AXIS_DEFAULTS, Point, options_pairs
from dsv4cp.sweeps.validity import checked_config


def make_point(values: Mapping[str, Any]) -> Point:
    """A :class:`Point` from axis values (record names); checks the values and that the preset can
    build the ratio (the other shape checks: :func:`point_problem`, or :func:`point_inputs` when run)."""
    for axis, value in values.items():
        check_axis_value(axis, value)
    tokens, per_rank = values.get("tokens"), values.get("tokens_per_rank")
    if (tokens is None) == (per_rank is None):
        raise ValueError(f"tokens: give exactly one of tokens and tokens_per_rank per point, got tokens={tokens!r}, "
                         f"tokens_per_rank={per_rank!r}")
    point = point_of_row(row_of_values(values))
    checked_config(point.preset, point.loss, point.ratio)
    return point


def stored_value(axis: str, value: Any) -> Any:
    """An axis value as a row holds it: kernel options canonical (:func:`options_pairs`), others as given."""
    if axis == "kernel_options":
        return options_pairs(kernel_option_registry.canonical(value or {}))
    return value


def check_measured(partition: str | None, cp: int) -> None:
    if partition == MEASURED and cp < 2:
        raise ValueError(f"partition: a measured split needs cp >= 2 ranks to measure, got cp {cp}")


def row_of_values(values: Mapping[str, Any]) -> tuple:
    """The row of checked axis values (record names) holding exactly one of tokens and tokens_per_rank."""
    cp = values.get("cp", 1)
    tokens = values.get("tokens")
    if tokens is None:
        tokens = values["tokens_per_rank"] * cp
    check_measured(values.get("partition"), cp)
    per_rank = tokens // cp if tokens % cp == 0 else None
    completed = {**AXIS_DEFAULTS, **values, "tokens": tokens, "tokens_per_rank": per_rank}
    return tuple(stored_value(axis, completed[axis]) for axis in AXES)


def row_axes(row: Sequence) -> dict[str, Any]:
    """A row's record axes, as :meth:`Point.axes` gives them (its kernel configuration over the environment)."""
    values = dict(zip(AXES, row))
    options = values["kernel_options"]
    values["kernel_options"] = kernel_option_registry.configuration(dict(options) if options else None)
    return values


def point_of_row(row: Sequence) -> Point:
    return Point(**{attribute: dict(value) if attribute == "kernel_options" and value else value
                    for (_, attribute), value in zip(AXIS_ATTRIBUTES, row)})
