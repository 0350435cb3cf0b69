"""The CI performance gate (``.ci/gate.py``) end to end: a delay patched into one op fails it, noise does
not, a broken pipeline does, and a point that regresses only once is forgiven by its repeat; against a
baseline with repetition times (the rank test) and one without (an older baseline: the band rule).

The sweep half runs a 4-point CPU sweep (3 W layers and 1 H layer, CP = 1, so in-process: the monkeypatch
reaches the measured layer; the W points keep the gate's machine factor near 1) through the ``dsv4cp
sweep`` CLI's ``main``; the benchmark half is fed synthetic pytest-benchmark JSON, as ``dsv4cp compare``
reads it, including a uniformly slower machine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv4cp.cli.main import main as dsv4cp_main
from dsv4cp.layer.compressor import Compressor

ROOT = Path(__file__).resolve().parent.parent
DELAY_S = 1.0
"""Added to every compressor call of the slowed run: the H point's step grows by >= 1 s per call."""
THRESHOLDS = dict(max_regression=2.0, min_slowdown_ms=300.0)
"""The gate's 3x rule, with a floor above this loaded machine's stalls of a tiny layer (~0.2 s) and
below the patched delay."""
REPS = 6
"""Repetitions per point here (the gate's own are more): 6 and 6 samples can reach p = 0.0011, below
the gate's 0.01 / 4 points, so the rank test judges; fewer keeps the delayed runs short."""


def _load_gate():
    spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gate = _load_gate()


def _thresholds():
    return gate.Thresholds(**THRESHOLDS)


@pytest.fixture
def spec(tmp_path, seed) -> Path:
    path = tmp_path / "ci_gate_test.yaml"
    path.write_text(
        "name: ci_gate_test\n"
        "run: {warmup: 1, reps: 3}\n"
        f"base: {{preset: tiny, dtype: fp32, kernel_backend: torch, overlap: none, seed: {seed}}}\n"
        "axes: {cp: [1], ratio: [0, 8], tokens: [32, 64, 96], pass: [fwd], packing: [one]}\n"
        "exclude: [{ratio: 8, tokens: 32}, {ratio: 8, tokens: 96}]\n"  # 3 W points, 1 H point
    )
    return path


def _run_sweep(spec: Path, out: Path, resume: bool) -> None:
    """The gate's sweep step, in this process, with one intra-op thread as the gate measures."""
    argv = ["sweep", str(spec), "--out", str(out), "--progress", "off"] + (["--resume"] if resume else [])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert dsv4cp_main(argv) in (0, 1)  # 1: a point failed (the gate's records check names it)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(params=["with samples", "without samples"])
def baseline(request, spec, tmp_path) -> Path:
    """A baseline recorded as ``--refresh`` records it (the gate's spec, every repetition's time), or
    the same without the repetitions' times (a baseline recorded before they were stored)."""
    out = tmp_path / "baseline"
    _run_sweep(gate.gate_spec(spec, REPS, tmp_path / "baseline-spec"), out, False)
    if request.param == "without samples":
        lines = (out / "records.jsonl").read_text().splitlines()
        (out / "records.jsonl").write_text("".join(
            json.dumps({**json.loads(line), "time_ms_samples": None}) + "\n" for line in lines))
    return out


def _rule_of(out: str, baseline: Path) -> str:
    """The rule the gate's printed table judged by, checked against what the baseline holds."""
    has_samples = json.loads((baseline / "records.jsonl").read_text().splitlines()[0])["time_ms_samples"]
    assert ("FALLBACK bands for 4 points" in out) != bool(has_samples)
    return "U test" if has_samples else "bands"


def _slow_compressor(monkeypatch) -> list[int]:
    """Delay every compressor call (H and C layers only); returns a list counting the delayed calls."""
    original, calls = Compressor.forward, []

    def delayed(self, *args, **kwargs):
        calls.append(1)
        time.sleep(DELAY_S)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Compressor, "forward", delayed)
    return calls


def test_gate_passes_without_change_and_prints_only_what_it_acts_on(spec, baseline, tmp_path, capsys):
    gate.gate_sweep(spec, baseline, tmp_path / "work", _thresholds(), run_sweep=_run_sweep, reps=REPS)
    out = capsys.readouterr().out
    assert "REGRESSION" not in out and "INVALID" not in out and "points regressed" not in out
    rule = _rule_of(out, baseline)
    assert sum(f"{rule} " in line and line.rstrip().endswith(("same", "within noise", "improvement"))
               for line in out.splitlines()) == 4


def test_gate_fails_on_a_delayed_op(spec, baseline, tmp_path, monkeypatch, capsys):
    calls = _slow_compressor(monkeypatch)
    work = tmp_path / "work"
    with pytest.raises(gate.GateFailure, match="1 points regressed twice"):
        gate.gate_sweep(spec, baseline, work, _thresholds(), run_sweep=_run_sweep, reps=REPS)
    assert calls, "the patched op never ran"
    out = capsys.readouterr().out
    regressions = [line for line in out.splitlines() if line.startswith("REGRESSION:")]
    assert len(regressions) == 2 and all("ratio=8" in line for line in regressions)  # the run and its repeat
    assert all(_rule_of(out, baseline) in line for line in regressions)
    rerun = [json.loads(line) for line in (work / "ci_gate_test-rerun" / "records.jsonl").read_text().splitlines()]
    assert [r["ratio"] for r in rerun] == [0, 0, 0, 8]  # the W points kept, the H point measured again
    assert len(rerun[-1]["time_ms_samples"]) == REPS


def test_gate_fails_on_a_broken_point(spec, baseline, tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("compressor broken on purpose")

    monkeypatch.setattr(Compressor, "forward", broken)
    with pytest.raises(gate.GateFailure, match="points did not run"):
        gate.gate_sweep(spec, baseline, tmp_path / "work", _thresholds(), run_sweep=_run_sweep, reps=REPS)


# ------------------------------------------------------------------------- benchmark half (synthetic)
def _bench_json(path: Path, medians: dict[str, float]) -> None:
    """pytest-benchmark JSON with the bench harness's own timer in ``extra_info`` (ms, +-10% band)."""
    benchmarks = [{
        "name": name, "fullname": f"bench/test_x.py::{name}", "group": None, "params": None,
        "stats": {"median": ms / 1e3, "mean": ms / 1e3, "min": ms / 1e3, "q1": ms / 1e3, "q3": ms / 1e3},
        "extra_info": {"device": "cpu-test", "median_ms": ms, "p20_ms": 0.9 * ms, "p80_ms": 1.1 * ms},
    } for name, ms in medians.items()]
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": benchmarks}))


BASE = {"test_a": 100.0, "test_b": 200.0, "test_c": 50.0, "test_d": 300.0, "test_e": 80.0}


def _scaled(factor: float, **changed: float) -> dict[str, float]:
    """BASE with every median times ``factor`` (a loaded machine), then the ``changed`` ones."""
    return {**{name: ms * factor for name, ms in BASE.items()}, **changed}


@pytest.mark.parametrize(
    ("first", "repeat", "fails"),
    [
        (_scaled(1.0, test_a=150.0, test_b=190.0), None, False),  # 1.5x: within the loose threshold
        (_scaled(1.0, test_a=400.0), {"test_a": 110.0}, False),  # regressed once, not on its repeat
        (_scaled(1.0, test_a=400.0), {"test_a": 420.0}, True),  # 4x twice
        (_scaled(1.0, test_b=700.0), {"test_b": 700.0}, True),
        (_scaled(2.5, test_a=400.0), None, False),  # a machine 2.5x slower: 4x is 1.6x of that
        (_scaled(2.0, test_a=900.0), {"test_a": 900.0}, True),  # 9x on a 2x slower machine
        (_scaled(0.5, test_a=290.0), None, False),  # a faster machine makes no rule stricter: 2.9x
    ],
)
def test_bench_gate_repeats_before_failing(tmp_path, capsys, first, repeat, fails):
    baseline = tmp_path / "base.json"
    _bench_json(baseline, BASE)
    reruns: list[list[str]] = []

    def run_bench(json_out: Path, node_ids):
        if node_ids is None:
            _bench_json(json_out, first)
        else:
            reruns.append(node_ids)
            _bench_json(json_out, repeat)

    thresholds = gate.Thresholds(max_regression=2.0, min_slowdown_ms=20.0)
    if fails:
        with pytest.raises(gate.GateFailure, match="1 benchmarks regressed twice"):
            gate.gate_bench(baseline, tmp_path / "work", thresholds, run_bench=run_bench)
    else:
        gate.gate_bench(baseline, tmp_path / "work", thresholds, run_bench=run_bench)
    assert reruns == ([] if repeat is None else [[f"bench/test_x.py::{name}" for name in repeat]])
    if repeat is None:  # nothing acted on, nothing printed as a regression (a 4x point on a 2.5x machine)
        assert "REGRESSION" not in capsys.readouterr().out


def test_bench_gate_fails_when_everything_slows_down(tmp_path):
    baseline = tmp_path / "base.json"
    _bench_json(baseline, BASE)
    with pytest.raises(gate.GateFailure, match="median point is 4.00x slower"):
        gate.gate_bench(baseline, tmp_path / "work", gate.Thresholds(2.0, 20.0),
                        run_bench=lambda out, ids: _bench_json(out, _scaled(4.0)))


def test_bench_gate_fails_on_a_lost_benchmark(tmp_path):
    baseline = tmp_path / "base.json"
    _bench_json(baseline, BASE)
    kept = {name: ms for name, ms in BASE.items() if name != "test_b"}
    with pytest.raises(gate.GateFailure, match="missing from the new run: bench/test_x.py::test_b"):
        gate.gate_bench(baseline, tmp_path / "work", gate.Thresholds(2.0, 20.0),
                        run_bench=lambda out, ids: _bench_json(out, kept))


def test_refresh_replaces_the_baselines_recording_every_repetition(spec, tmp_path):
    bench, baseline = tmp_path / "baselines" / "bench.json", tmp_path / "baselines" / "smoke"
    baseline.mkdir(parents=True)
    stale = baseline / "stale.txt"
    stale.write_text("from an older baseline")
    assert gate.refresh(spec, baseline, bench, False, False, run_sweep=_run_sweep,
                        run_bench=lambda out, ids: _bench_json(out, BASE), reps=REPS) == 0
    assert not stale.exists()
    records = [json.loads(line) for line in (baseline / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(len(r["time_ms_samples"]) == REPS for r in records)
    assert all(min(r["time_ms_samples"]) <= r["time_ms_median"] <= max(r["time_ms_samples"]) for r in records)
    assert gate.load_side(bench, gate.METRIC).points["value"].to_dict() == {
        f"bench/test_x.py::{name}": ms for name, ms in BASE.items()}


def test_gate_main_rejects_a_missing_baseline(tmp_path, capsys):
    assert gate.main(["--bench-baseline", str(tmp_path / "nope.json"), "--work", str(tmp_path / "w")]) == 2
    assert "--bench-baseline" in capsys.readouterr().err
