"""Per-row costs of the balanced split, derived from the cost model's accounting (docs/design.md §3.1, §4.3).

A row (a query) at document position ``t`` costs ``per_row + per_window_key * min(t + 1, W)
+ per_visible_entry * ((t + 1) // r) + per_compressed_key * keys_c(t)``, with ``keys_c`` the compressed
keys its attention reads (``min(K, visible)`` for C layers, ``visible`` for H). The four prices are
:func:`dsv4cp.model.costs.unit_costs`'s, summed per phase class (:mod:`dsv4cp.model.phase_classes`): the
same FLOP formulas, backward factors and projection counts as the layer estimate, so the per-row costs
summed over a rank's rows equal the estimate's FLOPs of that rank without its halo rows (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.costs import BOTH, DIRECTIONS, unit_costs
from dsv4cp.model.machine import Machine
from dsv4cp.model.phase_classes import INDEXER_SCANS, MODEL_PHASE_CLASS, PHASE_CLASSES, PhaseFactors

SPLIT_DIRECTIONS: tuple[str, ...] = (*DIRECTIONS, BOTH)
"""What a balanced split equalises: one pass, or a training step (``fwd+bwd``)."""

_SCAN_TERM = {"prefix": 4, "all": 5}
"""Where an indexer scan other than ``visible`` moves the indexer's per-entry price in :class:`RowCosts`."""


@dataclass(frozen=True)
class RowCosts:
    """Cost of one row (a query) as a linear function of its work counts (see the module docstring).

    Rows of the tail padding segment cost ``per_row`` only (they are projected but see no key). On C
    layers every row ``g`` of the batch also costs ``per_prefix_entry * (g // r + 1)`` and
    ``per_batch_entry * (T // r)``: the indexer scans of :data:`INDEXER_SCANS` (the gathered slots a
    query's top-k scans, as with equal slices; unequal ones pad every rank's slots to the largest, which
    the model's evaluation counts and this per-row cost cannot). Units are whatever the builder chose
    (FLOPs, or seconds at a machine's ceilings); only ratios matter.
    """

    per_row: float
    per_window_key: float = 0.0
    per_visible_entry: float = 0.0
    per_compressed_key: float = 0.0
    per_prefix_entry: float = 0.0
    per_batch_entry: float = 0.0

    @classmethod
    def for_layer(cls, cfg: DSv4Config, ratio: int, machine: Machine | None = None, direction: str = BOTH,
                  calibration: PhaseFactors | None = None, kernel_options: KernelOptions = DEFAULT_OPTIONS,
                  ) -> RowCosts:
        """The per-row costs of a ``ratio`` layer of ``cfg`` in ``direction`` (``fwd``, ``bwd`` or
        ``fwd+bwd``: a training step, the default).

        Without ``machine`` the unit is one FLOP and memory-bound work is not counted; with a machine
        (any object with ``peak_flops`` and ``hbm_bandwidth``) the unit is one second at its ceilings:
        FLOPs at its peak, plus the top-k's reads of one fp32 score per visible entry (the selection
        does no FLOPs). ``calibration`` (needs ``machine``, the one it was fitted against) multiplies each
        phase class's seconds in each direction by its measured factor and charges the indexer on the
        entries its ``indexer_scan`` says the kernel scans. ``kernel_options``: the options the step runs
        (the indexer loss's scores: :func:`~dsv4cp.model.costs.loss_takes_selection_scores`).
        """
        if direction not in SPLIT_DIRECTIONS:
            raise ValueError(f"direction: must be one of {SPLIT_DIRECTIONS}, got {direction!r}")
        if calibration is not None and machine is None:
            raise ValueError("machine: a calibration scales seconds at a machine's ceilings; pass the machine "
                             "its factors were fitted against")
        fitted_on = getattr(calibration, "machine", "")
        if calibration is not None and fitted_on and fitted_on != machine.name:
            raise ValueError(f"calibration.machine: fitted against the ceilings of {fitted_on!r}, applied with "
                             f"machine {machine.name!r}; refit it for that machine (dsv4cp model --calibrate)")
        scan = "visible" if calibration is None else calibration.indexer_scan
        if scan not in INDEXER_SCANS:
            raise ValueError(f"calibration.indexer_scan: must be one of {INDEXER_SCANS}, got {scan!r}")
        total = np.zeros(6)
        for pass_ in DIRECTIONS:
            if direction not in (pass_, BOTH):
                continue
            for phase_class, terms in class_unit_costs(cfg, ratio, pass_, machine, kernel_options).items():
                terms = np.append(terms, [0.0, 0.0])
                if phase_class == "indexer" and scan != "visible":  # the same per-entry price, other entries
                    terms[_SCAN_TERM[scan]], terms[2] = terms[2], 0.0
                total += terms * (1.0 if calibration is None else calibration.factor(phase_class, pass_))
        return cls(*(float(v) for v in total))


def class_unit_costs(cfg: DSv4Config, ratio: int, direction: str, machine: Machine | None = None,
                     kernel_options: KernelOptions = DEFAULT_OPTIONS) -> dict[str, np.ndarray]:
    """Per phase class, the ``[per_row, per_window_key, per_visible_entry, per_compressed_key]`` cost of
    one pass (``fwd`` or ``bwd``) from :func:`unit_costs`: FLOPs, or seconds at ``machine``'s ceilings
    (then the top-k's bytes per visible entry count at its memory bandwidth)."""
    units = unit_costs(cfg, ratio, kernel_options=kernel_options)
    terms = {name: np.zeros(4) for name in PHASE_CLASSES}
    for phase, by_direction in units.items():
        if direction in by_direction:
            terms[MODEL_PHASE_CLASS[phase]] += by_direction[direction]["flops"]
    if machine is not None:
        terms = {name: value / machine.peak_flops for name, value in terms.items()}
        topk = units.get("indexer.topk", {}).get(direction)
        if topk is not None:  # the selection reads every visible entry's score: memory-bound, no FLOPs
            terms["indexer"][2] += topk["hbm_bytes"][2] / machine.hbm_bandwidth
    return terms


def row_costs(costs: RowCosts, cu_padded: np.ndarray, total: int, cfg: DSv4Config, ratio: int) -> np.ndarray:
    """``[total]`` float64 cost of every row of a batch with padded document offsets ``cu_padded``."""
    end = int(cu_padded[-1])
    lengths = np.diff(cu_padded)
    u = np.arange(1, end + 1, dtype=np.int64) - np.repeat(cu_padded[:-1], lengths)  # position + 1
    cost = np.full(total, costs.per_row)  # the tail padding rows are projected and see nothing
    inside = cost[:end]
    inside += costs.per_window_key * np.minimum(u, cfg.window)
    if ratio:
        visible = u // ratio
        keys = np.minimum(visible, cfg.index_topk) if layer_kind(ratio) == "C" else visible
        inside += costs.per_visible_entry * visible + costs.per_compressed_key * keys
        if layer_kind(ratio) == "C":
            cost += costs.per_prefix_entry * (np.arange(total) // ratio + 1)
            cost += costs.per_batch_entry * (total // ratio)
    return cost


def scanned_slots(rows: np.ndarray | int, ratio: int) -> np.ndarray:
    """``sum_{t=0}^{n-1} (t // ratio + 1)`` for each ``n`` in ``rows``: the gathered slots that the
    ``prefix`` indexer scan reads for a rank's first ``n`` rows (the bound ``t // r + 1`` of
    ``RankLayout.key_row_limit``), in closed form, exact in int64."""
    n = np.asarray(rows, dtype=np.int64)
    q, rem = n // ratio, n % ratio
    return ratio * q * (q + 1) // 2 + rem * (q + 1)


def slice_costs(prefix: np.ndarray, split: RowSplit) -> np.ndarray:
    """``[cp]`` summed cost of each rank's rows, from ``prefix = [0, cumsum(row costs)]``."""
    b = np.asarray(split.bounds)
    return prefix[b[1:]] - prefix[b[:-1]]
