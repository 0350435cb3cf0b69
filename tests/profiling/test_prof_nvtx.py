"""NVTX/record_function ranges: the name table, typo safety, the on/off switch and capture_range."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4cp.profiling import nvtx
from dsv4cp.profiling.nvtx import RANGE_NAMES, capture_range, full_name, nvtx_range, ranged, set_enabled

REQUIRED = [
    "dsv4cp.halo.fwd", "dsv4cp.halo.bwd", "dsv4cp.q_proj.fwd", "dsv4cp.kv_proj.fwd", "dsv4cp.compress.fwd",
    "dsv4cp.compress.bwd", "dsv4cp.indexer.compress.fwd", "dsv4cp.indexer.score.fwd", "dsv4cp.indexer.topk.fwd",
    "dsv4cp.indexer.loss.fwd", "dsv4cp.indexer.loss.bwd", "dsv4cp.allgather.kv.launch", "dsv4cp.allgather.kv.wait",
    "dsv4cp.allgather.index_k.launch", "dsv4cp.allgather.index_k.wait", "dsv4cp.sparse_attn.fwd",
    "dsv4cp.sparse_attn.bwd", "dsv4cp.reducescatter.kv.launch", "dsv4cp.reducescatter.kv.wait",
    "dsv4cp.reducescatter.index_k.launch", "dsv4cp.reducescatter.index_k.wait", "dsv4cp.out_proj.fwd",
    "dsv4cp.mtp.roll.fwd", "dsv4cp.mtp.roll.bwd", "dsv4cp.step",
]


@pytest.fixture(autouse=True)
def restore_switch():
    before = nvtx.is_enabled()
    yield
    set_enabled(before)


def test_table_holds_every_documented_name_once():
    assert set(REQUIRED) <= set(RANGE_NAMES)
    assert len(set(RANGE_NAMES)) == len(RANGE_NAMES)
    assert full_name("sparse_attn.fwd") == "dsv4cp.sparse_attn.fwd"


@pytest.mark.parametrize("enabled", [True, False])
def test_unknown_names_raise(enabled):
    set_enabled(enabled)
    for bad in ("sparse_attn.fwdd", "dsv4cp.sparse_attn.fwd", ""):
        with pytest.raises(ValueError, match="PHASES"):
            nvtx_range(bad)
    with pytest.raises(ValueError, match="PHASES"):
        ranged("halo.forward")


def test_push_pop_balanced_with_cached_attributes(monkeypatch):
    calls = []

    class Recorder:
        def push_range(self, attributes):
            calls.append(("push", attributes))

        def pop_range(self):
            calls.append(("pop", None))

    monkeypatch.setattr(nvtx, "_DOMAIN_HANDLE", Recorder())
    set_enabled(True)
    for _ in range(2):
        with nvtx_range("halo.fwd"):
            pass
    with pytest.raises(RuntimeError):
        with nvtx_range("halo.bwd"):
            raise RuntimeError("the range must still be popped")
    assert [kind for kind, _ in calls] == ["push", "pop"] * 3
    assert calls[0][1] is calls[2][1]  # one EventAttributes per name, reused


def _annotations(prof_dir, fn) -> tuple[list[str], torch.Tensor]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        out = fn()
    path = prof_dir / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("dsv4cp.")]
    return names, out


def test_switch_turns_ranges_off_with_identical_numerics(tmp_path):
    torch.manual_seed(0)
    x, w = torch.randn(64, 96), torch.randn(96, 32)

    @ranged("indexer.score.fwd")
    def score(a):
        return a.relu()

    def work():
        with nvtx_range("compress.fwd"):
            y = x @ w
        return score(y)

    set_enabled(True)
    (tmp_path / "on").mkdir()
    names_on, out_on = _annotations(tmp_path / "on", work)
    set_enabled(False)
    (tmp_path / "off").mkdir()
    names_off, out_off = _annotations(tmp_path / "off", work)
    assert sorted(names_on) == ["dsv4cp.compress.fwd", "dsv4cp.indexer.score.fwd"]
    assert names_off == []
    assert torch.equal(out_on, out_off)
    # switched off, every name gets the same shared null context: no per-call objects
    assert nvtx_range("step") is nvtx_range("halo.fwd")


def test_env_var_read_at_import():
    code = (
        "import importlib, os\n"
        "import dsv4cp.profiling.nvtx as m\n"
        "print(m.is_enabled())\n"
        "os.environ['DSV4CP_NVTX'] = 'yes'\n"
        "try:\n"
        "    importlib.reload(m)\n"
        "except ValueError as err:\n"
        "    print('ValueError', err)\n"
    )
    env = dict(os.environ, DSV4CP_NVTX="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("ValueError") and "DSV4CP_NVTX" in lines[1]


def test_capture_range_brackets_work():
    with capture_range():
        value = torch.ones(3).sum()
    assert value.item() == 3.0
