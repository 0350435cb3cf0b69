"""Analytic cost model of the CP DSv4 attention layer (docs/design.md §4.3, 5).

Per layer type, per rank, per phase and direction: FLOPs, HBM bytes, communication bytes and
roofline lower bounds from a :class:`Machine`'s ceilings, computed in closed form over documents
(no layout tensors), so it extrapolates to cp 64 and 1M tokens in milliseconds.

* :func:`estimate` -> :class:`LayerEstimate` (``.table()`` records, ``.summary(direction)``);
* :func:`extrapolate`: the comm/compute crossover over CP sizes and batch sizes;
* :func:`measured_vs_bound`: measurements beside the bounds;
* :func:`rank_counts`: the integer work counts underneath (valid keys, visible entries, owned groups).
"""

from dsv4cp.model.costs import (
    BOTH,
    COLUMNS,
    COMM_PHASES,
    DIRECTIONS,
    PHASES,
    DirectionSummary,
    LayerEstimate,
    estimate,
    layer_phases,
    measured_phase,
    nvtx_ranges,
    phase_directions,
    phase_measured_in,
    range_to_phase,
)
from dsv4cp.model.counts import RankCounts, document_extents, rank_counts
from dsv4cp.model.extrapolate import EXTRAPOLATE_COLUMNS, extrapolate, measured_vs_bound
from dsv4cp.model.machine import MACHINE_PRESETS, Machine

__all__ = [
    "BOTH", "COLUMNS", "COMM_PHASES", "DIRECTIONS", "EXTRAPOLATE_COLUMNS", "MACHINE_PRESETS", "PHASES",
    "DirectionSummary", "LayerEstimate", "Machine", "RankCounts", "document_extents", "estimate",
    "extrapolate", "layer_phases", "measured_phase", "measured_vs_bound", "nvtx_ranges", "phase_directions",
    "phase_measured_in", "range_to_phase", "rank_counts",
]
