"""The types a record's or a ``meta.json``'s fields may hold (:class:`FieldType`), checked on every read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldType:
    """What a column may hold besides None (None is always allowed: a metric not measured, an axis
    without a value, a column that an older writer did not have)."""

    description: str
    accepts: Callable[[object], bool]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(accepts: Callable[[object], bool], *, none_allowed: bool = False) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and all(
        (none_allowed and item is None) or accepts(item) for item in value)


def _mapping_of(accepts: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, dict) and all(accepts(item) for item in value.values())


def _int_at_least(low: int) -> FieldType:
    return FieldType(f"an integer >= {low}", lambda value: _is_int(value) and value >= low)


TEXT = FieldType("a string", lambda value: isinstance(value, str))
FLAG = FieldType("true or false", lambda value: isinstance(value, bool))
NUMBER = FieldType("a number", _is_number)
MAPPING = FieldType("a JSON object", lambda value: isinstance(value, dict))
TEXT_MAPPING = FieldType("a JSON object of strings", _mapping_of(lambda item: isinstance(item, str)))
SCALAR_MAPPING = FieldType("a JSON object of strings, numbers or flags",
                           _mapping_of(lambda item: isinstance(item, (str, int, float))))
NUMBERS = FieldType("a list of numbers", _list_of(_is_number))
NUMBERS_OR_NULLS = FieldType("a list of numbers or nulls", _list_of(_is_number, none_allowed=True))
INTS = FieldType("a list of integers", _list_of(_is_int))
INTS_OR_NULLS = FieldType("a list of integers or nulls", _list_of(_is_int, none_allowed=True))
OBJECTS = FieldType("a list of JSON objects", _list_of(lambda item: isinstance(item, dict)))
OBJECTS_OR_NULLS = FieldType("a list of JSON objects or nulls",
                             _list_of(lambda item: isinstance(item, dict), none_allowed=True))
