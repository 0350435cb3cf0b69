"""A measured step whose output, indexer loss or gradients are not finite is never recorded as ok: the
sweep records ``error: non-finite <what>``, ``profile`` and ``layer`` exit 1 naming it (CPU, tiny shapes)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from dsv4cp.cli.main import main
from dsv4cp.cp.launch import spawn
from dsv4cp.harness import build as layer_step
from dsv4cp.harness.time import NonFiniteResult
from dsv4cp.records import read_records
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import RunOptions, make_point

RUN = RunOptions(warmup=0, reps=1)
BASE = {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "cp": 1, "tokens": 48, "packing": "one"}


def _poisoning_randomize(original, weight: str):
    """``randomize_`` followed by a NaN in one element of ``weight`` (the measured layer's)."""

    def randomize(layer: torch.nn.Module, generator: torch.Generator) -> None:
        original(layer, generator)
        with torch.no_grad():
            layer.get_parameter(weight).view(-1)[0] = math.nan

    return randomize


@pytest.mark.parametrize(("weight", "direction", "want"), [
    ("wq_a.weight", "fwd", "non-finite output, indexer loss on rank 0"),
    ("wo_b.weight", "fwd", "non-finite output on rank 0"),
    # the indexer's own weight: the attention stays finite, the loss reports it (and its gradients)
    ("indexer.wq_b.weight", "fwd+bwd", "non-finite indexer loss, gradients of indexer."),
])
def test_measure_point_raises_naming_what_is_not_finite(monkeypatch, weight: str, direction: str, want: str) -> None:
    point = make_point({**BASE, "ratio": 4, "pass": direction})
    measure_point(point, None, torch.device("cpu"), RUN)  # the control: finite
    monkeypatch.setattr(layer_step, "randomize_", _poisoning_randomize(layer_step.randomize_, weight))
    with pytest.raises(NonFiniteResult) as caught:
        measure_point(point, None, torch.device("cpu"), RUN)
    assert str(caught.value).startswith(want), str(caught.value)


def test_the_sweep_records_a_nonfinite_point_as_an_error(monkeypatch, tmp_path) -> None:
    spec = tmp_path / "nan.yaml"
    spec.write_text(yaml.safe_dump({"name": "nan", "run": {"warmup": 0, "reps": 1},
                                    "base": {**BASE, "ratio": 0, "pass": "fwd"}}))
    monkeypatch.setattr(layer_step, "randomize_", _poisoning_randomize(layer_step.randomize_, "wkv.weight"))
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "1", "--progress", "off"]) == 1  # a failed point
    (record,) = read_records(out)
    assert record["status"] == "error: non-finite output on rank 0", record["status"]
    assert record["time_ms_median"] is None


def test_profile_exits_1_naming_what_is_not_finite(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(layer_step, "randomize_", _poisoning_randomize(layer_step.randomize_, "wq_a.weight"))
    out = tmp_path / "run"
    args = ["profile", "--preset", "tiny", "--ratio", "4", "--tokens", "48", "--warmup", "0", "--reps", "1",
            "--kernel-backend", "torch", "--backward", "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv4cp profile: error: non-finite output, indexer loss, gradients of "), err
    assert not (out / "records.jsonl").exists()


class _NanLayer(layer_step.DSv4Attention):
    """The layer command's layer with one NaN weight."""

    def reset_parameters(self, generator=None) -> None:
        super().reset_parameters(generator)
        with torch.no_grad():
            self.wq_a.weight[0, 0] = math.nan


def test_layer_exits_1_naming_what_is_not_finite(monkeypatch, capsys) -> None:
    args = ["layer", "--preset", "tiny", "--ratio", "4", "--tokens", "48", "--warmup", "0", "--reps", "1",
            "--backward"]
    assert main(args) == 0  # the control: finite
    capsys.readouterr()
    monkeypatch.setattr(layer_step, "DSv4Attention", _NanLayer)
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("dsv4cp layer: error: non-finite output, indexer loss, gradients of x, "), \
        captured.err
    assert "fwd+bwd: median" in captured.out  # the measurement is still printed


def _poisoned_rank_1(rank: int, world: int, device: torch.device) -> str:
    """One point of cp 2 measured with a NaN weight on rank 1 only: what each rank raised."""
    if rank == 1:
        layer_step.randomize_ = _poisoning_randomize(layer_step.randomize_, "wq_a.weight")  # in this process only
    point = make_point({**BASE, "cp": 2, "ratio": 0, "pass": "fwd"})
    try:
        measure_point(point, torch.distributed.group.WORLD, device, RUN)
    except NonFiniteResult as err:
        return str(err)
    return "finite"


def test_every_rank_raises_when_one_rank_is_not_finite() -> None:
    """Rank 0's own results are finite (a window layer, forward only), yet it raises with rank 1: no
    rank goes on alone into a later collective."""
    assert spawn(_poisoned_rank_1, 2) == ["non-finite output on rank 1"] * 2


@pytest.mark.parametrize("partition", ["equal", "measured"])
def test_profile_emulating_every_rank_exits_1_in_one_line_naming_what_is_not_finite(monkeypatch, tmp_path, capsys,
                                                                                      partition: str) -> None:
    monkeypatch.setattr(layer_step, "randomize_", _poisoning_randomize(layer_step.randomize_, "wkv.weight"))
    out = tmp_path / "run"
    args = ["profile", "--preset", "tiny", "--ratio", "0", "--tokens", "64", "--warmup", "0", "--reps", "1",
            "--kernel-backend", "torch", "--cp", "2", "--emulate-rank", "all", "--partition", partition,
            "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err == ("dsv4cp profile: error: non-finite output on rank 0: the timed steps computed NaN or infinity, "
                   "no record written\n"), err
    assert not (out / "records.jsonl").exists()
