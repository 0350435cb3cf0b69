"""A sweep point: a value for every axis (:class:`Point`), its record axes and id, and its label; the rows
a listing walks without building a Point (:data:`ROW_INDEX`, :func:`row_label`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.records import AXES, point_id


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
        values = {axis: getattr(self, attribute) for axis, attribute in AXIS_ATTRIBUTES}
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
        return tuple(options_pairs(value) if axis == "kernel_options" else value
                     for axis, value in zip(AXES, (getattr(self, attribute) for _, attribute in AXIS_ATTRIBUTES)))


AXIS_ATTRIBUTES: tuple[tuple[str, str], ...] = tuple((axis, "direction" if axis == "pass" else axis) for axis in AXES)
"""(record axis, :class:`Point` attribute) pairs, in :data:`AXES` order."""
assert {attribute for _, attribute in AXIS_ATTRIBUTES} == {f.name for f in fields(Point)}, "a Point field per axis"

ROW_INDEX: dict[str, int] = {axis: i for i, axis in enumerate(AXES)}
"""Where each axis sits in a row of :func:`iter_rows` (:data:`AXES` order)."""

AXIS_DEFAULTS: dict[str, Any] = {axis: f.default for axis, f in zip(AXES, (Point.__dataclass_fields__[attribute]
                                                                        for _, attribute in AXIS_ATTRIBUTES))
                             if f.default is not MISSING}
"""An axis a spec does not give -> its value in every point (tokens has none: a spec gives it or tokens_per_rank)."""


def options_pairs(options: Mapping[str, str] | None) -> tuple[tuple[str, str], ...] | None:
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
