"""Predicted per-rank balance of the row-split policies (docs/design.md §3.1): equal slices against the
cost-balanced split, from the analytic cost model.

:func:`compare_policies` splits a batch under each policy (the balanced one with the model's per-row
costs at ``machine``'s ceilings, :meth:`dsv4cp.cp.partition.RowCosts.for_layer`), evaluates the cost
model on each split and reports, forward + backward, the slowest rank's compute bound and its ratio
to the mean (the imbalance a rank waiting in a collective shows as exposed communication).

With a :class:`~dsv4cp.model.calibration.Calibration` both the balanced split and the reported
per-rank compute times use the calibrated (measured-like) phase times instead of the bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import POLICIES, RowSplit, partition
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.costs import BOTH, estimate
from dsv4cp.model.counts import DocsLike, document_extents
from dsv4cp.model.machine import Machine

POLICY_COLUMNS = (
    "policy", "cp", "tokens", "split", "min_rows", "max_rows", "max_compute_s", "mean_compute_s",
    "compute_imbalance", "max_bound_overlap_s", "bound_imbalance",
)
"""Columns of :func:`compare_policies` (times in seconds per rank, in the compared direction)."""


def policy_split(
    cfg: DSv4Config, ratio: int, docs: DocsLike, cp: int, policy: str, machine: Machine | None = None,
    total: int | None = None, align: int = 1, direction: str = BOTH, calibration: Calibration | None = None,
) -> RowSplit:
    """The split of ``docs`` over ``cp`` ranks under ``policy``, balanced on the model's per-row times
    in ``direction`` (``fwd+bwd``: a training step), scaled by ``calibration`` when given."""
    cu, total = document_extents(docs, total)
    lengths = np.diff(cu).tolist()
    return partition(lengths, cp, cfg, ratio, policy=policy, machine=machine or Machine(), align=align,
                     total=total, direction=direction, calibration=calibration)


def compare_policies(
    cfg: DSv4Config, ratio: int, docs: DocsLike, cp: int, machine: Machine | None = None,
    total: int | None = None, *, policies: Sequence[str] = POLICIES, align: int = 1, direction: str = BOTH,
    calibration: Calibration | None = None,
) -> pd.DataFrame:
    """One row per policy (columns :data:`POLICY_COLUMNS`): the split and the predicted per-rank
    compute bound in ``direction`` (max, mean, max / mean) and layer bound with overlap.

    The default ``fwd+bwd`` is a training step: its ranks meet at the start of forward (halo,
    all-gathers) and at the end of backward (the reduce-scatters' deferred waits, the halo gradient),
    so the step takes the slowest rank's forward + backward. With ``calibration`` the compute times
    are the calibrated ones (:meth:`Calibration.rank_compute_s`)."""
    machine = machine or Machine()
    rows = []
    for policy in policies:
        split = policy_split(cfg, ratio, docs, cp, policy, machine, total, align, direction, calibration)
        est = estimate(cfg, ratio, docs, cp, machine, total, split=split)
        step = est.summary(direction)
        if calibration is None:
            compute = np.asarray(step.rank_compute_s)
        else:
            compute = calibration.rank_compute_s(est, direction)
        bound = np.maximum(compute, np.asarray(step.rank_comm_s))
        rows.append({
            "policy": policy, "cp": cp, "tokens": split.total, "split": split.bounds,
            "min_rows": split.min_rows, "max_rows": split.max_rows,
            "max_compute_s": float(compute.max()), "mean_compute_s": float(compute.mean()),
            "compute_imbalance": _ratio(compute), "max_bound_overlap_s": float(bound.max()),
            "bound_imbalance": _ratio(bound),
        })
    return pd.DataFrame(rows, columns=list(POLICY_COLUMNS))


def _ratio(values: np.ndarray) -> float:
    mean = values.mean()
    return float(values.max() / mean) if mean > 0 else 1.0
