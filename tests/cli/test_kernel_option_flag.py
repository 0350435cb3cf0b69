"""``--kernel-option NAME=VALUE`` on layer, profile, check-cp and sweep: a good value reaches the kernel
choice (the Triton attention forward's launch pinned to a tile its ladder would not pick, seen in what
ran), a bad name or value exits 2 with one line naming it, before any work."""

from __future__ import annotations

import json

import pytest

from dsv4cp.cli.main import main
from dsv4cp.kernels import triton_available

PIN = "triton_fwd_config=16,16,4,1"
RAN = "sparse_attention.fwd.config=block_h=16,block_k=16,num_warps=4,num_stages=1"
"""The ladder's first tile at these shapes is block_k=64 (interpreted: the compiled ladder's shape)."""

needs_triton = pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton's CPU interpreter")

SMALL = ["--tokens", "32", "--kernel-backend", "triton"]


@needs_triton
def test_layer_pins_the_launch(capsys):
    assert main(["layer", *SMALL, "--warmup", "0", "--reps", "1", "--kernel-option", PIN]) == 0
    out = capsys.readouterr().out
    assert RAN in out and "sparse_attention.fwd=triton" in out, out


@needs_triton
def test_profile_records_options_and_what_ran(tmp_path, capsys):
    out_dir = tmp_path / "run"
    argv = ["profile", *SMALL, "--warmup", "0", "--reps", "1", "--kernel-option", PIN,
            "--kernel-option", "topk_impl=stream", "--out", str(out_dir)]
    assert main(argv) == 0
    assert RAN in capsys.readouterr().out
    record = json.loads((out_dir / "records.jsonl").read_text().splitlines()[0])
    assert record["backends"]["sparse_attention.fwd.config"] == RAN.split("config=", 1)[1]
    assert record["kernel_options"]["triton_fwd_config"] == "16,16,4,1"
    assert record["kernel_options"]["topk_impl"] == "stream" and record["kernel_options"]["topk_keys"] == "packed"
    assert json.loads((out_dir / "meta.json").read_text())["kernel_options"]["triton_fwd_config"] == "16,16,4,1"


@needs_triton
def test_check_cp_spawned_ranks_get_the_options(capsys):
    argv = ["check-cp", "--cp", "2", "--lengths", "20,12", "--kernel-backend", "triton", "--kernel-option", PIN]
    assert main(argv) == 0
    assert RAN in capsys.readouterr().out


@needs_triton
def test_sweep_points_run_with_the_options(tmp_path, capsys):
    spec = tmp_path / "pinned.yaml"
    spec.write_text("name: pinned\nrun: {warmup: 0, reps: 1}\n"
                    "base: {preset: tiny, tokens: 32, kernel_backend: triton, pass: fwd, dtype: fp32}\n")
    out_dir = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out_dir), "--nproc", "1", "--kernel-option", PIN]) == 0
    record = json.loads((out_dir / "records.jsonl").read_text().splitlines()[0])
    assert record["status"] == "ok", record["error"]
    assert record["backends"]["sparse_attention.fwd.config"] == RAN.split("config=", 1)[1]
    assert record["kernel_options"]["triton_fwd_config"] == "16,16,4,1"


@pytest.mark.parametrize("command", [
    ["layer", "--tokens", "32"],
    ["profile", "--tokens", "32"],
    ["check-cp", "--cp", "2", "--lengths", "20,12"],
    ["sweep", "{spec}", "--out", "{out}"],
])
@pytest.mark.parametrize("assignment,message", [
    ("topk_impl=fast", "--kernel-option: topk_impl: must be one of 'chunked', 'stream', got 'fast'"),
    ("nope=1", "--kernel-option: unknown name 'nope'; choose from topk_impl, "),
    ("triton_fwd_config=64,64", "--kernel-option: triton_fwd_config: expected 'block_h,block_k,num_warps,"
                                "num_stages' (4 integers) or 'auto', got '64,64'"),
])
def test_bad_values_exit_2_naming_them(command, assignment, message, tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nbase: {preset: tiny, tokens: 32}\n")
    argv = [word.format(spec=spec, out=tmp_path / "run") for word in command]
    assert main([*argv, "--kernel-option", assignment]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert lines[0].startswith(f"dsv4cp {command[0]}: error: ")
    assert captured.out == "" and not (tmp_path / "run" / "records.jsonl").exists()


def test_env_lists_every_option_with_its_value_and_source(monkeypatch, capsys):
    from dsv4cp.kernel_options import OPTIONS

    for option in OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.setenv("DSV4CP_TOPK_KEYS", "scores")
    assert main(["env", "--device", "cpu", "--kernel-option", "triton_fwd_config=64,64,4,2"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    listed = {line.split(" ", 1)[0]: line for line in lines if line.split(" ", 1)[0] in OPTIONS}
    assert list(listed) == list(OPTIONS)
    assert "= scores (env; DSV4CP_TOPK_KEYS;" in listed["topk_keys"]
    assert "= 64,64,4,2 (explicit; DSV4CP_TRITON_FWD_CONFIG;" in listed["triton_fwd_config"]
    assert "= chunked (default; DSV4CP_TOPK_IMPL;" in listed["topk_impl"]


@pytest.mark.parametrize("command", [["layer", "--tokens", "32"], ["profile", "--tokens", "32"]])
def test_a_bad_variable_exits_2_before_any_work(command, monkeypatch, capsys):
    monkeypatch.setenv("DSV4CP_TOPK_IMPL", "radix")
    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        f"dsv4cp {command[0]}: error: DSV4CP_TOPK_IMPL: must be one of 'chunked', 'stream', got 'radix' "
        "(kernel option topk_impl)"]
    monkeypatch.delenv("DSV4CP_TOPK_IMPL")
