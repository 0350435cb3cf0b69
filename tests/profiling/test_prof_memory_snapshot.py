"""``--memory-snapshot``: refused cleanly without CUDA (exit 2, before any work); on GPU a pickle of
the allocator's history beside the traces that holds the step's allocations."""

from __future__ import annotations

import pickle

import pytest
import torch

from dsv4cp.cli.main import main
from dsv4cp.profiling import memory_snapshot
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import RunOptions, make_point

PROFILE = ["profile", "--preset", "tiny", "--tokens", "256", "--ratio", "4", "--kernel-backend", "torch",
           "--warmup", "0", "--reps", "1", "--progress", "off"]
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@needs_no_cuda
def test_profile_refuses_a_snapshot_without_cuda(tmp_path, capsys):
    code = main([*PROFILE, "--memory-snapshot", "--trace-dir", str(tmp_path / "traces")])
    err = capsys.readouterr().err
    assert code == 2 and "--memory-snapshot" in err and "CUDA" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "traces").exists() or not any((tmp_path / "traces").iterdir())


@needs_no_cuda
def test_sweep_refuses_a_snapshot_without_cuda_before_launching(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\nbase: {preset: tiny, ratio: 4, tokens: 256}\naxes: {cp: [1]}\n")
    code = main(["sweep", str(spec), "--profile", "--memory-snapshot", "--out", str(tmp_path / "run")])
    assert code == 2 and "--memory-snapshot" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_snapshot_needs_traces_to_sit_beside(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the device check, to the next one
    with pytest.raises(ValueError, match="--trace-dir"):
        memory_snapshot.check_snapshot_request(True, False, "--trace-dir")
    memory_snapshot.check_snapshot_request(True, True, "--trace-dir")
    memory_snapshot.check_snapshot_request(False, False, "--trace-dir")  # not asked: nothing to check


def test_measure_point_and_the_recorder_refuse_a_cpu_device(tmp_path):
    point = make_point({"preset": "tiny", "ratio": 4, "cp": 1, "tokens": 256, "packing": "one",
                        "kernel_backend": "torch"})
    with pytest.raises(ValueError, match="memory snapshot"):
        measure_point(point, None, torch.device("cpu"), RunOptions(warmup=0, reps=1), trace_dir=tmp_path,
                      memory_snapshot=True)
    with pytest.raises(ValueError, match="device cpu"), memory_snapshot.record_memory_snapshot(tmp_path / "s", "cpu"):
        pass
    assert not (tmp_path / "s").exists()
    assert memory_snapshot.snapshot_name(3) == "memory_snapshot_rank3.pickle"


def _allocated_sizes(snapshot: dict) -> list[int]:
    return [event["size"] for trace in snapshot["device_traces"] for event in trace if event["action"] == "alloc"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_holds_the_regions_allocations(tmp_path):
    size = 3 * 2**20 + 4096 * (1 + torch.randint(0, 100, ()).item())  # an unusual size, to find it again
    with memory_snapshot.record_memory_snapshot(tmp_path / "snap.pickle", "cuda") as path:
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        del block
    snapshot = pickle.loads(path.read_bytes())
    assert any(s >= size and s < size + 2**20 for s in _allocated_sizes(snapshot))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_writes_a_snapshot_beside_the_traces(tmp_path):
    traces = tmp_path / "traces"
    assert main([*PROFILE, "--backward", "--memory-snapshot", "--trace-dir", str(traces)]) == 0
    snapshot = pickle.loads((traces / "memory_snapshot_rank0.pickle").read_bytes())
    assert len(_allocated_sizes(snapshot)) > 10  # a layer step allocates activations and gradients
    assert any(traces.rglob("*.json*"))  # the Kineto trace it sits beside
