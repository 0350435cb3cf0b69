"""Parity in the report: the ``sweep --check`` results (record field ``parity``).

A checked point's ``parity`` is a list of comparisons, one per quantity (output slice, selection,
indexer loss, input gradient, parameter gradients: ``dsv4cp.harness.parity.Comparison`` as a dict with
``quantity``, ``max_rel_error``, ``cosine``, ``passed``, ``worst``, and since the check compares against
the fp64 reference, ``rel_error`` and ``tolerance``; older records compared CP with CP = 1 and left
CP = 1 points unchecked). Points swept without ``--check`` hold None.
"""

from __future__ import annotations

import math

import pandas as pd

NOT_CHECKED = ""
"""The headline's parity cell of a point that was not checked (CP = 1, or no ``--check``)."""

FAILURE_COLUMNS: tuple[str, ...] = ("point_id", "quantity", "max_rel_error", "cosine", "worst")


def _comparisons(parity: object) -> list[dict]:
    return [c for c in parity if isinstance(c, dict)] if isinstance(parity, list) else []


def parity_cell(parity: object) -> str:
    """``passed (4)``, ``FAILED 1/4: x_grad`` or ``NOT_CHECKED``: one headline cell."""
    comparisons = _comparisons(parity)
    if not comparisons:
        return NOT_CHECKED
    failed = [c["quantity"] for c in comparisons if not c.get("passed")]
    if not failed:
        return f"passed ({len(comparisons)})"
    return f"FAILED {len(failed)}/{len(comparisons)}: {', '.join(failed)}"


def failure_count(parity: object) -> float:
    """Quantities that failed; NaN when the point was not checked."""
    comparisons = _comparisons(parity)
    return float(sum(not c.get("passed") for c in comparisons)) if comparisons else math.nan


def max_rel_error(parity: object) -> float:
    """Largest relative error over the checked quantities; NaN when the point was not checked."""
    errors = [float(c["max_rel_error"]) for c in _comparisons(parity) if c.get("max_rel_error") is not None]
    return max(errors) if errors else math.nan


def parity_failures(df: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """One row per failed quantity of every checked point: the point's ``axes``, its id, the quantity,
    its largest relative error, cosine similarity and (for a group such as the parameter gradients) the
    worst member. Empty when every checked quantity passed or nothing was checked."""
    rows = []
    for _, point in df.iterrows():
        for comparison in _comparisons(point["parity"]):
            if comparison.get("passed"):
                continue
            rows.append({**{a: point[a] for a in axes}, "point_id": point["point_id"],
                         "quantity": comparison["quantity"], "max_rel_error": comparison.get("max_rel_error"),
                         "cosine": comparison.get("cosine"), "worst": comparison.get("worst") or ""})
    return pd.DataFrame(rows, columns=[*axes, *FAILURE_COLUMNS])
