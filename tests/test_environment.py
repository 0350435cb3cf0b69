"""One environment dump (dsv4cp.environment) behind ``dsv4cp env`` and every meta.json, and one
hardware label behind records and benchmarks."""

from __future__ import annotations

import os

import torch

from dsv4cp import environment as env_module
from dsv4cp import kernel_options
from dsv4cp.cli.main import main
from dsv4cp.environment import GIT_SHA_ENV, environment, git_dirty, git_sha, machine_label
from dsv4cp.records import META_FIELDS
from dsv4cp.sweeps.meta import run_meta


def test_machine_label_names_the_hardware_and_the_rank_count(monkeypatch):
    assert machine_label("cpu") == machine_label("cpu", 4) == f"cpu-{os.cpu_count()}core"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert machine_label(torch.device("cuda", 0)) == "NVIDIA H200"  # a benchmark's label
    assert machine_label(torch.device("cuda", 0), 2) == "2xNVIDIA H200"  # a run's label


def test_meta_json_holds_the_environment_fields_it_records(monkeypatch):
    monkeypatch.setenv(GIT_SHA_ENV, "0123abc")
    meta = run_meta(2, torch.device("cpu"), {"name": "t"})
    identity = {"spec_hash", "point_ids"}  # a sweep's identity: the runner adds it (dsv4cp.sweeps.identity)
    assert set(meta) == set(META_FIELDS) - {"schema"} - identity
    info = environment("cpu", 2)
    for name in set(META_FIELDS) - {"schema", "time_utc", "spec", "kernel_options"} - identity:
        assert meta[name] == info[name], name
    assert meta["git_sha"] == "0123abc" and meta["git_dirty"] is None  # the variable wins over git
    assert meta["machine"] == machine_label("cpu") and meta["gpu_count"] == 0 and meta["torch"] == torch.__version__
    assert set(meta["optional_backends"]) == set(env_module.OPTIONAL_PACKAGES)
    assert meta["kernel_options"] == kernel_options.resolved()  # every option's value, as records hold them


def test_git_sha_falls_back_to_the_checkout(monkeypatch):
    monkeypatch.delenv(GIT_SHA_ENV, raising=False)
    sha = git_sha()
    if sha is not None:  # a copy without .git has no sha to read
        assert len(sha) == 40 and int(sha, 16) >= 0 and git_dirty() in (True, False)


def test_env_prints_every_environment_field(capsys, monkeypatch):
    monkeypatch.setenv(GIT_SHA_ENV, "0123abc")
    assert main(["env", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    lines = lines[:next(i for i, line in enumerate(lines) if line.strip().startswith("backends:"))]
    printed = dict(line.strip().split(": ", 1) for line in lines)  # the environment, before the backends
    info = environment("cpu")
    for name in set(info) - {"optional_backends", "devices"}:
        assert printed[name] == str(info[name]), name
    for name, version in info["optional_backends"].items():
        assert printed[name] == (version or "missing"), name
    assert printed["git_sha"] == "0123abc"
