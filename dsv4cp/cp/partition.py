"""Row splits of the contiguous CP layout (docs/design.md §3.1): the split points, their checks, the halo floor.

A :class:`RowSplit` is the list of split points ``0 = b_0 <= ... <= b_cp = T``; rank ``rho`` holds
the rows ``[b_rho, b_{rho+1})``. The ``equal`` policy gives every rank ``T / cp`` rows; the ``balanced``
one moves the boundaries so that every rank's modelled work is the same. Costs are the cost model's, so
the balanced split is computed above this package (:func:`dsv4cp.model.partition.partition`) and
reaches the CP layer as a :class:`RowSplit`; this module holds only what every split obeys: contiguous
slices from 0 to ``T``, each at least the halo that its successor borrows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsv4cp.config import DSv4Config, layer_kind

POLICIES = ("equal", "balanced")
"""Row split policies: ``T / cp`` rows each, or slices of equal modelled cost (:mod:`dsv4cp.model.partition`)."""


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RowSplit:
    """Split points of ``T`` rows over ``cp`` ranks: rank ``rho`` holds ``[bounds[rho], bounds[rho + 1])``."""

    bounds: tuple[int, ...]

    @classmethod
    def equal(cls, total: int, cp: int, field: str = "packed.total") -> RowSplit:
        """``T / cp`` rows per rank; ``ValueError`` naming ``field`` when ``cp`` does not divide ``T``."""
        check_positive_int("cp", cp)
        if total % cp:
            raise ValueError(f"{field}: {total} rows are not divisible by cp={cp}")
        rows = total // cp
        return cls(tuple(rho * rows for rho in range(cp + 1)))

    @property
    def cp(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def start(self, rank: int) -> int:
        return self.bounds[rank]

    def rows(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    @property
    def rank_rows(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def max_rows(self) -> int:
        return max(self.rank_rows)

    @property
    def min_rows(self) -> int:
        return min(self.rank_rows)

    @property
    def is_equal(self) -> bool:
        return len(set(self.rank_rows)) == 1

    def validate(self, total: int, cp: int, min_rows: int = 1, field: str = "split") -> RowSplit:
        """``self`` when it splits ``total`` rows over ``cp`` ranks, each holding ``>= min_rows`` rows;
        otherwise ``ValueError`` naming ``field`` (call it before any collective, on every rank)."""
        bounds = self.bounds
        if not isinstance(bounds, tuple) or not all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in bounds
        ):
            raise ValueError(f"{field}.bounds: must be a tuple of ints, got {bounds!r}")
        if len(bounds) != cp + 1:
            raise ValueError(f"{field}.bounds: must hold cp + 1 = {cp + 1} split points, got {len(bounds)}")
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"{field}.bounds: must run from 0 to packed.total={total}, got {bounds[0]}..{bounds[-1]}")
        rows = self.rank_rows
        if any(n < 0 for n in rows):
            raise ValueError(f"{field}.bounds: must be non-decreasing, got {bounds}")
        smallest = min(rows)
        if cp > 1 and smallest < min_rows:  # one rank exchanges no halo: even an empty batch is legal
            rank = rows.index(smallest)
            raise ValueError(
                f"{field}: rank {rank} holds {smallest} rows, fewer than the {min_rows} it needs "
                f"(the halo of max(window, compression reach) rows, at least 1); bounds={bounds}"
            )
        return self


def as_split(split: RowSplit | Sequence[int] | None, total: int, cp: int, min_rows: int = 1,
             field: str = "split") -> RowSplit:
    """A validated :class:`RowSplit`: ``None`` means equal slices; a sequence is taken as the bounds."""
    if split is None:
        split = RowSplit.equal(total, cp)
    elif not isinstance(split, RowSplit):
        if isinstance(split, (str, bytes)) or not hasattr(split, "__iter__"):
            raise ValueError(f"{field}: must be a RowSplit or a sequence of split points, got {split!r}")
        split = RowSplit(tuple(split))
    return split.validate(total, cp, min_rows, field)


def compression_reach(compress_ratio: int) -> int:
    """Rows before an owned group's last row that its entry reads (``d`` of docs/design.md §3.2)."""
    if compress_ratio == 0:
        return 0
    return 2 * compress_ratio if layer_kind(compress_ratio) == "C" else compress_ratio


def halo_rows(cfg: DSv4Config, compress_ratio: int, cp: int) -> int:
    """Rows each rank borrows from its predecessor: ``max(W, d_comp)``, none without CP."""
    return 0 if cp == 1 else max(cfg.window, compression_reach(compress_ratio))


def split_rows(
    total: int, cp: int, cfg: DSv4Config, compress_ratio: int, field: str = "packed.total"
) -> tuple[int, int]:
    """``(rows per rank, halo rows)`` of ``total`` rows over ``cp`` ranks; ``ValueError`` naming ``field``
    when the rows do not divide evenly or a rank would hold fewer rows than the halo it must send."""
    if total % cp:
        raise ValueError(f"{field}: {total} rows are not divisible by cp={cp}")
    rows = total // cp
    halo = halo_rows(cfg, compress_ratio, cp)
    if rows < halo:
        raise ValueError(
            f"{field}: each of the {cp} ranks holds {rows} rows, fewer than the halo of {halo} rows "
            f"(max(window, compression reach)); use fewer ranks or more tokens"
        )
    return rows, halo


def floor_rows(cfg: DSv4Config, ratio: int, cp: int, min_rows: int | None) -> int:
    """The fewest rows a rank may hold: ``min_rows`` (checked to be a positive int), default the
    layer's halo, at least 1."""
    if min_rows is None:
        return max(halo_rows(cfg, ratio, cp), 1)
    check_positive_int("min_rows", min_rows)
    return min_rows
