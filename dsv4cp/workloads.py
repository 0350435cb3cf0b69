"""Packed batches to measure on: fixed lengths, one long document, real-data length histograms
packed sequentially (shuffle, concatenate, cut) or best-fit (docs/design.md §5, Packing), or an adversarial
batch whose short documents and compressed groups straddle every CP rank boundary.

A packing is named by one string (the ``packing`` axis of sweeps and records): ``one``,
``fixed:<len>``, ``histogram``, ``histogram-bestfit``, ``adversarial`` or ``lengths:<a,b,...>``;
:func:`packing_lengths` turns such a name into document lengths."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4cp.packing import PackedSeqs

PACKINGS = ("one", "fixed", "histogram", "histogram-bestfit", "adversarial")


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
                 histogram: list[LengthBin] | None = None, cp: int | None = None,
                 ratio: int | None = None) -> list[int]:
    """Document lengths filling exactly ``total`` tokens.

    one: a single document. fixed: documents of ``doc_len`` (the last one cut). histogram: lengths
    drawn from ``histogram`` (default: the shipped one), concatenated in draw order and cut at
    ``total``. histogram-bestfit: a drawn document that does not fit whole is put back and another
    drawn, so long documents stay whole (worse load balance); only after many misses is one cut.
    adversarial: see :func:`adversarial_lengths` (needs ``cp`` and ``ratio``; ``doc_len`` is the
    longest short document).
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
    if packing == "adversarial":
        if cp is None or ratio is None:
            raise ValueError(f"packing: adversarial needs the cp and compress ratio, got cp={cp!r}, ratio={ratio!r}")
        return adversarial_lengths(total, cp, ratio, max_len=doc_len, seed=seed)
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


def straddle_offset(ratio: int) -> int:
    """Rows of the boundary-straddling document that lie before a rank boundary: inside its first
    compressed group (never a multiple of the ratio), so that group's rows sit on both ranks."""
    return ratio // 2 + 1 if ratio > 1 else 1


def adversarial_lengths(total: int, cp: int, ratio: int, *, max_len: int | None = None, seed: int = 0) -> list[int]:
    """Short documents, one straddling each of the ``cp - 1`` rank boundaries of an equal split.

    The straddling document starts :func:`straddle_offset` rows before the boundary and holds two
    whole compressed groups (``2 * ratio`` rows, at least 2), so its first group has rows on both
    sides of the boundary; every other document has a seeded length in ``[1, max_len]`` (default:
    ``max(2 * ratio, 8)``). Every rank therefore needs halo rows, a compressed entry assembled
    from two ranks and a document boundary near its start: the worst case for the CP layout.
    Raises ``ValueError`` when the rows per rank cannot hold the straddling document.
    """
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp: must be a positive int, got {cp!r}")
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 0:
        raise ValueError(f"ratio: must be a non-negative int, got {ratio!r}")
    if total % cp:
        raise ValueError(f"tokens: {total} rows are not divisible by cp={cp}")
    straddle_len = max(2 * ratio, 2)
    before = straddle_offset(ratio)
    max_len = max_len or max(2 * ratio, 8)
    if max_len < 1:
        raise ValueError(f"doc_len: the longest adversarial document must be positive, got {max_len}")
    rows = total // cp
    if cp > 1 and rows < straddle_len:
        raise ValueError(
            f"tokens: adversarial packing needs at least {straddle_len} rows per rank (two groups of ratio "
            f"{ratio}), got {rows} rows on each of {cp} ranks"
        )
    rng = random.Random(seed)
    lengths: list[int] = []
    position = 0

    def fill(until: int) -> None:  # short documents from ``position`` up to ``until``
        nonlocal position
        while position < until:
            n = min(rng.randint(1, max_len), until - position)
            lengths.append(n)
            position += n

    for boundary in range(rows, total, rows):
        fill(boundary - before)
        length = min(straddle_len, total - position)
        lengths.append(length)
        position += length
    fill(total)
    return lengths


def parse_packing(name: str) -> tuple[str, int | None, list[int] | None]:
    """``(kind, doc_len, lengths)`` of a packing name (see the module docstring); ``ValueError`` naming
    it and the allowed forms when malformed."""
    allowed = "one, fixed:<len>, histogram, histogram-bestfit, adversarial, lengths:<a,b,...>"
    if not isinstance(name, str):
        raise ValueError(f"packing: must be a string ({allowed}), got {name!r}")
    kind, _, argument = name.partition(":")
    try:
        if kind == "fixed" and argument:
            doc_len = int(argument)
            if doc_len > 0:
                return kind, doc_len, None
        elif kind == "lengths" and argument:
            lengths = [int(v) for v in argument.split(",")]
            if all(n >= 0 for n in lengths):
                return kind, None, lengths
        elif kind in PACKINGS and kind != "fixed" and not argument:
            return kind, None, None
    except ValueError:
        pass
    raise ValueError(f"packing: unknown packing {name!r}; allowed: {allowed}")


def packing_lengths(name: str, total: int, *, cp: int, ratio: int, seed: int = 0) -> list[int]:
    """Document lengths filling ``total`` tokens for the packing called ``name`` (``lengths:...`` must
    sum to at most ``total``; the rest is tail padding)."""
    kind, doc_len, lengths = parse_packing(name)
    if lengths is not None:
        if sum(lengths) > total:
            raise ValueError(f"packing: {name!r} holds {sum(lengths)} tokens, more than tokens={total}")
        return lengths
    return pack_lengths(total, kind, doc_len=doc_len, seed=seed, cp=cp, ratio=ratio)


def make_packed(total: int, packing: str = "one", **kwargs) -> PackedSeqs:
    from dsv4cp.packing import PackedSeqs  # torch: only here, the lengths (a sweep spec's checks) need none

    return PackedSeqs.from_lengths(pack_lengths(total, packing, **kwargs), total=total)
