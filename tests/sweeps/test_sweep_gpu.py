"""GPU sweep (run through the device tool): device memory, MFU and CUDA-event timing in the records.

On two GPUs the torchrun path (NCCL sub-groups, gloo control group) is exercised by
``torchrun --nproc-per-node 2 -m dsv4cp sweep sweeps/cp_scaling.yaml``; this test covers one process.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from dsv4cp.cli.main import main
from dsv4cp.records import read_meta, read_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_gpu_sweep_records_device_metrics_and_profile(tmp_path):
    spec = tmp_path / "gpu.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "gpu", "run": {"warmup": 1, "reps": 3, "trace_steps": 1},
        "base": {"preset": "flash", "tokens": 8192, "dtype": "bf16", "pass": "fwd+bwd", "packing": "histogram"},
        "axes": {"ratio": [4, 128], "cp": [1, 2]},
    }))
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1", "--profile", "--progress", "off"]) == 0
    records = read_records(out)
    assert [r["status"] for r in records] == ["ok", "ok", "skipped: needs cp=2", "skipped: needs cp=2"]
    for record in records[:2]:
        assert 0 < record["mfu"] < 1 and 0 < record["measured_over_bound"]
        peak, used = record["peak_allocated_bytes"][0], record["device_used_bytes"][0]
        assert 2**20 < peak <= used
        assert record["resolved_backends"]["sparse_attention"] != "torch"  # auto picks a GPU kernel
        assert record["phases"] and record["comm_ms"] == 0.0  # one rank: no communication
    meta = read_meta(out)
    assert meta["gpu_count"] == 1 and meta["gpu_name"] and meta["cuda"] and meta["machine"].startswith("1x")
