"""Static context parallelism in the contiguous layout (docs/design.md §3)."""

import importlib

__all__ = ["RankLayout", "build_layout", "halo_rows", "roll_left", "roll_hidden_left"]

_PUBLIC = {"RankLayout": "dsv4cp.cp.layout", "build_layout": "dsv4cp.cp.layout", "halo_rows": "dsv4cp.cp.layout",
           "roll_left": "dsv4cp.cp.mtp", "roll_hidden_left": "dsv4cp.cp.mtp"}
"""Public name -> the module defining it, imported on first use: the row-split checks
(:mod:`dsv4cp.cp.partition`) are read without torch, which the layout and the collectives import."""


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
