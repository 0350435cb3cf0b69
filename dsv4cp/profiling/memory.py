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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

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
