"""Expansion is lazy: a spec of a million points is listed one point at a time, in bounded memory.

The full million-point listing is timed by ``bench/test_bench_sweep_expansion.py``; here a prefix of
it is expanded under tracemalloc, which a list-building expansion could not do without first
building (and holding) every point.
"""

from __future__ import annotations

import itertools
import math
import tracemalloc

from dsv4cp.sweeps import spec as spec_module
from dsv4cp.sweeps.spec import iter_points, parse_spec, point_problem

MILLION_POINTS = {
    "name": "million",
    "base": {"preset": "tiny", "packing": "one"},
    "axes": {
        "cp": [1, 2, 4, 8, 16], "tokens": [1024, 2048, 4096, 8192, 16384], "ratio": [0, 4],
        "pass": ["fwd", "fwd+bwd"], "dtype": ["fp32", "bf16"], "overlap": ["none", "async"],
        "recompute": [False, True], "kernel_backend": ["torch", "auto"], "seed": list(range(625)),
    },
}
"""A million valid points (shared by the benchmark)."""

PREFIX = 20_000
PEAK_BYTES = 8 * 2**20
"""Bound on the memory expanding the prefix may allocate; a million points held at once take
hundreds of MiB (one Point with its dict and strings is several hundred bytes)."""


def test_a_million_point_spec_expands_lazily_in_bounded_memory():
    spec = parse_spec(MILLION_POINTS)
    assert math.prod(len(values) for values in spec.axes.values()) == 10**6
    tracemalloc.start()
    try:
        ids = set()
        for point in itertools.islice(iter_points(spec), PREFIX):
            assert point_problem(point) is None
            ids.add(point.point_id)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ids) == PREFIX  # distinct points (the id set itself is most of the peak)
    assert peak < PEAK_BYTES, f"expanding {PREFIX} points allocated {peak / 2**20:.1f} MiB at peak"
    assert spec_module._shape_problem.cache_info().currsize <= spec_module._shape_problem.cache_info().maxsize
