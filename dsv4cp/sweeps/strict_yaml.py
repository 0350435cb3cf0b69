"""YAML for specs: PyYAML's safe loader, except that a key given twice in one mapping is an error.

PyYAML keeps the last of two equal keys without a word (``axes: {cp: [1], cp: [2]}`` sweeps cp 2
only); a spec is a measurement plan, so the loader refuses it, naming the key and both lines.
Merge keys (``<<: *defaults``) still work: a key written beside a merge overrides the merged one.

Aliases are bounded: every ``*name`` stands for a copy of its anchored value, so a few nested aliases
describe billions of values in a few kilobytes (an "alias bomb"), which anything walking the loaded
spec (a message quoting a bad value, the spec's hash) then expands. The loader counts the values the
document stands for, aliases expanded, before building any of them, and refuses a document whose aliases
add more than :data:`MAX_ALIASED_VALUES` values, or that holds an alias inside its own anchor.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"

MAX_ALIASED_VALUES = 10_000
"""Values that aliases may add to a document, beyond those written out: far more than a spec's shared
defaults need, far less than the memory a document that expands to billions of values takes."""


class AliasExpansionError(yaml.YAMLError):
    """Aliases expand the document beyond :data:`MAX_ALIASED_VALUES` values, or refer to themselves."""


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives one key twice; the message names the key and the lines (1-based)."""


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` for a key repeated in one mapping and
    :class:`AliasExpansionError` for aliases beyond their bound (checked before anything is built)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _check_alias_expansion(node)
        return super().construct_document(node)

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


def _check_alias_expansion(root: yaml.Node) -> None:
    """:class:`AliasExpansionError` when the values ``root`` stands for (every alias expanded) outnumber
    the distinct nodes written by more than :data:`MAX_ALIASED_VALUES`, or a node contains itself.

    A composed document is a graph: an alias is the anchored node itself, met again. The expanded size
    is counted per distinct node once (memoised), so the count costs the written size, not the expanded one.
    """
    expanded: dict[int, int] = {}  # id(node) -> values it stands for, aliases expanded
    open_nodes: set[int] = set()  # on the path from the root: met again, the node contains itself
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative: a deeply nested document must not exhaust Python's recursion
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            open_nodes.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in children)
            continue
        if key in expanded:
            continue
        open_nodes.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_nodes:
                raise AliasExpansionError(f"an alias refers to a value that contains it (the anchor at "
                                          f"line {child.start_mark.line + 1}): it would expand without end")
            if id(child) not in expanded:
                stack.append((child, False))
    added = expanded[id(root)] - len(expanded)
    if added > MAX_ALIASED_VALUES:
        raise AliasExpansionError(f"its aliases (*name) expand it by {added} values, more than the "
                                  f"{MAX_ALIASED_VALUES} allowed: write the values out, or share fewer")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_strict(text: str) -> Any:
    """The YAML document in ``text``, loaded safely; :class:`DuplicateKeyError` for a repeated key,
    :class:`AliasExpansionError` for aliases beyond their bound, ``yaml.YAMLError`` for anything else malformed."""
    return yaml.load(text, Loader=StrictSafeLoader)  # a SafeLoader subclass: no arbitrary objects
