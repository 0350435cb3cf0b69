"""Analytic cost model of the CP DSv4 attention layer (docs/design.md §4.3, 5).

Per layer type, per rank, per phase and direction: FLOPs, HBM bytes, communication bytes and
roofline lower bounds from a :class:`Machine`'s ceilings, computed in closed form over documents
(no layout tensors), so it extrapolates to cp 64 and 1M tokens in milliseconds.

* :func:`estimate` -> :class:`LayerEstimate` (``.table()`` records, ``.summary(direction)``);
* :func:`extrapolate`: the comm/compute crossover over CP sizes and batch sizes;
* :func:`measured_vs_bound`: measurements beside the bounds;
* :func:`rank_counts`: the integer work counts underneath (valid keys, visible entries, owned groups).
"""

from dsv4cp.lazy_exports import lazy_exports

_PUBLIC = {
    **dict.fromkeys(("BOTH", "COLUMNS", "COMM_PHASES", "DIRECTIONS", "PHASES", "DirectionSummary", "LayerEstimate",
                     "estimate", "layer_phases", "nvtx_ranges", "phase_directions", "range_to_phase"),
                    "dsv4cp.model.costs"),
    **dict.fromkeys(("RankCounts", "document_extents", "rank_counts"), "dsv4cp.model.counts"),
    **dict.fromkeys(("EXTRAPOLATE_COLUMNS", "extrapolate", "measured_vs_bound"), "dsv4cp.model.extrapolate"),
    **dict.fromkeys(("MACHINE_PRESETS", "Machine"), "dsv4cp.model.machine"),
}
"""Public name -> the module defining it, imported on first use: the machine presets (a command's
``--machine`` choices) are read without the cost model's modules, which import torch."""

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, _PUBLIC)
