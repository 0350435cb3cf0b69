"""Expansion is lazy: a spec of a million points is listed one point at a time, in bounded memory.

The full million-point listing (time and peak RSS of the command) is measured by
``bench/test_bench_sweep_expansion.py``; here a prefix of it is listed under tracemalloc, which a
list-building expansion could not do without first building (and holding) every point.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

from dsv4cp.sweeps import spec as spec_module
from dsv4cp.sweeps.listing import iter_listing
from dsv4cp.sweeps.spec import iter_points, parse_spec

ROOT = Path(__file__).resolve().parents[2]

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

PREFIX = 200_000
PEAK_BYTES = 4 * 2**20
"""Bound on the memory listing the prefix may allocate at its peak; the prefix's rows alone, held at once,
take about 50 MiB (a tuple of 19 values and its derived ints, some 250 bytes a point)."""

_RUN_AND_REPORT = """
import json, re, sys
from dsv4cp.cli.main import main
code = main(sys.argv[1:])
sys.stdout.flush()
heavy = sorted(name for name in ("torch", "triton", "pandas") if name in sys.modules)
peak = int(re.search(r"VmHWM:\\s*(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"code": code, "heavy": heavy, "peak_rss_kib": peak}), file=sys.stderr)
"""
"""Runs the CLI, then says on stderr's last line its exit code, which heavy modules it imported and its peak
RSS (VmHWM: the getrusage peak would count the forking pytest process, which holds torch)."""


def run_cli_reporting(argv: list[str], stdout, timeout_s: float) -> tuple[str, dict]:
    """Run ``dsv4cp ARGV`` in a fresh interpreter (this tree first on the path) with its standard output into
    ``stdout`` (a file, or ``subprocess.PIPE``); its stderr lines but the last, and its report (exit code,
    the heavy modules imported, peak RSS in KiB)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _RUN_AND_REPORT, *argv], cwd=ROOT, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout_s, check=False)
    *errors, report = done.stderr.strip().splitlines()
    return "\n".join(errors), {**json.loads(report), "stdout": done.stdout}


def test_a_million_point_spec_is_listed_lazily_in_bounded_memory():
    spec = parse_spec(MILLION_POINTS)
    assert math.prod(len(values) for values in spec.axes.values()) == 10**6
    listed = itertools.islice(iter_listing(spec), PREFIX)
    next(listed)  # the memos' first values and the checks' configs, before the measurement
    tracemalloc.start()
    try:
        count = sum(1 for _, _, problem, _ in listed if problem is None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == PREFIX - 1  # every point can run
    assert peak < PEAK_BYTES, f"listing {PREFIX} points allocated {peak / 2**20:.1f} MiB at peak"
    for cache in (spec_module.shape_problem, spec_module.packing_problem):
        assert cache.cache_info().currsize <= cache.cache_info().maxsize


def test_points_of_a_million_point_spec_are_distinct():
    ids = {point.point_id for point in itertools.islice(iter_points(parse_spec(MILLION_POINTS)), 20_000)}
    assert len(ids) == 20_000
