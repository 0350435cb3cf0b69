"""Packed batches to measure on: fixed lengths, one long document, or real-data length histograms
packed sequentially (shuffle, concatenate, cut) or best-fit (DESIGN 5, Packing)."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from importlib import resources

from dsv4cp.packing import PackedSeqs

PACKINGS = ("one", "fixed", "histogram", "histogram-bestfit")


@dataclass(frozen=True)
class LengthBin:
    lo: int
    hi: int
    percent: float


def load_histogram(path: str | None = None) -> list[LengthBin]:
    """The document-length histogram (columns lo, hi, percent; '#' lines are comments).

    Default: the real pre-training corpus histogram shipped with the package.
    """
    if path is None:
        text = resources.files("dsv4cp.data").joinpath("doc_length_histogram.csv").read_text()
    else:
        with open(path) as handle:
            text = handle.read()
    rows = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    bins = [LengthBin(int(r["lo"]), int(r["hi"]), float(r["percent"])) for r in csv.DictReader(rows)]
    if not bins or any(b.lo > b.hi or b.percent < 0 for b in bins):
        raise ValueError(f"histogram: bins must satisfy lo <= hi and percent >= 0, got {bins!r}")
    return bins


def sample_lengths(bins: list[LengthBin], count: int, rng: random.Random) -> list[int]:
    """``count`` lengths: a bin by its share, then a length uniformly inside it (at least 1)."""
    chosen = rng.choices(bins, weights=[b.percent for b in bins], k=count)
    return [max(1, rng.randint(b.lo, b.hi)) for b in chosen]


def pack_lengths(total: int, packing: str = "one", *, doc_len: int | None = None, seed: int = 0,
                 histogram: list[LengthBin] | None = None) -> list[int]:
    """Document lengths filling exactly ``total`` tokens.

    one: a single document. fixed: documents of ``doc_len`` (the last one cut). histogram: lengths
    drawn from ``histogram`` (default: the shipped one), concatenated in draw order and cut at
    ``total``. histogram-bestfit: a drawn document that does not fit whole is put back and another
    drawn, so long documents stay whole (worse load balance); only after many misses is one cut.
    """
    if total <= 0:
        raise ValueError(f"total: must be positive, got {total}")
    if packing not in PACKINGS:
        raise ValueError(f"packing: must be one of {PACKINGS}, got {packing!r}")
    if packing == "one":
        return [total]
    if packing == "fixed":
        if not doc_len or doc_len <= 0:
            raise ValueError(f"doc_len: fixed packing needs a positive doc_len, got {doc_len!r}")
        return [doc_len] * (total // doc_len) + ([total % doc_len] if total % doc_len else [])
    rng = random.Random(seed)
    bins = histogram or load_histogram()
    lengths: list[int] = []
    room = total
    misses = 0
    while room > 0:
        (n,) = sample_lengths(bins, 1, rng)
        if n > room and packing == "histogram-bestfit" and misses < _BESTFIT_TRIES:
            misses += 1  # keep drawn documents whole: look for one that fits
            continue
        n = min(n, room)
        lengths.append(n)
        room -= n
        misses = 0
    return lengths


_BESTFIT_TRIES = 100
"""Draws best-fit packing tries for a document that fits before it cuts one to fill the end."""


def make_packed(total: int, packing: str = "one", **kwargs) -> PackedSeqs:
    return PackedSeqs.from_lengths(pack_lengths(total, packing, **kwargs), total=total)
