"""A point's id (the hash of its axes) and the id two runs' records are matched on."""

from __future__ import annotations

import hashlib
import json

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.records.schema import _ADDED_AXES, AXES


def _id_under_former_defaults(recorded: str, axes: dict) -> bool:
    """Whether ``recorded`` is the id of ``axes`` with its kernel options read as the version that wrote the
    record may have named them (:func:`dsv4cp.kernel_options.configurations`: an option at a former default
    was not set then). A record without a mapping of options has one reading only, today's."""
    options = axes.get("kernel_options")
    if not isinstance(options, dict):
        return False
    return any(point_id({**axes, "kernel_options": named or None}) == recorded
               for named in kernel_option_registry.configurations(options)[1:])


def point_id(axes: dict) -> str:
    """A stable 12-hex-digit id of a point: the sha1 of the sorted JSON of its :data:`AXES` values
    (no spaces), built as :data:`ID_AXES`' :func:`id_fragment` texts joined (:func:`id_of_fragments`).

    Keys outside :data:`AXES` are ignored; a missing axis counts as None (an axis of
    :data:`_ADDED_AXES` that is None or at its value from before it existed is left out).
    """
    return id_of_fragments("".join(id_fragment(name, axes.get(name)) for name in ID_AXES))


ID_AXES: tuple[str, ...] = tuple(sorted(AXES))
"""The axes in the order their values appear in the JSON a point id hashes (sorted keys)."""


def id_fragment(axis: str, value: object) -> str:
    """What ``axis`` at ``value`` adds to the JSON a point id hashes: ``,"<axis>":<value as JSON>``, or
    nothing for an axis of :data:`_ADDED_AXES` at None or at its value from before it existed. A caller
    naming many points (a sweep's dry run) keeps these per value and joins its own, in :data:`ID_AXES` order."""
    if axis == "kernel_options" and isinstance(value, dict):  # a configuration: what differs from the defaults
        value = kernel_option_registry.non_default(value) or None
    # ``is``, not ``==``: only the old value itself is left out, never a number equal to it (0 == False)
    if axis in _ADDED_AXES and (value is None or value is _ADDED_AXES[axis]):
        return ""
    return f",{json.dumps(axis)}:{json.dumps(value, sort_keys=True, separators=(',', ':'))}"


def id_of_fragments(fragments: str) -> str:
    """The point id of :func:`id_fragment` texts joined in :data:`ID_AXES` order: the first 12 hex digits
    of the sha1 of ``{...}`` around them (their leading comma dropped)."""
    return hashlib.sha1(f"{{{fragments[1:]}}}".encode()).hexdigest()[:12]


def match_id(record: dict) -> str:
    """The id of a record's point without its kernel options and fresh batches: what two runs' records are
    matched on (``dsv4cp compare``), so that points differing only in their configuration meet, and the
    configuration is then compared as part of their identity (:data:`CONFIG_FIELDS`)."""
    return point_id({**record, "kernel_options": None, "fresh_batches": None})
