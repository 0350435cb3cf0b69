"""A sweep spec's points as ``dsv4cp sweep SPEC --dry-run`` lists them: id, label and why a point cannot run.

The points are those of :func:`dsv4cp.sweeps.spec.iter_points`, taken as rows (:func:`~dsv4cp.sweeps.spec.iter_rows`:
tuples, no :class:`~dsv4cp.sweeps.spec.Point` built), and the texts are those of ``Point.point_id``,
``Point.label()`` and :func:`~dsv4cp.sweeps.spec.point_problem`, assembled from the same per-axis pieces
(:func:`dsv4cp.records.id_fragment`, :data:`~dsv4cp.sweeps.spec.LABEL_PARTS`). A spec repeats few values of
each axis over many points, so each value's pieces are made once (at most :data:`MEMO_LIMIT` per axis), and
within a block of rows that differ only in the innermost factor (:func:`~dsv4cp.sweeps.spec.iter_row_blocks`)
the other axes' pieces are joined once into a template that each row fills in: a million points take seconds.
Nothing but the current block's first point and its templates is held beyond those pieces.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from operator import getitem, itemgetter
from typing import Any

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.records import ID_AXES, id_fragment, id_of_fragments
from dsv4cp.sweeps.spec import (
    LABEL_PARTS,
    PACKING_AXES,
    ROW_INDEX,
    SHAPE_AXES,
    SweepSpec,
    block_axes,
    iter_row_blocks,
    packing_problem,
    shape_problem,
)

MEMO_LIMIT = 1 << 16
"""Values kept per axis (and shapes, and packings); past it they are made again (a spec of a million seeds
stays small)."""


class _Memo(dict):
    """``value -> make(value)``, made on first use. A row's axis holds values of one type (the spec's checks
    see to it: no ``True`` beside a ``1``), so equal keys mean equal texts."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, value: Any) -> Any:
        if len(self) >= MEMO_LIMIT:
            self.clear()
        made = self[value] = self.make(value)
        return made


def _options_fragment(pairs: tuple[tuple[str, str], ...] | None) -> str:
    """The id text of a row's kernel options: their configuration over the environment, as ``Point.axes()``."""
    return id_fragment("kernel_options", kernel_option_registry.configuration(dict(pairs) if pairs else None))


class _Text:
    """One text of a row (its id's JSON, its label) from per-axis pieces, in the order of ``axes``.

    :meth:`template` joins a block's first row's pieces, with ``%s`` where an axis of ``varying`` goes;
    :meth:`fill` puts a row's pieces of those axes in."""

    def __init__(self, axes: Sequence[str], makers: Sequence[Callable[[Any], str]], varying: Sequence[str]) -> None:
        self.pieces = [_Memo(make) for make in makers]
        self.rows_at = [ROW_INDEX[axis] for axis in axes]
        self.placeholders = {k for k, axis in enumerate(axes) if axis in varying}
        self.varying_pieces = [self.pieces[k] for k in sorted(self.placeholders)]
        self.varying_of = _tuple_getter([self.rows_at[k] for k in sorted(self.placeholders)])

    def template(self, row: tuple) -> str:
        return "".join("%s" if k in self.placeholders else self.pieces[k][row[i]].replace("%", "%%")
                       for k, i in enumerate(self.rows_at))

    def fill(self, template: str, row: tuple) -> str:
        return template % tuple(map(getitem, self.varying_pieces, self.varying_of(row)))


def _tuple_getter(indices: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``row -> tuple(row[i] for i in indices)``, a tuple however many indices (``itemgetter`` gives one
    value for one index)."""
    if len(indices) == 1:
        (index,) = indices
        return lambda row: (row[index],)
    return itemgetter(*indices) if indices else lambda row: ()


def iter_listing(spec: SweepSpec) -> Iterator[tuple[str, str, str | None, int]]:
    """``(point id, label, why it cannot run or None, cp)`` of each point of ``spec``, in order (the
    ``ValueError`` of :func:`~dsv4cp.sweeps.spec.iter_rows` when none is left)."""
    varying = block_axes(spec)
    ids = _Text(ID_AXES, [_options_fragment if axis == "kernel_options" else functools.partial(id_fragment, axis)
                          for axis in ID_AXES], varying)
    labels = _Text([axis for axis, _ in LABEL_PARTS], [part for _, part in LABEL_PARTS], varying)
    shape_problems = _Memo(lambda shape: shape_problem(*shape))  # as point_problem, asked once per shape
    shape_of = itemgetter(*(ROW_INDEX[axis] for axis in SHAPE_AXES))
    shape_varies = any(axis in varying for axis in SHAPE_AXES)
    packing_problems = _Memo(lambda documents: packing_problem(*documents))
    documents_of = itemgetter(*(ROW_INDEX[axis] for axis in PACKING_AXES))
    documents_vary = any(axis in varying for axis in PACKING_AXES)
    cp_at = ROW_INDEX["cp"]
    for block in iter_row_blocks(spec):
        first = next(block)
        id_template, label_template = ids.template(first), labels.template(first)
        block_shape = shape_problems[shape_of(first)]
        block_documents = packing_problems[documents_of(first)]
        for row in itertools.chain((first,), block):
            point_id = id_of_fragments(ids.fill(id_template, row))
            label = labels.fill(label_template, row)[1:]
            problem = ((shape_problems[shape_of(row)] if shape_varies else block_shape)
                       or (packing_problems[documents_of(row)] if documents_vary else block_documents))
            yield point_id, label, problem, row[cp_at]
