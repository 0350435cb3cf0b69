"""``dsv4cp profile --cuda-graph``: the step timed as CUDA-graph replays (traces and memory stay eager).

CPU: the flag is refused (exit 2, naming it) before any work, and ``benchmark(cuda_graph=True)``
goes through the public :func:`dsv4cp.profiling.timing.graph_replay`. GPU (marked ``gpu``): a tiny
fwd+bwd ``profile --cuda-graph`` records ``cuda_graph: True`` and a positive time, next to its
eager twin, and its memory and trace are still measured (eagerly, after the graph is released).
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from dsv4cp.cli import profile
from dsv4cp.cli.main import main
from dsv4cp.profiling import timing
from dsv4cp.records import read_records
from dsv4cp.sweeps.spec import make_point

COMMON = ["profile", "--preset", "tiny", "--tokens", "256", "--ratio", "4", "--backward", "--progress", "off"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


pytestmark = pytest.mark.usefixtures("single_process")  # tests/conftest.py


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("extra", [[], ["--cp", "2", "--emulate-rank", "1"]])
def test_cuda_graph_on_cpu_exits_2_before_any_work(extra, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("profile did work before refusing --cuda-graph")

    monkeypatch.setattr(profile, "check_memory", no_work)
    monkeypatch.setattr(profile, "measure_point", no_work)
    out = tmp_path / "run"
    assert main([*COMMON, "--kernel-backend", "torch", "--cuda-graph", *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "dsv4cp profile: error: --cuda-graph: CUDA-graph replays need a CUDA device, got cpu" in err
    assert not (out / "records.jsonl").exists() and not dist.is_initialized()


def test_cuda_graph_flag_has_help_and_reaches_the_point():
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    assert "time the step as CUDA-graph replays" in " ".join(parser.format_help().split())
    cpu = torch.device("cpu")
    graph = profile.point_from_args(parser.parse_args(["--tokens", "256", "--cuda-graph"]), 1, cpu)
    eager = profile.point_from_args(parser.parse_args(["--tokens", "256"]), 1, cpu)
    assert graph.cuda_graph is True and eager.cuda_graph is False
    assert eager == make_point({"tokens": 256, "pass": "fwd", "dtype": "fp32"})


def test_graph_replay_is_public_and_benchmark_still_refuses_cpu():
    assert callable(timing.graph_replay) and not hasattr(timing, "_graph_replay")
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        timing.benchmark(lambda: None, warmup=0, reps=1, device="cpu", cuda_graph=True)


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_counts_its_eager_warmup_and_replays_the_work():
    x = torch.zeros(1024, device="cuda")
    phases: list[str] = []
    replay = timing.graph_replay(lambda: x.add_(1.0), warmup=2, on_step=phases.append)
    assert phases == ["warmup", "warmup"]
    torch.cuda.synchronize()
    assert float(x[0]) == 2.0  # the two eager calls; the capture itself runs nothing
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 5.0
    graphed = timing.benchmark(lambda: x.add_(1.0), warmup=1, reps=3, cuda_graph=True)
    assert graphed.median_ms > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto"])  # the backend the capture test of tests/test_gpu_sync.py covers
def test_profile_cuda_graph_and_its_eager_twin(backend, tmp_path, capsys, seed):
    out = tmp_path / "run"
    args = [*COMMON, "--kernel-backend", backend, "--seed", str(seed % 1000), "--warmup", "1", "--reps", "3",
            "--out", str(out)]
    assert main(args) == 0
    eager_text = capsys.readouterr().out
    assert "cuda-graph" not in eager_text and "CUDA-graph replays" not in eager_text
    assert main([*args, "--cuda-graph", "--memory-phases", "--trace-dir", str(tmp_path / "traces")]) == 0
    text = capsys.readouterr().out
    assert " cuda-graph (point " in text and "traced steps are eager" in text
    eager, graph = read_records(out)
    assert eager["cuda_graph"] is False and graph["cuda_graph"] is True
    assert eager["point_id"] != graph["point_id"]
    for record in (eager, graph):
        assert record["status"] == "ok" and record["time_ms_median"] > 0
        assert 0 < record["time_ms_p20"] <= record["time_ms_median"] <= record["time_ms_p80"]
        assert record["peak_allocated_bytes"][0] > 0 and record["device_used_bytes"][0] > 0
    assert graph["memory_phases"][0]["rows"] and graph["phases"]  # eager steps after the graph was released
    # the same work without the host's launch overhead: never much slower than eager
    assert graph["time_ms_median"] < 1.5 * eager["time_ms_median"]
