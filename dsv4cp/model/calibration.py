"""Calibration of the cost model on measured phase times: one efficiency factor per phase
class and direction, ``measured time / modelled bound``.

The roofline bounds of :mod:`dsv4cp.model.costs` are far from the measured phase times, and not by
one common factor: on an H200 the indexer's scoring + top-k runs ~6x its bound, the projections
~1.7x. A split balanced on the bounds therefore balances the wrong work. A :class:`Calibration`
holds the measured-over-bound factor of every phase class (:data:`PHASE_CLASSES`) in each direction;
:meth:`dsv4cp.model.row_costs.RowCosts.for_layer` scales its per-row costs by them and
:meth:`Calibration.rank_compute_s` scales the model's per-rank phase bounds.

Fitting (:func:`fit`) needs a profile's per-phase table (the ``overlap.csv`` that ``dsv4cp profile
--trace-dir`` writes, or a record's ``phases``) and the cost model of the same point: per class and
direction, the measured compute time summed over ranks divided by the summed bound. A CP = 1
profile is enough (its phases see the whole sequence); a CP > 1 profile checks the fit per rank.

Measured ranges map to classes by their NVTX names through :func:`dsv4cp.model.costs.measured_phase`:
the ``indexer.score`` ranges time the LOSS's differentiable scores at the selected entries, so they count
as ``loss``, while the selection's own scoring of every visible entry runs inside ``indexer.topk.fwd``,
whose time faces the model's ``indexer.score`` + ``indexer.topk`` bounds together (one ``indexer`` class).

The indexer's selection does not cost what the model counts on every backend: the model charges each
query its document's earlier entries (``visible``), the Triton top-k's static chunk plan scans every
entry of the batch before the query (``prefix``: other documents' columns too; the torch top-k too, given
``key_row_limit`` as the layer does), the torch top-k without it the whole gathered buffer (``all``).
``indexer_scan`` names the work the indexer factor is fitted on and applied to
(:data:`dsv4cp.model.phase_classes.INDEXER_SCANS`), priced per entry at the model's own per-visible-entry bound;
on one long document ``visible`` and ``prefix`` coincide, so only a multi-document profile tells them apart.

A calibration refitted on measured per-rank times (:mod:`dsv4cp.model.refit`) may also carry
``rank_factors``: per rank, the measured time over the class-calibrated one, the residual no phase class
expresses (fixed per-rank costs, the first rank's missing halo). They describe the ranks of one cp only, so
:meth:`Calibration.rank_compute_s` applies them at that cp and ignores them at any other
(:meth:`Calibration.rank_factors_note` says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dsv4cp.model.costs import BOTH, DIRECTIONS, LayerEstimate, measured_phase
from dsv4cp.model.phase_classes import INDEXER_SCANS, MODEL_PHASE_CLASS, PHASE_CLASSES
from dsv4cp.model.row_costs import scanned_slots
from dsv4cp.profiling.trace import POINT_FILE
from dsv4cp.records import RECORDS_FILE, read_records

SCHEMA = 1


def measured_class(range_name: str) -> tuple[str, str] | None:
    """``(phase class, direction)`` of a measured NVTX range (``dsv4cp.`` prefix optional), or None for
    ranges no class covers (``step``, communication, ``total``)."""
    phase = measured_phase(range_name)  # the loss's scores count as the loss (see the module docstring)
    if phase is None or phase[0] not in MODEL_PHASE_CLASS:
        return None
    return MODEL_PHASE_CLASS[phase[0]], phase[1]


@dataclass(frozen=True)
class Calibration:
    """Measured time / modelled bound per phase class and direction.

    Attributes:
        factors: ``{"<class>.<direction>": factor}``, e.g. ``{"indexer.fwd": 6.0}``; a class and
            direction not present (not measured) keeps factor 1.0.
        machine: the name of the :class:`~dsv4cp.model.Machine` whose ceilings gave the bounds (a
            calibration only applies with that machine).
        source: where the factors were fitted from (a path and the point), carried into records.
        indexer_scan: the entries the indexer's selection is charged for (:data:`INDEXER_SCANS`).
    """

    factors: dict[str, float]
    machine: str = ""
    source: str = ""
    indexer_scan: str = "visible"
    fitted: dict = field(default_factory=dict, compare=False)
    """Per factor, the measured and modelled milliseconds it came from (for the reader)."""
    rank_factors: tuple[float, ...] = ()
    """Per rank of the cp they were fitted at (their count), measured over class-calibrated time; empty: none.
    Applied only at that cp (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.indexer_scan not in INDEXER_SCANS:
            raise ValueError(f"calibration.indexer_scan: must be one of {INDEXER_SCANS}, got {self.indexer_scan!r}")
        keys = {f"{c}.{d}" for c in PHASE_CLASSES for d in DIRECTIONS}
        if not isinstance(self.factors, dict):
            raise ValueError(f"calibration.factors: must be a mapping, got {type(self.factors).__name__}")
        for key, value in self.factors.items():
            if key not in keys:
                raise ValueError(f"calibration.factors: unknown key {key!r}; keys are <class>.<fwd|bwd> with "
                                 f"class one of {PHASE_CLASSES}")
            if not _positive_finite(value):
                raise ValueError(f"calibration.factors[{key!r}]: must be a positive finite number, got {value!r}")
        if not isinstance(self.fitted, dict):
            raise ValueError(f"calibration.fitted: must be a mapping, got {type(self.fitted).__name__}")
        if not isinstance(self.rank_factors, tuple):
            raise ValueError(f"calibration.rank_factors: must be a tuple, got {type(self.rank_factors).__name__}")
        if len(self.rank_factors) == 1:
            raise ValueError("calibration.rank_factors: one per rank of a cp >= 2, got a single factor")
        for rank, value in enumerate(self.rank_factors):
            if not _positive_finite(value):
                raise ValueError(f"calibration.rank_factors[{rank}]: must be a positive finite number, got {value!r}")

    def factor(self, phase_class: str, direction: str) -> float:
        """The factor of ``phase_class`` in ``direction`` (``fwd`` or ``bwd``); 1.0 when not fitted."""
        if phase_class not in PHASE_CLASSES or direction not in DIRECTIONS:
            raise ValueError(f"phase class/direction: unknown pair ({phase_class!r}, {direction!r})")
        return float(self.factors.get(f"{phase_class}.{direction}", 1.0))

    @property
    def label(self) -> str:
        """A short name for records: the file or source it came from."""
        return self.source or "calibration"

    def rank_scale(self, cp: int) -> np.ndarray:
        """``[cp]`` per-rank factors applied at ``cp``: :attr:`rank_factors` when fitted at that cp, else ones."""
        if len(self.rank_factors) == cp:
            return np.asarray(self.rank_factors, dtype=float)
        return np.ones(cp)

    def rank_factors_note(self, cp: int) -> str | None:
        """A line for the output when this calibration's per-rank factors are ignored at ``cp``, else None."""
        if not self.rank_factors or len(self.rank_factors) == cp:
            return None
        return (f"note: {self.label}: its per-rank factors were fitted at cp {len(self.rank_factors)} and are "
                f"ignored at cp {cp} (ranks differ); its phase-class factors apply")

    # ------------------------------------------------------------------ applying
    def class_times(self, est: LayerEstimate) -> pd.DataFrame:
        """:func:`model_class_times` of ``est`` (on this calibration's indexer scan) with a
        ``calibrated_ms`` column: the bound times its class's factor."""
        times = model_class_times(est, self.indexer_scan)
        scale = [self.factor(c, d) for c, d in zip(times["phase_class"], times["direction"])]
        return times.assign(calibrated_ms=times["bound_ms"].to_numpy() * np.asarray(scale, dtype=float))

    def rank_compute_s(self, est: LayerEstimate, direction: str = BOTH) -> np.ndarray:
        """``[cp]`` calibrated compute time of each rank in ``fwd``, ``bwd`` or ``fwd+bwd`` (seconds): the
        class-calibrated times, scaled by the per-rank factors at the cp they were fitted at
        (:meth:`rank_scale`)."""
        if direction not in (*DIRECTIONS, BOTH):
            raise ValueError(f"direction: must be one of {(*DIRECTIONS, BOTH)}, got {direction!r}")
        times = self.class_times(est)
        if direction != BOTH:
            times = times[times["direction"] == direction]
        per_rank = times.groupby("rank")["calibrated_ms"].sum().reindex(range(est.cp), fill_value=0.0)
        return per_rank.to_numpy() * self.rank_scale(est.cp) / 1e3

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        values = {"schema": SCHEMA, "machine": self.machine, "source": self.source, "indexer_scan": self.indexer_scan,
                  "factors": dict(sorted(self.factors.items())), "fitted": self.fitted}
        if self.rank_factors:  # optional: files without it (older ones, CP = 1 fits) load alike
            values["rank_factors"] = list(self.rank_factors)
        return values

    @classmethod
    def from_dict(cls, values: object, source: str = "calibration") -> Calibration:
        if not isinstance(values, dict) or "factors" not in values:
            raise ValueError(f"{source}: must be a JSON object with 'factors', got {type(values).__name__}")
        if values.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"{source}: schema {values.get('schema')!r} is not {SCHEMA}")
        factors = values["factors"]
        if not isinstance(factors, dict):
            raise ValueError(f"{source}: 'factors' must be an object, got {type(factors).__name__}")
        fitted = values.get("fitted", {})
        if not isinstance(fitted, dict):
            raise ValueError(f"{source}: 'fitted' must be an object, got {type(fitted).__name__}")
        rank_factors = values.get("rank_factors", [])
        if not isinstance(rank_factors, list):
            raise ValueError(f"{source}: 'rank_factors' must be a list, got {type(rank_factors).__name__}")
        return cls(factors=dict(factors), machine=str(values.get("machine", "")),
                   source=str(values.get("source", "")), indexer_scan=values.get("indexer_scan", "visible"),
                   fitted=dict(fitted), rank_factors=tuple(rank_factors))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A calibration from its JSON file; ``ValueError`` naming the path when unreadable or malformed."""
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--calibration: cannot read {str(path)!r}: {err}") from err
        return cls.from_dict(values, source=f"--calibration {path}")


def _positive_finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return False
    return bool(np.isfinite(number) and number > 0)


# ---------------------------------------------------------------------------------- fitting
def class_times(measured: pd.DataFrame) -> pd.DataFrame:
    """Measured compute milliseconds per (rank, phase class, direction) of a per-phase table with
    columns ``rank``, ``phase`` (NVTX range names) and ``compute_ms``."""
    missing = {"rank", "phase", "compute_ms"} - set(measured.columns)
    if missing:
        raise ValueError(f"measured: the phase table lacks column(s) {sorted(missing)}")
    keys = [measured_class(name) for name in measured["phase"]]
    rows = [(int(r), k[0], k[1], float(ms)) for r, k, ms in zip(measured["rank"], keys, measured["compute_ms"]) if k]
    return (pd.DataFrame(rows, columns=["rank", "phase_class", "direction", "measured_ms"])
            .groupby(["rank", "phase_class", "direction"], as_index=False)["measured_ms"].sum())


def model_class_times(est: LayerEstimate, indexer_scan: str = "visible") -> pd.DataFrame:
    """Modelled bound milliseconds per (rank, phase class, direction) of ``est``; the indexer's on the
    entries ``indexer_scan`` counts (:func:`scanned_entries`) at the model's bound per visible entry."""
    if indexer_scan not in INDEXER_SCANS:
        raise ValueError(f"indexer_scan: must be one of {INDEXER_SCANS}, got {indexer_scan!r}")
    table = est.table()
    table = table[table["phase"].isin(MODEL_PHASE_CLASS.keys())]
    frame = pd.DataFrame({"rank": table["rank"], "phase_class": table["phase"].map(MODEL_PHASE_CLASS),
                          "direction": table["direction"], "bound_ms": table["time_lower_bound_s"] * 1e3})
    frame = frame.groupby(["rank", "phase_class", "direction"], as_index=False)["bound_ms"].sum()
    indexer = frame["phase_class"] == "indexer"
    if indexer_scan != "visible" and indexer.any():
        visible = est.counts.visible_entries.astype(float)
        per_entry = frame.loc[indexer, "bound_ms"].sum() / visible.sum() if visible.sum() > 0 else 0.0
        scanned = scanned_entries(est, indexer_scan)
        frame.loc[indexer, "bound_ms"] = per_entry * scanned[frame.loc[indexer, "rank"].to_numpy()]
    return frame


def scanned_entries(est: LayerEstimate, indexer_scan: str) -> np.ndarray:
    """``[cp]`` gathered entries (slots) the indexer's selection of each rank's rows scans under
    ``indexer_scan``: ``visible`` the model's count; ``prefix`` own row ``t`` of rank ``rho`` reads the
    slots below ``rho * capacity + t // r + 1`` (``RankLayout.key_row_limit``); ``all`` every slot of
    the gathered buffer, ``cp * capacity``. Slots are padded to the largest rank's entries, so an
    unequal split makes every later rank scan more."""
    c = est.counts
    if indexer_scan == "visible":
        return c.visible_entries.astype(float)
    rows = c.rank_rows.astype(np.int64)
    if indexer_scan == "prefix":
        before = np.arange(c.cp) * c.capacity  # earlier ranks' slots
        return (rows * before + scanned_slots(rows, est.ratio)).astype(float)
    return rows.astype(float) * c.gathered_rows


def fit(measured: pd.DataFrame, est: LayerEstimate, source: str = "", indexer_scan: str = "visible") -> Calibration:
    """Factors ``sum over ranks of measured ms / sum of bound ms`` per class and direction, from a
    per-phase table (see :func:`class_times`) of the point that ``est`` models (same layer, batch, cp
    and split), the indexer's bound on ``indexer_scan``'s entries. Classes the profile did not time,
    or whose bound is zero, are left out (factor 1)."""
    times = class_times(measured)
    if times.empty:
        raise ValueError("measured: no phase of the table belongs to a phase class (is it a dsv4cp profile?)")
    ranks = sorted(times["rank"].unique())
    if ranks != list(range(len(ranks))) or len(ranks) != est.cp:
        raise ValueError(f"measured: ranks {ranks} do not match the model's cp={est.cp}")
    both = times.merge(model_class_times(est, indexer_scan), on=["rank", "phase_class", "direction"], how="inner")
    summed = both.groupby(["phase_class", "direction"])[["measured_ms", "bound_ms"]].sum()
    factors, fitted = {}, {}
    for (phase_class, direction), row in summed.iterrows():
        if row["bound_ms"] > 0 and row["measured_ms"] > 0:
            key = f"{phase_class}.{direction}"
            factors[key] = float(row["measured_ms"] / row["bound_ms"])
            fitted[key] = {name: round(float(row[name]), 4) for name in ("measured_ms", "bound_ms")}
    return Calibration(factors=factors, machine=est.machine.name, source=source, indexer_scan=indexer_scan,
                       fitted=fitted)


POINT_CHECKS: tuple[str, ...] = ("preset", "ratio", "tokens", "packing", "loss")
"""What a profile must share with the point a calibration is fitted for (its cp is checked by :func:`fit`):
the layer, the batch size and the documents the batch holds (a one-document trace fits other phase times
than a histogram batch), and the indexer loss."""


@dataclass(frozen=True)
class Profile:
    """A profile's per-phase table and the point it measured (record axes; None when nothing says)."""

    table: pd.DataFrame
    point: dict | None
    source: str


def read_profile(path: str | Path, cp: int | None = None, want: dict | None = None) -> Profile:
    """The per-phase table of a profile and its point: an ``overlap*.csv`` (its point from the
    :data:`POINT_FILE` beside it, else from the record of its run: a sweep's ``traces/<point_id>/``
    under the run's ``records.jsonl``, or a ``records.jsonl`` in its folder, the folder above or that
    one's ``profile/``), a ``records.jsonl`` (the first ``ok`` record with ``phases`` at ``cp``,
    one agreeing with ``want`` on :data:`POINT_CHECKS` first), or a directory holding one of
    ``overlap.csv``, ``trace/overlap.csv``, ``records.jsonl``, ``profile/records.jsonl`` (first found).

    Records are read by the project's one loader (:func:`dsv4cp.records.read_records`): a line that is not
    a valid record is skipped with a warning naming ``file:line: reason``, never fitted."""
    path = Path(path)
    if path.is_dir():
        for name in ("overlap.csv", "trace/overlap.csv", "records.jsonl", "profile/records.jsonl"):
            if (path / name).is_file():
                return read_profile(path / name, cp, want)
        raise ValueError(f"--calibrate: {str(path)!r} holds no overlap.csv, trace/overlap.csv or records.jsonl")
    if not path.is_file():
        raise ValueError(f"--calibrate: no such file or directory {str(path)!r}")
    if path.suffix == ".csv":
        return Profile(pd.read_csv(path), _trace_point(path, cp, want), str(path))
    records = [r for r in read_records(path) if r.get("status") == "ok" and r.get("phases")
               and (cp is None or r.get("cp") == cp)]
    if not records:
        raise ValueError(f"--calibrate: {str(path)!r} has no ok record with per-phase times"
                         f"{'' if cp is None else f' at cp={cp}'}")
    record = _first_agreeing(records, want)
    return Profile(pd.DataFrame(record["phases"]), record, str(path))


def check_profile_point(profile: Profile, want: dict) -> None:
    """``ValueError`` naming both points unless ``profile`` measured ``want`` (on :data:`POINT_CHECKS`):
    factors fitted on another configuration or batch size describe another workload."""
    asked = " ".join(f"{k}={want[k]}" for k in POINT_CHECKS)
    if profile.point is None:
        raise ValueError(f"--calibrate: {profile.source!r} does not say which point it measured (no {POINT_FILE} "
                         f"beside it, no records.jsonl of its run); asked for {asked}: profile it again with "
                         f"--trace-dir, or pass the run's records.jsonl")
    differs = [k for k in (*POINT_CHECKS, "seed") if k in want and profile.point.get(k) != want[k]]
    if differs:
        got = ", ".join(f"{k}={profile.point.get(k)!r}" for k in differs)
        asked_for = ", ".join(f"{k}={want[k]!r}" for k in differs)
        raise ValueError(f"--calibrate: {profile.source!r} measured {got}, not {asked_for} (asked for ({asked})); "
                         "pass the profile of this point, or this command the profile's point")


def _first_agreeing(records: list[dict], want: dict | None) -> dict:
    """The first record agreeing with ``want`` on :data:`POINT_CHECKS` (one of forward + backward first: it
    fits both directions), else the first (which :func:`check_profile_point` then refuses, naming both)."""
    agreeing = [r for r in records if want is not None and all(r.get(k) == want.get(k) for k in want)]
    both = [r for r in agreeing if r.get("pass") == "fwd+bwd"]
    return (both or agreeing or records)[0]


def _trace_point(csv: Path, cp: int | None, want: dict | None) -> dict | None:
    """The point a trace's ``overlap.csv`` measured (see :func:`read_profile`), None when nothing says."""
    folder = csv.parent
    if (folder / POINT_FILE).is_file():
        try:
            return json.loads((folder / POINT_FILE).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--calibrate: {str(folder / POINT_FILE)!r} is not JSON: {err}") from err
    if folder.parent.name == "traces" and (folder.parent.parent / RECORDS_FILE).is_file():  # a sweep's trace
        run = read_records(folder.parent.parent / RECORDS_FILE)
        return next((r for r in run if r.get("point_id") == folder.name), None)
    for records in (folder, folder.parent, folder.parent / "profile"):
        records = records / RECORDS_FILE
        if records.is_file():
            ok = [r for r in read_records(records) if r.get("status") == "ok" and (cp is None or r.get("cp") == cp)]
            if ok:
                return _first_agreeing(ok, want)
    return None
