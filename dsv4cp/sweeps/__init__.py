"""Sweeps: YAML specs expanded into points, each measured on its CP group and recorded.

* ``spec``: ``load_spec(path) -> SweepSpec``, ``iter_points(spec)`` (lazy) / ``expand(spec) -> list[Point]``
  (pure, validated), ``point_problem(point)``: why a point cannot run; ``iter_rows(spec)``: the points as tuples.
* ``listing``: ``iter_listing(spec)``: each point's id, label and problem, as ``--dry-run`` lists them (no torch).
* ``measure``: ``measure_point(point, group, device, run)``, shared with ``dsv4cp profile``.
* ``runner``: ``run_sweep(spec, points, options)`` under torchrun or on spawned gloo ranks.
* ``run_lock``: one writer per run directory; ``identity``: the spec and points ``meta.json`` names.
* ``meta``: the run's ``meta.json`` fields (git sha, hardware, versions).
"""

from dsv4cp.sweeps.spec import (
    Point,
    RunOptions,
    SweepSpec,
    expand,
    iter_points,
    load_spec,
    make_point,
    parse_spec,
    point_problem,
)

__all__ = ["Point", "RunOptions", "SweepSpec", "expand", "iter_points", "load_spec", "make_point", "parse_spec",
           "point_problem"]
