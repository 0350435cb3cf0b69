"""Interval math of the breakdown and overlap table (docs/design.md §5), shared by the Kineto and nsys loaders.

Inputs are plain records: kernels (GPU kernels, copies and memsets, or CPU ops for a CPU-only trace)
and named ranges, all on one clock in nanoseconds. Output is one row per (rank, phase) plus a ``total`` row per rank:

    rank, phase, compute_ms, comm_ms, overlap_ms, overlap_ratio, exposed_comm_ms, idle_ms

Definitions, all as lengths of unions of intervals (kernels on several streams that run at the same
time count once):

* ``compute_ms``: union of the phase's compute kernels.
* ``comm_ms``: union of the phase's communication kernels (name starts with ``nccl``, any case).
* ``overlap_ms``: the part of the phase's communication during which ANY compute kernel of the rank
  runs (compute launched by another phase hides a collective just as well).
* ``overlap_ratio``: overlap / comm; NaN when the phase has no communication. Compute overlaps
  communication only where it runs on another stream (thread): a CPU op enclosing a blocking collective
  on its own thread waits for it, and hides none of it.
* ``exposed_comm_ms``: comm - overlap.
* ``idle_ms``: the phase's window minus the union of ALL kernels of the rank inside it.

Attribution rules (the ``total`` row needs none):

1. A kernel belongs to the innermost range enclosing its launch time (the CUDA API call that
   enqueued it), or its start time when it has no launch information. Ranges are half-open
   ``[start, end)``. Innermost = greatest nesting depth, then latest start, then earliest end.
   Depth, unless given, is inferred by time containment among all ranges of the rank across
   threads, so backward ranges on autograd's thread nest inside the main thread's step range.
   Kernels outside every range count only in ``total``.
2. A kernel attributed by its launch counts whole: it runs asynchronously, usually after its
   launching range has ended, and all of it is that phase's work. A kernel attributed by its start
   is clipped to the range for the per-phase numbers (the part past the range's end is the device
   still busy while the host is in the next phase, which this rule cannot assign); ``total`` counts
   it whole.
3. The window of one range instance is the span from the first start to the last end of the
   kernels LAUNCHED inside it (its children's included, like Kineto's ``gpu_user_annotation``);
   when nothing launched inside it carries launch information, the range itself. A phase's window
   is the union of its instances' windows. The ``total`` window is the capture window when given,
   else first kernel start to last kernel end.

``attribution_table`` sums up, per rank, how much of the step the phases account for (its
targets: at most 5% of the step unattributed, at most 3% idle):

    rank, step_ms, busy_ms, unattributed_ms, unattributed_pct, idle_ms, idle_pct

* ``step_ms``: the step range's window (rule 3: its instances' windows, united); without a step
  range, the capture window when given, else first kernel start to last kernel end.
* ``busy_ms``: the part of that window during which some kernel of the rank runs.
* ``unattributed_ms``: the part during which only kernels of no phase run (attributed to the step
  range itself or to no range): work that runs beside a phase's kernel is not unattributed time (in
  a CPU-only trace an op enclosing a phase's range then counts only outside its children).
* ``idle_ms``: step_ms - busy_ms. Percentages are of ``step_ms``.

``step_decomposition`` cuts every instant of a rank's step into compute, waiting for a slower peer,
exposed transfer or idle (docs/design.md §5, "Diagnosis"); unlike the table above, a host thread counts
as computing only while its innermost running record is a compute op.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

COLUMNS: tuple[str, ...] = (
    "rank", "phase", "compute_ms", "comm_ms", "overlap_ms", "overlap_ratio", "exposed_comm_ms", "idle_ms",
)
"""Columns of ``overlap_table``, in order."""

KERNEL_COLUMNS: tuple[str, ...] = ("rank", "phase", "kernel", "is_comm", "count", "time_ms")
"""Columns of ``kernel_table``, in order."""

TOTAL = "total"
"""Phase name of the per-rank row over the whole captured window."""

ATTRIBUTION_COLUMNS: tuple[str, ...] = (
    "rank", "step_ms", "busy_ms", "unattributed_ms", "unattributed_pct", "idle_ms", "idle_pct",
)
"""Columns of ``attribution_table``, in order."""

UNATTRIBUTED_TARGET_PCT = 5.0
"""Target: at most this share (percent) of the step may run in no phase."""

IDLE_TARGET_PCT = 3.0
"""Target: at most this share (percent) of the step may pass with no kernel running."""

UNATTRIBUTED = "(unattributed)"
"""Phase name, in ``kernel_table`` only, of kernels outside every range."""

_NS_PER_MS = 1e6


def is_comm_kernel(name: str) -> bool:
    """docs/design.md §5: kernels whose names start with ``nccl`` (case-insensitive) are communication."""
    return name.lower().startswith("nccl")


@dataclass(frozen=True)
class KernelRecord:
    """One kernel execution (or one CPU op of a CPU-only trace); times in ns on the ranges' clock."""

    rank: int
    stream: int
    """CUDA stream id (thread id for CPU ops); informational, unions ignore it."""
    start_ns: int
    end_ns: int
    name: str
    is_comm: bool
    launch_ns: int | None = None
    """Start of the API call that launched it; None when the trace cannot tell."""

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(
                f"end_ns must be >= start_ns, got start_ns={self.start_ns} end_ns={self.end_ns} ({self.name})"
            )


@dataclass(frozen=True)
class RangeRecord:
    """One instance of a named range (NVTX or record_function); times in ns."""

    rank: int
    name: str
    start_ns: int
    end_ns: int
    depth: int | None = None
    """Nesting depth (0 = outermost); None: inferred from time containment."""

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(
                f"end_ns must be >= start_ns, got start_ns={self.start_ns} end_ns={self.end_ns} ({self.name})"
            )


# ---------------------------------------------------------------------------------------------
# Interval sets: pairs of int64 arrays (starts, ends).

_Intervals = tuple[np.ndarray, np.ndarray]
_EMPTY: _Intervals = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def _union(intervals: _Intervals) -> _Intervals:
    """Disjoint, sorted intervals covering the same points."""
    starts, ends = intervals
    if starts.size == 0:
        return _EMPTY
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    opens = np.empty(starts.size, dtype=bool)
    opens[0] = True
    opens[1:] = starts[1:] > reach[:-1]  # a gap before this interval starts a new merged one
    first = np.flatnonzero(opens)
    last = np.append(first[1:] - 1, starts.size - 1)
    return starts[first], reach[last]


def _length(intervals: _Intervals) -> int:
    starts, ends = _union(intervals)
    return int((ends - starts).sum())


def _concat(*sets: _Intervals) -> _Intervals:
    return np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets])


def _intersection_length(a: _Intervals, b: _Intervals) -> int:
    """|A and B| = |A| + |B| - |A or B|."""
    return _length(a) + _length(b) - _length(_concat(a, b))


def _select(intervals: _Intervals, mask: np.ndarray) -> _Intervals:
    return intervals[0][mask], intervals[1][mask]


def _minus(a: _Intervals, b: _Intervals) -> _Intervals:
    """The points of ``a`` outside ``b``, as disjoint sorted intervals."""
    (a_starts, a_ends), (b_starts, b_ends) = _union(a), _union(b)
    kept: list[tuple[int, int]] = []
    first = 0
    for start, end in zip(a_starts.tolist(), a_ends.tolist()):
        while first < b_starts.size and b_ends[first] <= start:
            first += 1
        cursor, k = start, first
        while k < b_starts.size and b_starts[k] < end:
            if b_starts[k] > cursor:
                kept.append((cursor, int(b_starts[k])))
            cursor = max(cursor, int(b_ends[k]))
            k += 1
        if cursor < end:
            kept.append((cursor, end))
    return _as_intervals(kept)


def _hiding_compute(kernels: list[KernelRecord], intervals: _Intervals, is_comm: np.ndarray) -> _Intervals:
    """When compute can hide communication: a compute record's time, less the time its own stream spends
    in a collective. A GPU stream runs one kernel at a time, so nothing changes there; a CPU op
    enclosing a blocking collective on its thread (an autograd function's, the step's) is that thread
    waiting, not computing beside it: counted as compute, it would hide the whole collective."""
    streams = np.fromiter((k.stream for k in kernels), np.int64, len(kernels))
    parts = []
    for stream in np.unique(streams).tolist():
        mine = streams == stream
        parts.append(_minus(_select(intervals, mine & ~is_comm), _select(intervals, mine & is_comm)))
    return _concat(*parts) if parts else _EMPTY


# ---------------------------------------------------------------------------------------------
# Attribution of one rank's kernels to its ranges.


def _infer_depths(ranges: list[RangeRecord]) -> list[int]:
    """Depth = number of ranges open when this one starts (earlier start, or same start and longer)."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i].start_ns, -ranges[i].end_ns))
    depths = [0] * len(ranges)
    open_ends: list[int] = []
    for i in order:
        open_ends = [end for end in open_ends if end > ranges[i].start_ns]
        depths[i] = len(open_ends)
        open_ends.append(ranges[i].end_ns)
    return [r.depth if r.depth is not None else d for r, d in zip(ranges, depths)]


@dataclass
class _Attribution:
    """One rank's kernels with their phase and per-phase (possibly clipped) intervals."""

    kernels: list[KernelRecord]
    intervals: _Intervals
    """Whole kernel intervals, in ``kernels`` order."""
    is_comm: np.ndarray
    phase: list[str | None]
    """Phase of each kernel; None outside every range."""
    phase_intervals: _Intervals
    """Kernel intervals clipped per rule 2 (unattributed kernels: whole)."""
    windows: dict[str, list[tuple[int, int]]]
    """Window of every range instance, per phase; phases in order of first start (outer first on ties)."""


def _attribute(kernels: list[KernelRecord], ranges: list[RangeRecord]) -> _Attribution:
    n = len(kernels)
    starts = np.fromiter((k.start_ns for k in kernels), np.int64, n)
    ends = np.fromiter((k.end_ns for k in kernels), np.int64, n)
    has_launch = np.fromiter((k.launch_ns is not None for k in kernels), bool, n)
    keys = np.where(has_launch, np.fromiter((k.launch_ns or 0 for k in kernels), np.int64, n), starts)
    is_comm = np.fromiter((k.is_comm for k in kernels), bool, n)

    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    owner = np.full(n, -1, dtype=np.int64)
    depths = _infer_depths(ranges)
    precedence = sorted(range(len(ranges)), key=lambda i: (depths[i], ranges[i].start_ns, -ranges[i].end_ns))
    windows: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i in sorted(range(len(ranges)), key=lambda i: (ranges[i].start_ns, -ranges[i].end_ns)):
        r = ranges[i]
        lo, hi = np.searchsorted(sorted_keys, [r.start_ns, r.end_ns], side="left")
        launched = by_key[lo:hi][has_launch[by_key[lo:hi]]]
        if launched.size:
            windows[r.name].append((int(starts[launched].min()), int(ends[launched].max())))
        else:
            windows[r.name].append((r.start_ns, r.end_ns))
    for i in precedence:  # deeper (then later, then shorter) ranges overwrite their ancestors
        lo, hi = np.searchsorted(sorted_keys, [ranges[i].start_ns, ranges[i].end_ns], side="left")
        owner[by_key[lo:hi]] = i

    range_ends = np.array([r.end_ns for r in ranges] + [0], np.int64)  # index -1 (no range) -> dummy
    clip = (owner >= 0) & ~has_launch
    # attributed by its start, a kernel starts inside its range: only its end can need clipping
    phase_ends = np.where(clip, np.minimum(ends, range_ends[owner]), ends)
    return _Attribution(
        kernels=kernels,
        intervals=(starts, ends),
        is_comm=is_comm,
        phase=[ranges[o].name if o >= 0 else None for o in owner.tolist()],
        phase_intervals=(starts, phase_ends),
        windows=dict(windows),
    )


# ---------------------------------------------------------------------------------------------
# Tables.


def _row(rank: int, phase: str, work: _Intervals, is_comm: np.ndarray, all_compute: _Intervals,
         all_kernels: _Intervals, window: _Intervals) -> dict[str, object]:
    """One table row from a phase's (clipped) kernels and window and the rank's whole kernel sets."""
    compute = _length(_select(work, ~is_comm))
    comm_set = _select(work, is_comm)
    comm = _length(comm_set)
    overlap = _intersection_length(comm_set, all_compute)
    idle = _length(window) - _intersection_length(window, all_kernels)
    return {
        "rank": rank,
        "phase": phase,
        "compute_ms": compute / _NS_PER_MS,
        "comm_ms": comm / _NS_PER_MS,
        "overlap_ms": overlap / _NS_PER_MS,
        "overlap_ratio": overlap / comm if comm > 0 else float("nan"),
        "exposed_comm_ms": (comm - overlap) / _NS_PER_MS,
        "idle_ms": idle / _NS_PER_MS,
    }


def _group_by_rank(
    kernels: Iterable[KernelRecord], ranges: Iterable[RangeRecord]
) -> tuple[dict[int, list[KernelRecord]], dict[int, list[RangeRecord]]]:
    kernels_of: dict[int, list[KernelRecord]] = defaultdict(list)
    ranges_of: dict[int, list[RangeRecord]] = defaultdict(list)
    for k in kernels:
        kernels_of[k.rank].append(k)
    for r in ranges:
        ranges_of[r.rank].append(r)
    return kernels_of, ranges_of


def overlap_table(
    kernels: Iterable[KernelRecord],
    ranges: Iterable[RangeRecord],
    windows: Mapping[int, tuple[int, int]] | None = None,
) -> pd.DataFrame:
    """Per-rank, per-phase breakdown (columns ``COLUMNS``; times in ms) plus a ``total`` row per rank.

    ``windows`` optionally gives each rank's capture window ``(start_ns, end_ns)`` for its ``total``
    row. Phases appear in order of their first range start (the enclosing one first when two start
    together); ``total`` comes last for each rank.
    """
    kernels_of, ranges_of = _group_by_rank(kernels, ranges)
    windows = dict(windows or {})
    rows: list[dict[str, object]] = []
    for rank in sorted(set(kernels_of) | set(ranges_of) | set(windows)):
        att = _attribute(kernels_of[rank], ranges_of[rank])
        all_compute = _hiding_compute(att.kernels, att.intervals, att.is_comm)
        names = np.array([p or "" for p in att.phase], dtype=object)  # "" never names a range
        for phase, instance_windows in att.windows.items():
            mask = names == phase
            rows.append(_row(rank, phase, _select(att.phase_intervals, mask), att.is_comm[mask],
                             all_compute, att.intervals, _as_intervals(instance_windows)))
        total_window = _capture_window(rank, windows, att.intervals)
        rows.append(_row(rank, TOTAL, att.intervals, att.is_comm, all_compute, att.intervals, total_window))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def kernel_table(kernels: Iterable[KernelRecord], ranges: Iterable[RangeRecord]) -> pd.DataFrame:
    """Kernels per phase: launch count and summed (clipped) duration in ms, by kernel name.

    Columns ``KERNEL_COLUMNS``; kernels outside every range appear under ``UNATTRIBUTED`` with their
    whole duration. Sorted by rank, then phase, then time descending.
    """
    kernels_of, ranges_of = _group_by_rank(kernels, ranges)
    rows: list[dict[str, object]] = []
    for rank in sorted(kernels_of):
        att = _attribute(kernels_of[rank], ranges_of[rank])
        durations = att.phase_intervals[1] - att.phase_intervals[0]
        stats: dict[tuple[str, str, bool], list[int]] = defaultdict(lambda: [0, 0])
        for kernel, phase, duration in zip(att.kernels, att.phase, durations.tolist()):
            entry = stats[(phase or UNATTRIBUTED, kernel.name, kernel.is_comm)]
            entry[0] += 1
            entry[1] += duration
        for (phase, name, comm), (count, ns) in stats.items():
            rows.append({"rank": rank, "phase": phase, "kernel": name, "is_comm": comm,
                         "count": count, "time_ms": ns / _NS_PER_MS})
    table = pd.DataFrame(rows, columns=list(KERNEL_COLUMNS))
    return table.sort_values(["rank", "phase", "time_ms"], ascending=[True, True, False], ignore_index=True)


def attribution_table(
    kernels: Iterable[KernelRecord],
    ranges: Iterable[RangeRecord],
    step_range: str,
    windows: Mapping[int, tuple[int, int]] | None = None,
) -> pd.DataFrame:
    """Per rank: the step's busy, unattributed and idle time (columns ``ATTRIBUTION_COLUMNS``; times in
    ms per step, averaged over the rank's ``step_range`` instances; shares in percent of ``step_ms``;
    see the module docstring).

    ``step_range``: the full name of the range around each step (``dsv4cp.step``); its instances
    nest every phase, so a kernel whose innermost range is the step itself is in no phase.
    ``windows``: each rank's capture window, used only for a rank without the step range (one "step").
    """
    kernels_of, ranges_of = _group_by_rank(kernels, ranges)
    windows = dict(windows or {})
    rows: list[dict[str, object]] = []
    for rank in sorted(set(kernels_of) | set(ranges_of) | set(windows)):
        att = _attribute(kernels_of[rank], ranges_of[rank])
        if step_range in att.windows:
            step_windows = _as_intervals(att.windows[step_range])
        else:
            step_windows = _capture_window(rank, windows, att.intervals)
        outside = np.array([phase is None or phase == step_range for phase in att.phase], dtype=bool)
        step = _length(step_windows)
        busy = _intersection_length(step_windows, att.intervals)
        in_phases = _intersection_length(step_windows, _select(att.intervals, ~outside))
        unattributed = busy - in_phases
        per_step = _NS_PER_MS * max(1, len(step_windows[0]))  # the steps this rank's trace holds
        rows.append({
            "rank": rank,
            "step_ms": step / per_step,
            "busy_ms": busy / per_step,
            "unattributed_ms": unattributed / per_step,
            "unattributed_pct": 100.0 * unattributed / step if step > 0 else float("nan"),
            "idle_ms": (step - busy) / per_step,
            "idle_pct": 100.0 * (step - busy) / step if step > 0 else float("nan"),
        })
    return pd.DataFrame(rows, columns=list(ATTRIBUTION_COLUMNS))


def _as_intervals(spans: list[tuple[int, int]]) -> _Intervals:
    return np.array([s for s, _ in spans], np.int64), np.array([e for _, e in spans], np.int64)


def _capture_window(rank: int, windows: Mapping[int, tuple[int, int]], kernels: _Intervals) -> _Intervals:
    """The rank's capture window when given, else first kernel start to last kernel end (none: empty)."""
    if rank in windows:
        return _as_intervals([windows[rank]])
    starts, ends = kernels
    return _as_intervals([(int(starts.min()), int(ends.max()))]) if starts.size else _EMPTY


def attribution_lines(table: pd.DataFrame) -> list[str]:
    """One line per rank of an ``attribution_table``: unattributed and idle time, in ms and percent of
    the step, each against its target (``UNATTRIBUTED_TARGET_PCT``, ``IDLE_TARGET_PCT``)."""

    def share(ms: float, pct: float, target: float) -> str:
        verdict = "n/a" if np.isnan(pct) else ("met" if pct <= target else "missed")
        return f"{ms:.3f} ms ({pct:.1f}% of the step; target <= {target:g}%: {verdict})"

    return [
        f"rank {int(r.rank)}: step {r.step_ms:.3f} ms, unattributed "
        f"{share(r.unattributed_ms, r.unattributed_pct, UNATTRIBUTED_TARGET_PCT)}, idle "
        f"{share(r.idle_ms, r.idle_pct, IDLE_TARGET_PCT)}"
        for r in table.itertuples(index=False)
    ]


# ---------------------------------------------------------------------------------------------
# Step decomposition (docs/design.md §5, "Diagnosis of one step"): what each instant of a rank's step is.

DECOMPOSITION_COLUMNS: tuple[str, ...] = (
    "rank", "steps", "step_ms", "compute_ms", "imbalance_wait_ms", "exposed_comm_ms", "unmatched_comm_ms",
    "host_idle_ms",
)
"""Columns of ``step_decomposition`` (times per step)."""

PHASE_COMPUTE_COLUMNS: tuple[str, ...] = ("rank", "phase", "kernel", "compute_ms")
"""Columns of ``step_decomposition``'s second table: exclusive compute time per phase and kernel name."""

_Segment = tuple[int, int, int]
"""``(start_ns, end_ns, index)``: an elementary time segment and the record it belongs to."""


def collective_kind(name: str) -> str:
    """What a communication record is, for matching its instances across ranks by order: point-to-point
    transfers (a rank's send is its peer's receive) are one kind, every other collective its own name."""
    lowered = name.lower()
    return "p2p" if "send" in lowered or "recv" in lowered else lowered


def _innermost(starts: np.ndarray, ends: np.ndarray, keys: list[tuple], members: Iterable[int]) -> list[_Segment]:
    """Cut the union of the ``members`` intervals into segments, each owned by the covering member of
    the greatest key (``(start, -end)``: the latest-starting, then the shortest, i.e. the innermost op
    of a host thread, or the most recently started of concurrent kernels)."""
    by_start = sorted(members, key=lambda i: starts[i])
    if not by_start:
        return []
    points = sorted({int(starts[i]) for i in by_start} | {int(ends[i]) for i in by_start})
    heap: list[tuple[tuple, int]] = []
    out: list[_Segment] = []
    nxt = 0
    for t0, t1 in zip(points[:-1], points[1:]):
        while nxt < len(by_start) and starts[by_start[nxt]] <= t0:
            i = by_start[nxt]
            heapq.heappush(heap, (tuple(-k for k in keys[i]), i))  # max-heap on the key
            nxt += 1
        while heap and ends[heap[0][1]] <= t0:  # lazy removal: only the owner must still run
            heapq.heappop(heap)
        if heap:
            owner = heap[0][1]
            if out and out[-1][2] == owner and out[-1][1] == t0:
                out[-1] = (out[-1][0], t1, owner)
            else:
                out.append((t0, t1, owner))
    return out


def _clip_segments(segments: list[_Segment], windows: _Intervals) -> list[_Segment]:
    """The parts of ``segments`` inside the (disjoint, sorted) ``windows``."""
    w_starts, w_ends = _union(windows)
    out = []
    for start, end, index in segments:
        i = int(np.searchsorted(w_ends, start, side="right"))
        while i < w_starts.size and w_starts[i] < end:
            lo, hi = max(start, int(w_starts[i])), min(end, int(w_ends[i]))
            if hi > lo:
                out.append((lo, hi, index))
            i += 1
    return out


def _segments_as_intervals(segments: list[_Segment]) -> _Intervals:
    return np.array([s for s, _, _ in segments], np.int64), np.array([e for _, e, _ in segments], np.int64)


@dataclass(frozen=True)
class _Instance:
    """One collective instance on one rank: a stream's (thread's) merged communication records."""

    start_ns: int
    end_ns: int
    kind: str


def _instances(att: _Attribution, windows: _Intervals) -> list[_Instance]:
    """The rank's collective instances that reach into a step window, by kind then start."""
    spans: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for kernel, comm in zip(att.kernels, att.is_comm.tolist()):
        if comm:
            spans[kernel.stream].append((kernel.start_ns, kernel.end_ns, kernel.name))
    w_starts, w_ends = _union(windows)
    out = []
    for stream_spans in spans.values():
        stream_spans.sort(key=lambda s: (s[0], -s[1]))
        merged: list[list] = []
        for start, end, name in stream_spans:
            if merged and start < merged[-1][1]:  # nested in (or overlapping) the open instance: part of it
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end, collective_kind(name)])
        for start, end, kind in merged:
            i = int(np.searchsorted(w_ends, start, side="right"))
            if i < w_starts.size and w_starts[i] < end:
                out.append(_Instance(start, end, kind))
    return sorted(out, key=lambda inst: (inst.kind, inst.start_ns))


def _transfer_times(instances_of: dict[int, list[_Instance]]) -> dict[int, list[int | None]]:
    """Per rank and instance, the transfer time in ns: the shortest duration among the ranks' instances
    of the same kind and order; None where the ranks hold different numbers of that kind (no match)."""
    ranks = sorted(instances_of)
    out: dict[int, list[int | None]] = {rank: [None] * len(instances_of[rank]) for rank in ranks}
    if len(ranks) < 2:
        return out
    positions: dict[int, dict[str, list[int]]] = {}
    for rank in ranks:
        positions[rank] = defaultdict(list)
        for index, inst in enumerate(instances_of[rank]):
            positions[rank][inst.kind].append(index)
    kinds = set().union(*(positions[rank].keys() for rank in ranks))
    for kind in kinds:
        lists = [positions[rank].get(kind, []) for rank in ranks]
        if len({len(x) for x in lists}) != 1:
            continue
        for order in range(len(lists[0])):
            members = [(rank, lists[j][order]) for j, rank in enumerate(ranks)]
            transfer = min(instances_of[r][i].end_ns - instances_of[r][i].start_ns for r, i in members)
            for rank, index in members:
                out[rank][index] = transfer
    return out


def step_decomposition(
    kernels: Iterable[KernelRecord], ranges: Iterable[RangeRecord], step_range: str,
    windows: Mapping[int, tuple[int, int]] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per rank, every instant of its steps as exactly one of compute, imbalance wait, exposed transfer
    or host idle (columns ``DECOMPOSITION_COLUMNS``, ms per step, averaged over the ``step_range``
    instances as ``attribution_table`` does), and the compute split by phase and kernel name (columns
    ``PHASE_COMPUTE_COLUMNS``, ms per step; they sum to ``compute_ms``).

    * A stream (host thread) computes while its innermost running record is a compute kernel: a host
      op blocked in a send nested inside an autograd function's op is communicating, not computing.
      ``compute_ms`` is the union of that over the rank's streams.
    * Collective instances: per stream, overlapping communication records merged (a gloo op and its
      nested copies are one instance); they are matched across ranks by order within their
      :func:`collective_kind`. ``transfer`` = the shortest of the matched durations; the first
      ``duration - transfer`` of an instance is the rank waiting for a slower peer, the rest is the
      transfer. ``imbalance_wait_ms``: the wait not covered by compute; ``exposed_comm_ms``: the
      transfer covered by neither. An instance without a match (ranks hold different numbers of its
      kind, or the trace holds one rank) counts whole as transfer; ``unmatched_comm_ms`` is the part
      of ``exposed_comm_ms`` it accounts for.
    * ``host_idle_ms``: no record running at all.
    * The compute split: each compute instant goes to the most recently started computing record
      (concurrent kernels: the newer; nested host ops: the inner), under that record's phase (rule
      1); work of the step range itself keeps its name, work in no range is ``UNATTRIBUTED``.

    ``step_ms = compute_ms + imbalance_wait_ms + exposed_comm_ms + host_idle_ms`` up to rounding.
    """
    kernels_of, ranges_of = _group_by_rank(kernels, ranges)
    windows = dict(windows or {})
    ranks = sorted(set(kernels_of) | set(ranges_of) | set(windows))
    attributions, step_windows, instances_of = {}, {}, {}
    for rank in ranks:
        att = attributions[rank] = _attribute(kernels_of[rank], ranges_of[rank])
        step_windows[rank] = (_as_intervals(att.windows[step_range]) if step_range in att.windows
                              else _capture_window(rank, windows, att.intervals))
        instances_of[rank] = _instances(att, step_windows[rank])
    transfers = _transfer_times(instances_of)
    rows, phase_rows = [], []
    for rank in ranks:
        att, steps = attributions[rank], step_windows[rank]
        starts, ends = att.intervals
        keys = [(int(s), -int(e)) for s, e in zip(starts.tolist(), ends.tolist())]
        by_stream: dict[int, list[int]] = defaultdict(list)
        for index, kernel in enumerate(att.kernels):
            by_stream[kernel.stream].append(index)
        computing: list[_Segment] = []
        for members in by_stream.values():
            computing += [s for s in _innermost(starts, ends, keys, members) if not att.is_comm[s[2]]]
        computing = _clip_segments(computing, steps)
        compute = _segments_as_intervals(computing)
        waits, moves, unmatched = [], [], []
        for inst, transfer in zip(instances_of[rank], transfers[rank]):
            if transfer is None:
                unmatched.append((inst.start_ns, inst.end_ns))
                continue
            split = inst.end_ns - transfer
            waits.append((inst.start_ns, split))
            moves.append((split, inst.end_ns))
        wait_set, move_set, unmatched_set = (_clip_intervals(_as_intervals(spans), steps)
                                             for spans in (waits, moves, unmatched))
        covered = _length(compute)
        exposed_moves = _length(_concat(compute, move_set)) - covered
        covered += exposed_moves
        exposed_unmatched = _length(_concat(compute, move_set, unmatched_set)) - covered
        covered += exposed_unmatched
        wait = _length(_concat(compute, move_set, unmatched_set, wait_set)) - covered
        busy = _intersection_length(steps, att.intervals)
        per_step = _NS_PER_MS * max(1, len(steps[0]))
        rows.append({
            "rank": rank, "steps": max(1, len(steps[0])), "step_ms": _length(steps) / per_step,
            "compute_ms": _length(compute) / per_step, "imbalance_wait_ms": wait / per_step,
            "exposed_comm_ms": (exposed_moves + exposed_unmatched) / per_step,
            "unmatched_comm_ms": exposed_unmatched / per_step,
            "host_idle_ms": (_length(steps) - busy) / per_step,
        })
        shares: dict[tuple[str, str], int] = defaultdict(int)
        seg_starts = np.array([s for s, _, _ in computing], np.int64)
        seg_ends = np.array([e for _, e, _ in computing], np.int64)
        seg_keys = [keys[i] for _, _, i in computing]
        for start, end, seg in _innermost(seg_starts, seg_ends, seg_keys, range(len(computing))):
            kernel = computing[seg][2]
            shares[(att.phase[kernel] or UNATTRIBUTED, att.kernels[kernel].name)] += end - start
        for (phase, name), ns in shares.items():
            phase_rows.append({"rank": rank, "phase": phase, "kernel": name, "compute_ms": ns / per_step})
    table = pd.DataFrame(rows, columns=list(DECOMPOSITION_COLUMNS))
    phases = pd.DataFrame(phase_rows, columns=list(PHASE_COMPUTE_COLUMNS))
    return table, phases.sort_values(["rank", "compute_ms"], ascending=[True, False], ignore_index=True)


def _clip_intervals(intervals: _Intervals, windows: _Intervals) -> _Intervals:
    """The parts of ``intervals`` inside ``windows``."""
    spans = _clip_segments([(int(s), int(e), 0) for s, e in zip(*intervals)], windows)
    return _segments_as_intervals(spans)
