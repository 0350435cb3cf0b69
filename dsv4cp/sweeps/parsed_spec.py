"""A parsed sweep spec: the frozen :class:`SweepSpec` that :func:`dsv4cp.sweeps.spec.parse_spec` returns, with
the timing options shared by its points (:class:`RunOptions`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4cp.sweeps.axis_values import is_int
from dsv4cp.targets import Target


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
            if not is_int(value) or value < low:
                raise ValueError(f"run.{name}: must be an int >= {low}, got {value!r}")
        if not isinstance(self.l2_flush, bool):
            raise ValueError(f"run.l2_flush: must be true or false, got {self.l2_flush!r}")


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
