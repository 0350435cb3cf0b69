"""The bound's machine is the one that ran: :func:`dsv4cp.model.machine.this_machine` is the default of the
CLI's ``--machine``, of a sweep point's bound and of the analytic model; a CPU gets the ``cpu-estimate``
preset, an H200 the ``h200x2`` one, another GPU no bound (saying so); records name the machine."""

from __future__ import annotations

import argparse

import pandas as pd
import pytest
import torch

import dsv4cp.model.machine as machine_module
from dsv4cp.cli.common import add_machine_options, machine_from_args
from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import CPU_ESTIMATE, MACHINE_PRESETS, no_machine_reason, resolve_machine, this_machine
from dsv4cp.sweeps import measure
from dsv4cp.sweeps.spec import RunOptions, make_point


def _fake_gpu(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_machine_options(parser)
    return parser.parse_args(list(argv))


def test_a_cpu_host_gets_the_cpu_estimate() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA host")
    assert this_machine() == CPU_ESTIMATE == Machine.preset("cpu-estimate")
    assert "estimate" in CPU_ESTIMATE.name and "cpu-estimate" in MACHINE_PRESETS
    assert machine_from_args(_args()) == CPU_ESTIMATE
    assert estimate(DSv4Config.preset("tiny"), 4, [64], 1).machine == CPU_ESTIMATE  # the analytic default too


def test_a_gpu_gets_its_preset_or_no_bound(monkeypatch) -> None:
    _fake_gpu(monkeypatch, "NVIDIA H200")
    assert this_machine() == Machine.preset("h200x2")
    assert machine_from_args(_args("--bandwidth", "25")).allgather_busbw == 25e9
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert this_machine() is None and machine_from_args(_args()) is None
    assert "'NVIDIA A100-SXM4-80GB' has no preset" in no_machine_reason()
    with pytest.raises(ValueError, match="^machine: no bound: the GPU 'NVIDIA A100"):
        resolve_machine(None)
    with pytest.raises(ValueError, match="^--bandwidth: .*there is none"):
        machine_from_args(_args("--bandwidth", "25"))
    assert machine_from_args(_args("--machine", "internode")).name == "internode"  # a flag still chooses


def test_a_calibration_brings_the_machine_it_was_fitted_against() -> None:
    fitted = Calibration(factors={"indexer.fwd": 2.0}, machine="h200x2")
    assert machine_from_args(_args(), fitted) == Machine.preset("h200x2")
    assert machine_from_args(_args("--machine", "internode"), fitted).name == "internode"
    measured = Calibration(factors={}, machine="cpu (2 threads, measured)")  # not a preset: this machine's
    assert machine_from_args(_args(), measured) == this_machine()


def test_model_on_a_gpu_without_preset_exits_2_saying_so(monkeypatch, capsys) -> None:
    _fake_gpu(monkeypatch, "Some GPU")
    assert main(["model", "--tokens", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--machine: no bound: the GPU 'Some GPU' has no preset" in err and len(err.strip().splitlines()) == 1


def test_a_point_without_a_machine_records_no_bound(monkeypatch) -> None:
    """The model FLOPs stay (they need no ceilings); bound, measured/bound and bound_machine are None;
    a balanced point, whose split is balanced on ceilings, is refused before any work."""
    for module in (measure, machine_module):  # the name measure imported, and the one the model resolves
        monkeypatch.setattr(module, "this_machine", lambda: None)
    point = make_point({"preset": "tiny", "tokens": 64})
    run = RunOptions(warmup=0, reps=1)
    metrics = measure.measure_point(point, None, torch.device("cpu"), run).metrics
    assert metrics["model_flops"] > 0 and metrics["tflops_per_gpu"] > 0
    assert metrics["bound_ms"] is None and metrics["measured_over_bound"] is None and metrics["bound_machine"] is None
    with_bound = measure.measure_point(point, None, torch.device("cpu"), run, machine=CPU_ESTIMATE).metrics
    assert with_bound["bound_machine"] == "cpu-estimate" and with_bound["bound_ms"] > 0
    assert with_bound["measured_over_bound"] == pytest.approx(with_bound["time_ms_median"] / with_bound["bound_ms"])
    assert metrics["bound_measured_ms"] is None and metrics["measured_over_measured_bound"] is None
    # a CPU has no spec sheet here: its physical limits are its ceilings, so the two bounds agree
    assert with_bound["bound_measured_ms"] == with_bound["bound_ms"]
    assert with_bound["measured_over_measured_bound"] == with_bound["measured_over_bound"]
    # an H200's: the bound at the spec sheet's 989 TFLOP/s and 4.8 TB/s lies below the measured ceilings' one
    h200 = measure.measure_point(point, None, torch.device("cpu"), run, machine=Machine.preset("h200x2")).metrics
    ratio = h200["bound_ms"] / h200["bound_measured_ms"]
    assert 784 / 989 <= ratio <= 4.26 / 4.8 and h200["bound_machine"] == "h200x2"
    assert h200["measured_over_bound"] == pytest.approx(h200["time_ms_median"] / h200["bound_ms"])
    assert h200["measured_over_measured_bound"] == pytest.approx(h200["time_ms_median"] / h200["bound_measured_ms"])
    balanced = make_point({"preset": "tiny", "tokens": 64, "partition": "balanced"})
    with pytest.raises(ValueError, match="^partition: a balanced split .*no bound"):
        measure.measure_point(balanced, None, torch.device("cpu"), run)


def test_the_module_has_one_default(monkeypatch) -> None:
    """Every default goes through this_machine: replacing it moves the analytic model's bound too."""
    other = Machine(name="probe", peak_flops=1e12, hbm_bandwidth=1e11, allgather_busbw=1e9, p2p_bandwidth=1e9)
    monkeypatch.setattr(machine_module, "this_machine", lambda: other)
    assert estimate(DSv4Config.preset("tiny"), 4, [64], 1).machine is other


def test_report_tables_name_the_bound_machine(tmp_path) -> None:
    """The headline and measured-vs-bound tables carry each record's ``bound_machine`` (None: no bound)."""
    from dsv4cp.records import append_record, make_record
    from dsv4cp.report import tables
    from dsv4cp.report.load import load_runs

    run = tmp_path / "run"
    run.mkdir()
    for cp, machine in ((1, "cpu-estimate"), (2, None)):
        metrics = {"time_ms_median": 2.0 * cp, "bound_ms": None if machine is None else 0.5, "model_flops": 1e9,
                   "measured_over_bound": None if machine is None else 4.0 * cp, "bound_machine": machine}
        axes = {"preset": "tiny", "ratio": 4, "pass": "fwd", "cp": cp, "tokens": 64}
        append_record(run / "records.jsonl", make_record(axes, metrics,
                                                         sweep="s", status="ok", machine="cpu", git_sha=None))
    df = load_runs([run])
    for table in (tables.headline(df), tables.measured_vs_bound(df)):
        assert table["bound_machine"].iloc[0] == "cpu-estimate" and pd.isna(table["bound_machine"].iloc[1])
