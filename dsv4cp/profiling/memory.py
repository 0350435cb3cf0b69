"""Memory per measured point (docs/design.md §5): allocator peak, device-level use and host RSS.

The caching allocator's peak (``max_memory_allocated`` after ``reset_peak_memory_stats``) misses
memory allocated outside it, notably NCCL's buffers; ``torch.cuda.mem_get_info`` (total - free)
sees the whole device, including other processes. On CPU the process resident set is reported:
the peak since the tracked region began (Linux: ``VmHWM``, reset on entry through
``/proc/self/clear_refs``; elsewhere ``getrusage``'s peak over the process's life) and the current
value from ``/proc/self/statm`` where that exists. Every field is in bytes; a field that cannot be measured
on this device or platform is None.

    with track_memory() as mem:
        step()
    print(mem.result.to_dict())

Per-phase memory (where the peak sits): :func:`record_phase_memory` listens to every phase range of
:mod:`dsv4cp.profiling.nvtx` (forward ranges and autograd's backward spans alike) and, at each entry or
exit, reads the allocated bytes and the peak since the previous event, then resets the peak. The
interval between two events has a fixed set of open phases, so its peak is charged to each of them
(phases need not nest) and the step's peak is the maximum over the intervals. On CUDA the readings
are the caching allocator's host-side counters (``memory_stats`` / ``reset_peak_memory_stats``: no
device synchronisation, no kernel); on CPU the process RSS (``statm``) and its resettable peak
(``VmHWM``). Resetting the allocator peak disturbs any ``track_memory`` region around it: record
phases in a step of their own.

    with record_phase_memory() as phases:
        step()
    print(format_phase_memory(phases.rows))
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import pandas as pd
import torch

from dsv4cp.profiling.nvtx import set_phase_listener

try:
    import resource
except ImportError:  # not on Windows
    resource = None


@dataclass(frozen=True)
class MemorySample:
    """Memory use at one measured point, in bytes (None: not measurable here)."""

    device: str
    peak_allocated_bytes: int | None
    """Allocator peak since the tracked region began (CUDA only)."""
    peak_reserved_bytes: int | None
    """Allocator peak of reserved (cached) memory since the tracked region began (CUDA only)."""
    device_used_bytes: int | None
    """Device total minus free at the end of the region: includes NCCL buffers and other processes."""
    device_total_bytes: int | None
    host_peak_rss_bytes: int | None
    """Peak resident set of this process since the region began (Linux), else over its whole life."""
    host_rss_bytes: int | None
    """Resident set of this process at the end of the region."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


OUT_OF_MEMORY_MARKS = ("can't allocate memory", "OutOfMemoryError")
"""Text of an out-of-memory error that is not a ``torch.OutOfMemoryError``: the CPU allocator raises a
plain ``RuntimeError`` ("can't allocate memory"), and a spawned rank's OOM reaches its parent as a
``RuntimeError`` quoting the child's ``OutOfMemoryError``."""


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` reports running out of (device or host) memory; the CLI's exit code 3 and the
    sweeps' ``oom`` status both follow it."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(mark in str(err) for mark in OUT_OF_MEMORY_MARKS)


def reset_host_peak_rss() -> bool:
    """Lower this process's peak-RSS mark (``VmHWM``) to its current RSS (Linux >= 4.0), so that a
    sweep's later, smaller point does not report an earlier point's peak; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def proc_field_bytes(path: str, field: str) -> int | None:
    """``field`` of a Linux ``/proc`` table in kB lines (``VmHWM:  13612 kB``), in bytes; None where the
    file or the field does not exist."""
    try:
        with open(path) as table:
            for line in table:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_peak_rss_bytes() -> int | None:
    """Peak RSS of this process: ``VmHWM`` of ``/proc/self/status`` (resettable, see
    :func:`reset_host_peak_rss`), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    peak = proc_field_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def host_rss_bytes() -> int | None:
    """Current RSS from ``/proc/self/statm`` (resident pages, second field); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got device={device}")
    return device


def sample_memory(device: torch.device | str | None = None) -> MemorySample:
    """Memory now; the allocator peaks cover everything since the last reset of ``device``."""
    device = _resolve_device(device)
    peak_alloc = peak_reserved = used = total = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # frees of finished kernels must have happened
        peak_alloc = torch.cuda.max_memory_allocated(device)
        peak_reserved = torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    rss, peak_rss = host_rss_bytes(), host_peak_rss_bytes()
    if rss is not None and peak_rss is not None:
        # the kernel's RSS counters are batched per CPU, so ru_maxrss can trail statm by a few pages
        peak_rss = max(peak_rss, rss)
    return MemorySample(
        device=str(device),
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=peak_reserved,
        device_used_bytes=used,
        device_total_bytes=total,
        host_peak_rss_bytes=peak_rss,
        host_rss_bytes=rss,
    )


class MemoryTracker:
    """Holder filled by ``track_memory`` when its region ends."""

    def __init__(self) -> None:
        self.result: MemorySample | None = None


@contextlib.contextmanager
def track_memory(device: torch.device | str | None = None) -> Iterator[MemoryTracker]:
    """Measure the region's memory: allocator peaks are reset on entry (CUDA), read on exit."""
    device = _resolve_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    reset_host_peak_rss()
    tracker = MemoryTracker()
    yield tracker
    tracker.result = sample_memory(device)


# ------------------------------------------------------------------------------------ per phase
OUTSIDE_PHASES = "(outside phases)"
"""Row of the per-phase table for the intervals in which no phase range is open."""


class MemoryReader(Protocol):
    """Allocated bytes now and their peak since the last ``reset_peak`` (what the recorder polls)."""

    def current_and_peak(self) -> tuple[int, int]: ...

    def reset_peak(self) -> None: ...


class CudaAllocatorReader:
    """The caching allocator's ``allocated_bytes.all`` counters of ``device``: host-side, no sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_and_peak(self) -> tuple[int, int]:
        allocated = torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]
        return int(allocated["current"]), int(allocated["peak"])

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class HostRssReader:
    """The process RSS (``statm``) and its peak (``VmHWM``, reset through ``clear_refs``): Linux only."""

    def current_and_peak(self) -> tuple[int, int]:
        current, peak = host_rss_bytes() or 0, host_peak_rss_bytes() or 0
        return current, max(current, peak)  # the peak counter is batched per CPU and can trail

    def reset_peak(self) -> None:
        reset_host_peak_rss()


def default_reader(device: torch.device | str | None = None) -> MemoryReader | None:
    """The allocator on CUDA, the host RSS on Linux CPU; None where the peak cannot be reset."""
    device = _resolve_device(device)
    if device.type == "cuda":
        return CudaAllocatorReader(device)
    if host_rss_bytes() is None or not reset_host_peak_rss():
        return None
    return HostRssReader()


@dataclass(frozen=True)
class PhaseMemory:
    """Memory of one phase over a recorded step, in bytes (the table's row)."""

    phase: str
    calls: int
    """How many times the phase was entered."""
    entry_bytes: int | None
    """Allocated at its first entry; None for :data:`OUTSIDE_PHASES`."""
    peak_bytes: int
    """Highest allocation while it was open (over every call)."""
    exit_bytes: int | None
    """Allocated at its last exit; None if it never closed."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class PhaseMemoryRecorder:
    """Phase listener charging each interval's allocator peak to the phases open during it."""

    def __init__(self, reader: MemoryReader) -> None:
        self._reader = reader
        self._lock = threading.Lock()  # backward spans are told from autograd's threads
        self._open: list[str] = []  # in entry order; spans may close out of order
        self._first_entry: dict[str, int] = {}  # phase -> bytes, in order of first entry
        self._calls: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._last_exit: dict[str, int] = {}
        self.step_peak_bytes = 0
        self.peak_stack: tuple[str, ...] = ()
        """Phases open (outermost first) in the interval holding the step's peak."""

    def start(self) -> None:
        with self._lock:
            self._reader.reset_peak()

    def _close_interval(self) -> int:
        current, peak = self._reader.current_and_peak()
        self._reader.reset_peak()
        for phase in self._open or [OUTSIDE_PHASES]:
            self._peak[phase] = max(self._peak.get(phase, 0), peak)
        if peak > self.step_peak_bytes:
            self.step_peak_bytes, self.peak_stack = peak, tuple(self._open)
        return current

    def enter(self, phase: str) -> None:
        with self._lock:
            current = self._close_interval()
            self._first_entry.setdefault(phase, current)
            self._calls[phase] = self._calls.get(phase, 0) + 1
            self._open.append(phase)

    def exit(self, phase: str) -> None:
        with self._lock:
            current = self._close_interval()
            if phase in self._open:
                del self._open[len(self._open) - 1 - self._open[::-1].index(phase)]  # latest entry
            self._last_exit[phase] = current

    def finish(self) -> None:
        """Close the last interval (called once the step is over)."""
        with self._lock:
            self._close_interval()

    @property
    def peak_phase(self) -> str:
        """The innermost phase open at the step's peak (:data:`OUTSIDE_PHASES` if none was)."""
        return self.peak_stack[-1] if self.peak_stack else OUTSIDE_PHASES

    @property
    def rows(self) -> list[PhaseMemory]:
        """One row per phase in order of first entry, then the intervals outside every phase."""
        with self._lock:
            rows = [PhaseMemory(phase, self._calls[phase], entry, self._peak.get(phase, entry),
                                self._last_exit.get(phase))
                    for phase, entry in self._first_entry.items()]
            if OUTSIDE_PHASES in self._peak:
                rows.append(PhaseMemory(OUTSIDE_PHASES, 0, None, self._peak[OUTSIDE_PHASES], None))
        return rows


@contextlib.contextmanager
def record_phase_memory(
    device: torch.device | str | None = None, reader: MemoryReader | None = None,
) -> Iterator[PhaseMemoryRecorder | None]:
    """Record per-phase memory of the region's phase ranges (yields None where memory cannot be read).

    ``reader`` replaces the device's own (:func:`default_reader`), e.g. in tests. On CUDA the device
    is synchronised before and after the region (never inside it), so blocks held for other streams'
    pending work (``record_stream``, NCCL) are back before the first and last readings.
    """
    device = _resolve_device(device)
    reader = reader if reader is not None else default_reader(device)
    if reader is None:
        yield None
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    recorder = PhaseMemoryRecorder(reader)
    recorder.start()
    previous = set_phase_listener(recorder)
    try:
        yield recorder
    finally:
        set_phase_listener(previous)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        recorder.finish()


def phase_memory_frame(rows_per_rank: Sequence[Sequence[PhaseMemory | dict] | None]) -> pd.DataFrame:
    """The per-rank tables as one frame: rank, phase, calls, entry/peak/exit in GiB (a rank whose
    rows are None, e.g. one an emulated run did not measure, has no rows)."""
    records = []
    for rank, rows in enumerate(rows_per_rank):
        for row in rows or ():
            row = row.to_dict() if isinstance(row, PhaseMemory) else row
            records.append({
                "rank": rank, "phase": row["phase"], "calls": row["calls"],
                "entry_gib": _gib_or_none(row["entry_bytes"]), "peak_gib": row["peak_bytes"] / 2**30,
                "exit_gib": _gib_or_none(row["exit_bytes"]),
            })
    return pd.DataFrame.from_records(records, columns=["rank", "phase", "calls", "entry_gib", "peak_gib", "exit_gib"])


def _gib_or_none(size: int | None) -> float | None:
    return None if size is None else size / 2**30


def peak_phase_line(rank: int, peak_bytes: int, peak_stack: Sequence[str]) -> str:
    """``rank 0: peak 15.41 GiB sits in phase sparse_attn.bwd (open: indexer.loss.bwd > sparse_attn.bwd)``."""
    phase = peak_stack[-1] if peak_stack else OUTSIDE_PHASES
    line = f"rank {rank}: peak {peak_bytes / 2**30:.2f} GiB sits in phase {phase}"
    if len(peak_stack) > 1:
        line += " (open: " + " > ".join(peak_stack) + ")"
    return line
