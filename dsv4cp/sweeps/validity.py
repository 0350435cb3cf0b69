"""Whether a point's shapes can run, checked before any launch: its config and documents
(:func:`point_inputs`), or why it cannot (:func:`point_problem`, cached per shape and per packing so a spec
of a million points is checked fast)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from operator import itemgetter

from dsv4cp.choices import check_head_dim
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import split_rows
from dsv4cp.sweeps.point import ROW_INDEX, Point
from dsv4cp.workloads import packing_lengths


def cannot_run_message(point_id: str, label: str, problem: str, invalid: int, total: int) -> str:
    """The refusal of a spec with ``invalid`` of its ``total`` points unable to run, naming the first."""
    return (f"point {point_id} ({label}) cannot run: {problem}; {invalid} of {total} points cannot "
            "(--dry-run marks them): exclude them or change the spec")


def check_points_can_run(points: Sequence[Point]) -> None:
    """``ValueError`` naming the first point whose shapes cannot run (:func:`point_problem`), before any launch."""
    problems = [(point, problem) for point in points if (problem := point_problem(point)) is not None]
    if problems:
        point, problem = problems[0]
        raise ValueError(cannot_run_message(point.point_id, point.label(), problem, len(problems), len(points)))


@functools.lru_cache(maxsize=64)
def _config(preset: str, loss: str) -> DSv4Config:
    return DSv4Config.preset(preset, indexer_loss=loss)


def checked_config(preset: str, loss: str, ratio: int) -> DSv4Config:
    """The point's config; ``ValueError`` naming the ratio when the preset cannot build it."""
    cfg = _config(preset, loss)
    try:
        cfg.check_ratio(ratio)
    except ValueError as err:
        raise ValueError(f"ratio: {ratio} with preset {preset!r}: {err}") from None
    return cfg


def _shape_config(preset: str, loss: str, ratio: int, cp: int, tokens: int, partition: str,
                  kernel_backend: str) -> DSv4Config:
    """The config of a point's shape; ``ValueError`` when the preset cannot build the ratio, a kernel backend
    named for other head dims, or (under the equal split) tokens not divisible by cp or fewer rows per rank
    than the halo."""
    cfg = checked_config(preset, loss, ratio)
    check_head_dim(kernel_backend, cfg.head_dim)
    if partition == "equal":
        split_rows(tokens, cp, cfg, ratio, field="tokens")
    return cfg


def point_inputs(point: Point) -> tuple[DSv4Config, list[int]]:
    """The point's config and document lengths; ``ValueError`` when its shapes cannot run (a ratio
    the preset cannot build, tokens not divisible by cp or fewer rows per rank than the halo under the
    equal split, documents that do not fit the tokens, a kernel backend named for other head dims)."""
    cfg = _shape_config(point.preset, point.loss, point.ratio, point.cp, point.tokens, point.partition,
                        point.kernel_backend)
    lengths = packing_lengths(point.packing, point.tokens, cp=point.cp, ratio=point.ratio, seed=point.seed)
    return cfg, lengths


def point_problem(point: Point) -> str | None:
    """Why ``point`` cannot run (the message :func:`point_inputs` raises), None when it can."""
    return row_problem(point.row())


SHAPE_AXES = ("preset", "loss", "ratio", "cp", "tokens", "partition", "kernel_backend")
"""The axes a point's shape checks read, in :func:`shape_problem`'s order."""
PACKING_AXES = ("packing", "tokens", "cp", "ratio", "seed")
"""The axes its documents are drawn from, in :func:`packing_problem`'s order."""
_shape_of = itemgetter(*(ROW_INDEX[axis] for axis in SHAPE_AXES))
_packing_of = itemgetter(*(ROW_INDEX[axis] for axis in PACKING_AXES))


def row_problem(row: Sequence) -> str | None:
    """:func:`point_problem` of a row of :func:`iter_rows`. Only the axes that shape the step are looked at,
    in two groups whose answers are cached apart: the axes neither group reads (dtype, pass, overlap,
    recompute, ...) multiply a spec's points without multiplying this work, and the seed multiplies only
    the documents' checks."""
    return shape_problem(*_shape_of(row)) or packing_problem(*_packing_of(row))


@functools.lru_cache(maxsize=4096)
def shape_problem(preset: str, loss: str, ratio: int, cp: int, tokens: int, partition: str,
                  kernel_backend: str) -> str | None:
    """Why a point of this shape cannot run (:func:`_shape_config`), None when it can."""
    try:
        _shape_config(preset, loss, ratio, cp, tokens, partition, kernel_backend)
    except ValueError as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=4096)
def packing_problem(packing: str, tokens: int, cp: int, ratio: int, seed: int) -> str | None:
    """Why the documents of this packing do not fit the tokens, None when they do."""
    try:
        packing_lengths(packing, tokens, cp=cp, ratio=ratio, seed=seed)
    except ValueError as err:
        return str(err)
    return None
