"""``dsv4cp sweep SPEC --dry-run`` of a million points: the time to expand, check and list them.

The listing of :func:`dsv4cp.cli.sweep._dry_run` (every point's id, label and whether it can run,
written to a discarded stream) of the million valid points of ``tests/sweeps/test_spec_scale.py``.
Target: under 10 s on an idle core (the spec used to be expanded three times, as lists, taking minutes);
the peak memory of the expansion is checked by that test.
"""

from __future__ import annotations

import contextlib
import io

from dsv4cp.cli.sweep import _dry_run
from dsv4cp.sweeps.spec import parse_spec
from tests.sweeps.test_spec_scale import MILLION_POINTS


class _Discard(io.TextIOBase):
    """A text stream that keeps nothing: the listing's cost without holding 100 MB of it."""

    def write(self, text: str) -> int:
        return len(text)


def test_bench_dry_run_of_a_million_points(benchmark):
    spec = parse_spec(MILLION_POINTS)

    def listing() -> int:
        with contextlib.redirect_stdout(_Discard()):
            return _dry_run(spec, nproc=None)

    assert benchmark.pedantic(listing, rounds=1, iterations=1, warmup_rounds=0) == 0
