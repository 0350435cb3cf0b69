"""The values a sweep's axes take: every axis's check (:func:`check_axis_value`), run on a spec's values as it
is loaded and on a point's as it is made, so a bad value is refused naming where it was given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.choices import COMPILE_BACKENDS, OVERLAP_MODES, check_backend_name
from dsv4cp.config import DTYPE_NAMES, LOSS_VARIANTS, PRESET_NAMES
from dsv4cp.cp.partition import POLICIES
from dsv4cp.records import AXES
from dsv4cp.workloads import parse_packing

PASSES = ("fwd", "fwd+bwd")
MEASURED = "measured"
"""The split refined from measured rank times (:mod:`dsv4cp.sweeps.measured_split`): needs measurements, so it
is a point's partition but no policy of the model's partitioner."""
PARTITIONS = (*POLICIES, MEASURED)
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(allowed: tuple) -> Any:
    def check(where: str, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{where}: unknown value {value!r}; allowed: {list(allowed)}")
    return check


def _int_at_least(low: int) -> Any:
    def check(where: str, value: Any) -> None:
        if not is_int(value) or value < low:
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
    if not is_int(value) or value < 0 or value == 1:
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
