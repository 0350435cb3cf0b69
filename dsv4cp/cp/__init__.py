"""Static context parallelism in the contiguous layout (docs/design.md §3)."""

from dsv4cp.cp.layout import RankLayout, build_layout, halo_rows
from dsv4cp.cp.mtp import roll_hidden_left, roll_left

__all__ = ["RankLayout", "build_layout", "halo_rows", "roll_left", "roll_hidden_left"]
