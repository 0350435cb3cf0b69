"""Memory points on CPU: host RSS fields, None for device fields, argument checks."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.profiling.memory import MemorySample, sample_memory, track_memory


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


def test_sample_memory_rejects_other_devices():
    with pytest.raises(ValueError, match="device"):
        sample_memory("meta")
