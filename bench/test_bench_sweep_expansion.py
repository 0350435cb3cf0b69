"""``dsv4cp sweep SPEC --dry-run`` of a million points: the time and memory to expand, check and list them.

The million valid points of ``tests/sweeps/test_spec_scale.py`` (every point's id, label and whether it
can run). Target: the whole command in under 10 s on an idle core and under 200 MB of RSS.

* :func:`test_bench_dry_run_command_of_a_million_points`: the command in a fresh interpreter, its
  listing into a file; asserts it imports no torch and peaks under 200 MiB (its peak RSS is in
  ``extra_info``).
* :func:`test_bench_dry_run_listing_of_a_million_points`: the listing alone, in this process, into a
  discarded stream.

Measured on the 2-core development machine, shared and busy (load 7 to 8), the spec written to
/tmp/dryrun_million.yaml, with ``/usr/bin/time -v python -m dsv4cp sweep /tmp/dryrun_million.yaml
--dry-run > /dev/null``: before (torch imported first; per point a Point, a dict of its axes, their JSON, a
shape check cached with the seed) 97 s wall, 36.5 s user, 417 MB max RSS; after (no torch; per point a
row tuple, its id and label filled into per-block templates of cached per-value pieces) 11 s wall, 5.8 s
user, 42 MB max RSS (wall time here waits for the shared cores; user time is near what an idle core
takes). The listing is byte for byte the one before.
"""

from __future__ import annotations

import collections
import contextlib
import io

import yaml

from dsv4cp.cli.sweep import _dry_run
from dsv4cp.sweeps.spec import parse_spec
from tests.sweeps.test_spec_scale import MILLION_POINTS, run_cli_reporting

PEAK_RSS_KIB = 200 * 1024


class _Discard(io.TextIOBase):
    """A text stream that keeps nothing: the listing's cost without holding 100 MB of it."""

    def write(self, text: str) -> int:
        return len(text)


def test_bench_dry_run_command_of_a_million_points(benchmark, tmp_path):
    spec_path = tmp_path / "million.yaml"
    spec_path.write_text(yaml.safe_dump(MILLION_POINTS, sort_keys=False))
    listing = tmp_path / "listing.txt"

    def command() -> dict:
        with listing.open("w") as out:
            _, report = run_cli_reporting(["sweep", str(spec_path), "--dry-run"], out, timeout_s=600)
        return report

    report = benchmark.pedantic(command, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info["peak_rss_mib"] = report["peak_rss_kib"] / 1024
    assert report["code"] == 0 and report["heavy"] == []
    with listing.open() as lines:
        (last,) = collections.deque(lines, maxlen=1)  # the summary, without holding the million lines
    assert last == "1000000 points, spawning 16 ranks without torchrun\n"
    assert report["peak_rss_kib"] < PEAK_RSS_KIB, f"peaked at {report['peak_rss_kib'] / 1024:.0f} MiB"


def test_bench_dry_run_listing_of_a_million_points(benchmark):
    spec = parse_spec(MILLION_POINTS)

    def listing() -> int:
        with contextlib.redirect_stdout(_Discard()):
            return _dry_run(spec, nproc=None)

    assert benchmark.pedantic(listing, rounds=1, iterations=1, warmup_rounds=0) == 0
