"""How a record's point ran beyond its axes (:data:`~dsv4cp.records.schema.CONFIG_FIELDS`): its resolved
configuration, the key it is paired on, and how two configurations differ."""

from __future__ import annotations

import hashlib
import json
import math

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.records.schema import CONFIG_FIELDS


def resolved_options(record: dict) -> dict[str, str] | None:
    """Every kernel option's value as ``record``'s point ran (its ``kernel_options`` column), or None when
    the record holds no mapping of them (written before options were recorded): unknown. An option the
    mapping lacks (added to the registry after the record was written) is read as what ran before it
    existed where that is known (:data:`dsv4cp.kernel_options.BEFORE_IT_EXISTED`), else it stays absent:
    unknown, never read as today's default (:func:`option_differences` and :func:`configuration_key` keep
    such a record apart)."""
    options = record.get("kernel_options")
    if not isinstance(options, dict):
        return None
    return {**kernel_option_registry.BEFORE_IT_EXISTED, **options}


def resolved_configuration(record: dict) -> dict[str, object]:
    """:data:`CONFIG_FIELDS` -> how ``record``'s point ran: its kernel options resolved
    (:func:`resolved_options`: what ran before an option existed, where known), the other fields as stored
    (None: unknown). What :func:`configuration_key` hashes and :func:`configuration_differences` compares."""
    values = {name: _plain(record.get(name)) for name in CONFIG_FIELDS}
    values["kernel_options"] = resolved_options(record)
    return values


def configuration_key(record: dict) -> str:
    """The identity of how ``record``'s point ran: the first 12 hex digits of the sha1 of the sorted JSON of
    its :func:`resolved_configuration` (every resolved kernel option, the backends that ran, the fresh
    batches). Two records are measurements of the same kernels only when their :func:`point_id` (the axes,
    kept for history) and this key both agree; every consumer that pairs records (``sweep --resume``, the
    report's runs side by side, ``compare`` through :func:`configuration_differences`) keys on both. An
    option one record lacks is unknown there (unless :func:`resolved_options` knows what ran before it
    existed), so such a record never shares a key with one that holds it; two records holding no options at
    all (written before options were recorded) share one, as ``compare`` treats two unknown configurations
    as equal."""
    text = json.dumps(resolved_configuration(record), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def configuration_differences(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """KEY -> (``a``'s value, ``b``'s value) for every entry on which two records'
    :func:`resolved_configuration` differ, sorted: KEY is ``column.entry`` where both hold a mapping
    (``kernel_options.topk_impl``; an entry one side lacks is :data:`UNKNOWN` there), else the column, its
    value None where unknown (equal to another unknown). Empty exactly when the records'
    :func:`configuration_key` agree (up to numbers JSON writes differently: 1 and 1.0)."""
    ours, theirs = resolved_configuration(a), resolved_configuration(b)
    found: dict[str, tuple[object, object]] = {}
    for column in CONFIG_FIELDS:
        x, y = ours[column], theirs[column]
        if not (isinstance(x, dict) and isinstance(y, dict)):
            if x != y:
                found[column] = (x, y)
            continue
        for entry in sorted(set(x) | set(y)):
            if entry not in x or entry not in y or x[entry] != y[entry]:
                found[f"{column}.{entry}"] = (x.get(entry, UNKNOWN), y.get(entry, UNKNOWN))
    return found


def _plain(value: object) -> object:
    """A column's value as its record holds it, also when read back from a DataFrame row (a numpy scalar
    as its Python number, a missing value as None), so a record and its row share a key."""
    if hasattr(value, "item") and not isinstance(value, (dict, list, str)):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def option_differences(stored: dict[str, str] | None, current: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Option -> (value in ``stored``, value in ``current``) for every option on which a record's resolved
    options (:func:`resolved_options`; None: all unknown) and the ones a point runs now differ, sorted by
    name; ``"unknown"`` for an option one side lacks (an option missing from a record is not read as
    today's default). A record without options differs in one entry, ``kernel_options``: (unknown, recorded)."""
    if stored is None:
        return {"kernel_options": (UNKNOWN, "recorded")}
    names = sorted(set(stored) | set(current))
    return {name: (stored.get(name, UNKNOWN), current.get(name, UNKNOWN)) for name in names
            if stored.get(name, UNKNOWN) != current.get(name, UNKNOWN)}


UNKNOWN = "unknown"
"""How :func:`option_differences` names the value of an option one side does not hold."""
