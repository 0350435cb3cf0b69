"""The project's per-rank overlap agrees with HolisticTraceAnalysis on a committed H200 trace.

HTA (``pip install HolisticTraceAnalysis``; checked with 0.5.0) is what users already run on Kineto
traces. Both sides classify kernels by name (NCCL = communication) and merge concurrent kernels before
measuring. HTA files memcpy/memset apart from computation; the project counts them as device work of
their phase, so the comparison drops them from the project's records first. Then:

* HTA's ``comp_comm_overlap_pctg`` (communication time overlapped by computation, %, rounded to
  0.01) equals 100 x the project's ``total`` ``overlap_ratio``;
* HTA's ``compute_time(us)`` (union of computation kernels) equals the project's ``total``
  ``compute_ms``, up to HTA rounding event times to whole microseconds (< 1% here).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsv4cp.profiling.overlap import TOTAL, overlap_table
from dsv4cp.report import load_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "h200x2-flash-c-async-trace-rank0.json.gz"
"""Rank 0's Kineto trace of a flash C layer step on 2 x H200, async overlap (a copy of
results/2026-11-30-h200x2-loss-target-kernels/trace_async_rank0.json.gz)."""
_COPY_PREFIXES = ("Memcpy", "Memset")
"""Kineto's names of copy-engine and memset work."""


def test_total_overlap_and_compute_agree_with_hta(tmp_path):
    trace_analysis = pytest.importorskip("hta.trace_analysis")
    shutil.copy(TRACE, tmp_path / TRACE.name)  # HTA reads every trace in a directory: give it only this one
    analysis = trace_analysis.TraceAnalysis(trace_dir=str(tmp_path))
    hta_overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    hta_time = analysis.get_temporal_breakdown(visualize=False).set_index("rank")

    kernels, ranges = load_trace(TRACE)
    assert any(k.name.startswith(_COPY_PREFIXES) for k in kernels)  # the filter below has work to do
    table = overlap_table([k for k in kernels if not k.name.startswith(_COPY_PREFIXES)], ranges)
    ours = table[table["phase"] == TOTAL].set_index("rank")
    assert list(ours.index) == list(hta_overlap.index) == [0]
    assert ours.loc[0, "comm_ms"] > 1.0  # the trace has real communication to compare
    assert 100 * ours.loc[0, "overlap_ratio"] == pytest.approx(hta_overlap.loc[0, "comp_comm_overlap_pctg"], abs=0.006)
    assert ours.loc[0, "compute_ms"] == pytest.approx(hta_time.loc[0, "compute_time(us)"] / 1e3, rel=0.01)
