"""Memory points on CPU: host RSS fields, None for device fields, argument checks."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.profiling.memory import MemorySample, reset_host_peak_rss, sample_memory, track_memory


def test_track_memory_on_cpu_reports_host_rss():
    with track_memory("cpu") as mem:
        block = torch.ones(16 * 2**20, dtype=torch.uint8)  # ones, not zeros: the pages get touched
    result = mem.result
    assert isinstance(result, MemorySample)
    assert result.device == "cpu"
    assert result.peak_allocated_bytes is None and result.device_used_bytes is None
    assert result.host_rss_bytes is not None and result.host_rss_bytes > block.numel()
    assert result.host_peak_rss_bytes >= result.host_rss_bytes
    assert set(result.to_dict()) == {
        "device", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "device_total_bytes",
        "host_peak_rss_bytes", "host_rss_bytes",
    }


def test_each_tracked_region_reports_its_own_host_peak():
    """A sweep measures many points in one process: a small point after a large one must not report
    the large one's peak (it did while the peak was getrusage's lifetime maximum)."""
    if not reset_host_peak_rss():
        pytest.skip("this platform cannot reset the peak RSS (/proc/self/clear_refs)")
    big = 256 * 2**20
    with track_memory("cpu") as large:
        block = torch.ones(big, dtype=torch.uint8)
        del block
    with track_memory("cpu") as small:
        block = torch.ones(2**20, dtype=torch.uint8)
    assert block.sum() == 2**20  # the small block was really touched
    assert large.result.host_peak_rss_bytes - small.result.host_peak_rss_bytes > big // 2
    assert small.result.host_peak_rss_bytes >= small.result.host_rss_bytes


def test_sample_memory_rejects_other_devices():
    with pytest.raises(ValueError, match="device"):
        sample_memory("meta")
