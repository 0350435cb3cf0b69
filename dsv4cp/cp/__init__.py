"""Static context parallelism in the contiguous layout (docs/design.md §3)."""

from dsv4cp.lazy_exports import lazy_exports

__all__ = ["RankLayout", "build_layout", "halo_rows", "roll_left", "roll_hidden_left"]

_PUBLIC = {"RankLayout": "dsv4cp.cp.layout", "build_layout": "dsv4cp.cp.layout", "halo_rows": "dsv4cp.cp.layout",
           "roll_left": "dsv4cp.cp.mtp", "roll_hidden_left": "dsv4cp.cp.mtp"}
"""Public name -> the module defining it, imported on first use: the row-split checks
(:mod:`dsv4cp.cp.partition`) are read without torch, which the layout and the collectives import."""

__getattr__ = lazy_exports(__name__, _PUBLIC)
