"""YAML for specs: PyYAML's safe loader, except that a key given twice in one mapping is an error.

PyYAML keeps the last of two equal keys without a word (``axes: {cp: [1], cp: [2]}`` sweeps cp 2
only); a spec is a measurement plan, so the loader refuses it, naming the key and both lines.
Merge keys (``<<: *defaults``) still work: a key written beside a merge overrides the merged one.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives one key twice; the message names the key and the lines (1-based)."""


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` for a key repeated in one mapping."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:  # as written: the merge below has not flattened them yet
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first_lines.get(key)
                except TypeError:  # an unhashable key: the safe loader's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if earlier is not None:
                    raise DuplicateKeyError(f"duplicate key {key!r} at line {line} (first given at line {earlier})")
                first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_strict(text: str) -> Any:
    """The YAML document in ``text``, loaded safely; :class:`DuplicateKeyError` for a repeated key,
    ``yaml.YAMLError`` for anything else malformed."""
    return yaml.load(text, Loader=StrictSafeLoader)  # a SafeLoader subclass: no arbitrary objects
