"""A run's identity: which spec made it and which points it holds, so ``--resume`` continues the same run.

``meta.json`` records ``spec_hash`` (the sha256 of the spec's canonical JSON: sorted keys, no spaces)
and ``point_ids`` (the ids of the points the spec expands to, in order). Resuming with another spec
(other axes, other timing options ...) would append records measured differently under a
``meta.json`` that describes the first; :func:`check_resume` refuses it, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4cp.records import META_FILE, read_meta, read_records

_SHOWN = 5
"""Differences named in an error; the rest are counted."""


def canonical_json(value: Any) -> str:
    """``value`` as JSON with sorted keys and no spaces; values JSON lacks (a YAML date) as strings,
    as ``meta.json`` stores them."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def spec_hash(source: dict) -> str:
    """The sha256 (hex) of a spec's canonical JSON (``SweepSpec.source``, or ``meta.json``'s ``spec``)."""
    return hashlib.sha256(canonical_json(source).encode()).hexdigest()


def identity_fields(source: dict, point_ids: Sequence[str]) -> dict:
    """The ``meta.json`` fields naming a run of the spec ``source`` expanding to ``point_ids``."""
    return {"spec_hash": spec_hash(source), "point_ids": list(point_ids)}


def check_resume(run_dir: Path, source: dict, point_ids: Sequence[str]) -> None:
    """``ValueError`` unless the run in ``run_dir`` may be continued by the spec ``source`` expanding to
    ``point_ids``: same spec as its ``meta.json`` (when it has one; an unreadable one is an error naming
    it), same points, and no record of a point the spec does not have."""
    if (run_dir / META_FILE).exists():
        meta = read_meta(run_dir)
        stored = meta.get("spec")
        stored_hash = meta.get("spec_hash") or (spec_hash(stored) if isinstance(stored, dict) else None)
        if stored_hash != spec_hash(source):
            differences = differences_between(stored, json.loads(canonical_json(source))) or [
                f"its {META_FILE} names no sweep spec"]
            raise ValueError(f"--resume: {run_dir} was run with another spec ({_listed(differences)}); resume it "
                             f"with the spec in its {META_FILE}, or choose another --out")
        stored_ids = meta.get("point_ids")
        if stored_ids is not None and list(stored_ids) != list(point_ids):
            new = len(set(point_ids) - set(stored_ids))
            gone = len(set(stored_ids) - set(point_ids))
            raise ValueError(f"--resume: the spec expands to other points than {run_dir}'s run ({new} new, {gone} "
                             "gone, or another order): the expansion changed since it started; choose another --out")
    known = set(point_ids)
    strangers = [record["point_id"] for record in read_records(run_dir) if record["point_id"] not in known]
    if strangers:
        raise ValueError(f"--resume: {run_dir} holds {len(strangers)} record(s) of points the spec does not have "
                         f"(e.g. {strangers[0]}); choose another --out")


def differences_between(old: Any, new: Any, where: str = "") -> list[str]:
    """Where two JSON values differ, as ``path: <old> in the run, <new> now`` lines (dict keys recursed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in [*old, *(k for k in new if k not in old)]:
            path = f"{where}.{key}" if where else str(key)
            if key not in new:
                out.append(f"{path}: only in the run")
            elif key not in old:
                out.append(f"{path}: only in the new spec")
            else:
                out.extend(differences_between(old[key], new[key], path))
        return out
    return [] if old == new else [f"{where or 'spec'}: {_short(old)} in the run, {_short(new)} now"]


def _listed(differences: list[str]) -> str:
    shown = "; ".join(differences[:_SHOWN])
    more = len(differences) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
