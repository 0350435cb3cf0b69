"""Static context parallelism in the contiguous layout (DESIGN 3)."""

from dsv4cp.cp.layout import RankLayout, build_layout, halo_rows

__all__ = ["RankLayout", "build_layout", "halo_rows"]
