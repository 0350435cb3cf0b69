"""A sweep spec's points as ``dsv4cp sweep SPEC --dry-run`` lists them: id, label and why a point cannot run.

The points are those of :func:`dsv4cp.sweeps.spec.iter_points`, taken as rows (:func:`~dsv4cp.sweeps.spec.iter_rows`:
tuples, no :class:`~dsv4cp.sweeps.spec.Point` built), and the texts are those of ``Point.point_id``,
``Point.label()`` and :func:`~dsv4cp.sweeps.spec.point_problem`, assembled from the same per-axis pieces
(:func:`dsv4cp.records.id_fragment`, :data:`~dsv4cp.sweeps.spec.LABEL_PARTS`). A spec repeats few values of
each axis over many points, so each value's pieces are made once and joined per point: a million points
take seconds. Nothing but the current point is held beyond those pieces (at most :data:`MEMO_LIMIT` per axis).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
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
    iter_rows,
    packing_problem,
    shape_problem,
)

MEMO_LIMIT = 1 << 16
"""Values kept per axis; past it an axis's pieces are made again (a spec of a million seeds stays small)."""


class _Memo(dict):
    """``value -> make(value)``, made on first use. A row's axis holds values of one type (the spec's checks
    see to it: no ``True`` beside a ``1``), so equal keys mean equal texts."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, value: Any) -> Any:
        if len(self) >= MEMO_LIMIT:
            self.clear()
        text = self[value] = self.make(value)
        return text


def _options_fragment(pairs: tuple[tuple[str, str], ...] | None) -> str:
    """The id text of a row's kernel options: their configuration over the environment, as ``Point.axes()``."""
    return id_fragment("kernel_options", kernel_option_registry.configuration(dict(pairs) if pairs else None))


def iter_listing(spec: SweepSpec) -> Iterator[tuple[str, str, str | None, int]]:
    """``(point id, label, why it cannot run or None, cp)`` of each point of ``spec``, in order (the
    ``ValueError`` of :func:`~dsv4cp.sweeps.spec.iter_rows` when none is left)."""
    id_pieces = [_Memo(_options_fragment if axis == "kernel_options" else functools.partial(id_fragment, axis))
                 for axis in ID_AXES]
    id_values = itemgetter(*(ROW_INDEX[axis] for axis in ID_AXES))
    label_pieces = [_Memo(part) for _, part in LABEL_PARTS]
    label_values = itemgetter(*(ROW_INDEX[axis] for axis, _ in LABEL_PARTS))
    shape_problems = _Memo(lambda shape: shape_problem(*shape))  # as point_problem, asked once per shape
    shape_of = itemgetter(*(ROW_INDEX[axis] for axis in SHAPE_AXES))
    packing_problems = _Memo(lambda documents: packing_problem(*documents))
    documents_of = itemgetter(*(ROW_INDEX[axis] for axis in PACKING_AXES))
    cp_at = ROW_INDEX["cp"]
    for row in iter_rows(spec):
        point_id = id_of_fragments("".join(map(getitem, id_pieces, id_values(row))))
        label = "".join(map(getitem, label_pieces, label_values(row)))[1:]
        problem = shape_problems[shape_of(row)] or packing_problems[documents_of(row)]
        yield point_id, label, problem, row[cp_at]
