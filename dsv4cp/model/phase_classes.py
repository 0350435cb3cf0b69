"""Phase classes: the groups of cost-model phases that one calibration factor scales, per direction.

The per-row costs of the balanced split (:mod:`dsv4cp.model.row_costs`) and the calibration
(:mod:`dsv4cp.model.calibration`) both price work per class: the indexer's scoring + top-k selection,
sparse (window + compressed) attention, the matrix projections (queries, window KV, output, indexer
queries and head weights), both compressors, the indexer loss.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

PHASE_CLASSES: tuple[str, ...] = ("indexer", "attention", "projections", "compressors", "loss")
"""The classes, in the order the per-row costs and calibration tables list them."""

MODEL_PHASE_CLASS: dict[str, str] = {
    "indexer.score": "indexer", "indexer.topk": "indexer", "sparse_attn": "attention",
    "q_proj": "projections", "kv_proj": "projections", "out_proj": "projections",
    "indexer.q_proj": "projections", "compress": "compressors", "indexer.compress": "compressors",
    "indexer.loss": "loss",
}
"""The class of every compute phase of :mod:`dsv4cp.model.costs` (communication phases have none)."""

INDEXER_SCANS: tuple[str, ...] = ("visible", "prefix", "all")
"""Which entries the indexer's top-k pays for per query: ``visible`` (the entries of its own document
before it: the cost model's count), ``prefix`` (every entry of the batch before it, other documents'
included: the static chunk plans of the Triton and torch top-k under ``key_row_limit``, whose columns
start at key row 0) or ``all`` (every entry of the batch: the torch top-k without ``key_row_limit``)."""


class PhaseFactors(Protocol):
    """Measured time over modelled bound per phase class and direction (e.g. a
    :class:`dsv4cp.model.calibration.Calibration`), the indexer scan its factor was fitted on and the
    machine whose bounds it was fitted against (empty: not recorded)."""

    indexer_scan: str
    machine: str

    def factor(self, phase_class: str, direction: str) -> float: ...

    def rank_scale(self, cp: int) -> np.ndarray:
        """``[cp]`` per-rank factors on the ranks' times at ``cp`` (ones where there are none)."""
        ...
