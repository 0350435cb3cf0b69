"""Sweeps: YAML specs expanded into points, each measured on its CP group and recorded.

* ``spec``: ``load_spec(path) -> SweepSpec``, ``expand(spec) -> list[Point]`` (pure, validated).
* ``measure``: ``measure_point(point, group, device, run)``, shared with ``dsv4cp profile``.
* ``runner``: ``run_sweep(spec, options)`` under torchrun or on spawned gloo ranks.
* ``meta``: the run's ``meta.json`` fields (git sha, hardware, versions).
"""

from dsv4cp.sweeps.spec import Point, RunOptions, SweepSpec, expand, load_spec, make_point, parse_spec

__all__ = ["Point", "RunOptions", "SweepSpec", "expand", "load_spec", "make_point", "parse_spec"]
