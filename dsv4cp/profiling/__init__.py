"""Measurement (docs/design.md §5): phase ranges, the timing protocol, memory points and the overlap analysis.

* ``nvtx``: the ``dsv4cp`` range table, ``nvtx_range``/``ranged`` and ``capture_range``.
* ``timing``: ``benchmark`` (warm-up, barrier per repetition, max over ranks).
* ``memory``: ``track_memory`` / ``sample_memory``.
* ``overlap``: interval math of the compute/communication breakdown table.
* ``trace``: Kineto capture and loading; ``nsys``: Nsight Systems SQLite loading.
"""

from dsv4cp.profiling.memory import MemorySample, sample_memory, track_memory
from dsv4cp.profiling.nvtx import PHASES, RANGE_NAMES, capture_range, nvtx_range, ranged, set_enabled
from dsv4cp.profiling.overlap import COLUMNS, KernelRecord, RangeRecord, kernel_table, overlap_table
from dsv4cp.profiling.timing import TimingResult, benchmark

__all__ = [
    "COLUMNS",
    "KernelRecord",
    "MemorySample",
    "PHASES",
    "RANGE_NAMES",
    "RangeRecord",
    "TimingResult",
    "benchmark",
    "capture_range",
    "kernel_table",
    "nvtx_range",
    "overlap_table",
    "ranged",
    "sample_memory",
    "set_enabled",
    "track_memory",
]
