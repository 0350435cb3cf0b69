"""Every bad input the CLI must name (and the silent wrong outputs of ranks given different batches) as one table.

CLI rows run in-process through the entry point ``dsv4cp.cli.main.main(argv)`` and assert the exit
code, the FIRST line of stderr and that nothing reached stdout (nothing is measured, then lost). API
rows call the library and assert the ``ValueError`` message. A few rows run as real subprocesses to
prove that no traceback reaches a user.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.model.machine import Machine
from dsv4cp.model.memory import peak_bytes_estimate
from dsv4cp.ops import sparse_attention
from dsv4cp.packing import PackedSeqs


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Bad and good paths the table refers to as {name}."""
    garbage_db = tmp_path / "garbage.sqlite"
    garbage_db.write_text("this is not a database\n")
    bad_traces = tmp_path / "traces"
    bad_traces.mkdir()
    (bad_traces / "rank0.json").write_text("{not json")
    bad_machine = tmp_path / "machine.json"
    bad_machine.write_text("peak_flops = 1e12")
    partial_machine = tmp_path / "partial.json"
    partial_machine.write_text('{"peak_flops": 1e12}')
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {"garbage_db": str(garbage_db), "bad_traces": str(bad_traces), "bad_machine": str(bad_machine),
            "partial_machine": str(partial_machine), "missing": str(tmp_path / "missing"),
            "a_file": str(a_file), "tmp": str(tmp_path)}


# (id, argv, exit code, first stderr line as a regex, whether the row only holds on a machine without CUDA)
CLI_CASES = [
    ("check-cp-nccl-without-cuda", ["check-cp", "--dist-backend", "nccl"], 2,
     r"dsv4cp check-cp: error: --dist-backend: nccl needs CUDA GPUs and none is available here; "
     r"use --dist-backend gloo$", True),
    ("layer-device-foo", ["layer", "--device", "foo"], 2,
     r"dsv4cp layer: error: --device: must be cpu or cuda\[:N\], got 'foo'$", False),
    ("layer-device-cuda-without-cuda", ["layer", "--device", "cuda"], 2,
     r"dsv4cp layer: error: --device: cuda requested but no CUDA device is available", True),
    ("overlap-garbage-sqlite", ["overlap", "{garbage_db}"], 2,
     r"dsv4cp overlap: error: PATH: .*garbage.sqlite is not an Nsight Systems SQLite export "
     r"\(file is not a database\)$", False),
    ("overlap-csv-missing-folder", ["overlap", "{bad_traces}", "--csv", "{missing}/dir/o.csv"], 2,
     r"dsv4cp overlap: error: --csv: folder .*missing/dir does not exist$", False),
    ("overlap-garbage-rank0-json", ["overlap", "{bad_traces}"], 2,
     r"dsv4cp overlap: error: PATH: .*rank0.json is not a Kineto trace: JSONDecodeError: ", False),
    ("overlap-missing-path", ["overlap", "{missing}"], 2, r"dsv4cp overlap: error: PATH: .*missing does not exist$",
     False),
    ("layer-out-of-memory-refused", ["layer", "--tokens", "1000000000"], 3,
     r"dsv4cp layer: error: estimated peak \d+\.\d GiB per rank exceeds the \d+\.\d GiB free on cpu; "
     r"what fits: --tokens about \d+", True),
    ("layer-old-backend-flag", ["layer", "--backend", "torch"], 2,
     r"dsv4cp layer: error: --backend was renamed: use --kernel-backend", False),
    ("check-cp-old-backend-flag", ["check-cp", "--backend", "nccl"], 2,
     r"dsv4cp check-cp: error: --backend was renamed: use --kernel-backend", False),
    ("layer-unknown-kernel-backend", ["layer", "--kernel-backend", "nope"], 2,
     r"dsv4cp layer: error: --kernel-backend: unknown sparse-attention backend 'nope'", False),
    ("layer-tokens-zero", ["layer", "--tokens", "0"], 2,
     r"dsv4cp layer: error: argument --tokens: must be a positive int, got '0' \(see 'dsv4cp layer --help'\)$", False),
    ("layer-tokens-below-lengths", ["layer", "--tokens", "100", "--lengths", "50,60"], 2,
     r"dsv4cp layer: error: --tokens: 100 is fewer than the padded documents' 110 rows$", False),
    ("layer-lengths-not-ints", ["layer", "--lengths", "5,x"], 2,
     r"dsv4cp layer: error: --lengths: must be comma-separated ints, got '5,x'$", False),
    ("check-cp-tokens-not-divisible", ["check-cp", "--tokens", "301", "--cp", "2"], 2,
     r"dsv4cp check-cp: error: --tokens: ", False),
    ("profile-nccl-without-cuda", ["profile", "--dist-backend", "nccl"], 2,
     r"dsv4cp profile: error: --dist-backend: nccl needs CUDA GPUs", True),
    ("profile-gloo-outside-torchrun", ["profile", "--dist-backend", "gloo"], 2,
     r"dsv4cp profile: error: --dist-backend: gloo has no effect on a single-process run", False),
    ("profile-trace-steps-zero", ["profile", "--trace-steps", "0"], 2,
     r"dsv4cp profile: error: argument --trace-steps: must be a positive int", False),
    ("profile-trace-dir-is-a-file", ["profile", "--trace-dir", "{a_file}"], 2,
     r"dsv4cp profile: error: --trace-dir: .*a_file exists and is not a directory$", False),
    ("profile-out-is-a-file", ["profile", "--out", "{a_file}"], 2,
     r"dsv4cp profile: error: --out: .*a_file exists and is not a directory$", False),
    ("model-csv-missing-folder", ["model", "--csv", "{missing}/dir/m.csv"], 2,
     r"dsv4cp model: error: --csv: folder .*missing/dir does not exist$", False),
    ("model-machine-file-not-json", ["model", "--machine-file", "{bad_machine}"], 2,
     r"dsv4cp model: error: --machine-file: .*machine.json is not valid JSON", False),
    ("model-machine-file-partial", ["model", "--machine-file", "{partial_machine}"], 2,
     r"dsv4cp model: error: --machine-file .*partial.json: missing ceiling\(s\) "
     r"\['allgather_busbw', 'hbm_bandwidth', 'p2p_bandwidth'\]$", False),
    ("model-balanced-split-too-large", ["model", "--partition", "balanced", "--tokens", "1000000000000"], 2,
     r"dsv4cp model: error: --partition: balanced needs per-row costs, at most 134217728 rows", False),
    ("model-tokens-not-divisible", ["model", "--preset", "tiny", "--tokens", "100", "--cp", "3"], 2,
     r"dsv4cp model: error: --tokens: ", False),
]


@pytest.mark.parametrize(("argv", "code", "first_line", "cpu_only"), [c[1:] for c in CLI_CASES],
                         ids=[c[0] for c in CLI_CASES])
def test_cli_error(argv, code, first_line, cpu_only, files, capsys, monkeypatch):
    if cpu_only and torch.cuda.is_available():
        pytest.skip("the row describes a machine without CUDA")
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert _exit_code([a.format(**files) for a in argv]) == code
    out, err = capsys.readouterr()
    assert out == "", f"printed before failing: {out!r}"
    lines = err.strip().splitlines()
    assert lines and re.match(first_line, lines[0]), err
    assert "Traceback" not in err


def _exit_code(argv: list[str]) -> int:
    """``main``'s return value, or the code argparse exits with for a usage error."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


def test_renamed_flag_says_the_new_names(capsys):
    assert _exit_code(["layer", "--backend", "torch"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dsv4cp layer: error: --backend was renamed: use --kernel-backend (kernels) or --dist-backend "
        "(torch.distributed) (see 'dsv4cp layer --help')"
    ]


# (argv, the whole stderr: one line) of usage errors argparse finds, over several sub-commands
USAGE_ERRORS = [
    ([], "dsv4cp: error: the following arguments are required: COMMAND (see 'dsv4cp --help')"),
    (["measure"], "dsv4cp: error: argument COMMAND: invalid choice: 'measure' (choose from "),
    (["sweep"], "dsv4cp sweep: error: the following arguments are required: spec (see 'dsv4cp sweep --help')"),
    (["sweep", "s.yaml", "--nproc", "0"],
     "dsv4cp sweep: error: argument --nproc: must be a positive int, got '0' (see 'dsv4cp sweep --help')"),
    *[(["sweep", "s.yaml", "--point-timeout", value],  # beyond what a timedelta holds, none, NaN: refused
       f"dsv4cp sweep: error: argument --point-timeout: must be from 1 to 604800 s, got '{value}' "
       "(see 'dsv4cp sweep --help')") for value in ("1e30", "0.001", "nan", "inf")],
    (["report"], "dsv4cp report: error: the following arguments are required: RUN_DIR (see 'dsv4cp report --help')"),
    (["compare", "a"],
     "dsv4cp compare: error: the following arguments are required: NEW (see 'dsv4cp compare --help')"),
    (["model", "--preset", "huge"], "dsv4cp model: error: argument --preset: invalid choice: 'huge' (choose from "),
    (["layer", "--no-such-flag"], "dsv4cp layer: error: unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize(("argv", "line"), USAGE_ERRORS, ids=[" ".join(c[0]) or "no-command" for c in USAGE_ERRORS])
def test_usage_errors_are_one_line_on_stderr_and_exit_2(argv, line, capsys):
    assert _exit_code(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(line), err


def test_nccl_refused_under_torchrun_before_any_process_group(monkeypatch, capsys):
    """Under torchrun the refusal comes before ``init_process_group`` (which would need a store)."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert main(["check-cp", "--dist-backend", "nccl"]) == 2
    assert "[rank 0] --dist-backend: nccl needs CUDA" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------------------------------ API rows
def _attention_inputs(seed: int, idx_rows, topk_length=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 8, generator=gen)
    kv = torch.randn(5, 8, generator=gen)
    sink = torch.randn(2, generator=gen)
    idx = torch.tensor(idx_rows, dtype=torch.int32)
    lengths = None if topk_length is None else torch.tensor(topk_length, dtype=torch.int32)
    return q, kv, idx, sink, 8**-0.5, lengths


API_CASES = [
    ("sparse-attention-idx-equals-n",
     lambda s: sparse_attention(*_attention_inputs(s, [[0, 5], [1, -1], [2, 3]])),
     r"idx: entries must be -1 \(empty\) or in \[0, 5\) \(kv rows\), got \[5\]$"),
    ("sparse-attention-idx-negative-other-than-minus-one",
     lambda s: sparse_attention(*_attention_inputs(s, [[0, 1], [-2, -1], [2, 3]])),
     r"idx: entries must be -1 \(empty\) or in \[0, 5\) \(kv rows\), got \[-2\]$"),
    ("sparse-attention-topk-length-above-kt",
     lambda s: sparse_attention(*_attention_inputs(s, [[0, 1], [1, -1], [2, 3]], [2, 3, 0])),
     r"topk_length: entries must be in \[0, 2\], got \[3\]$"),
    ("sparse-attention-topk-length-negative",
     lambda s: sparse_attention(*_attention_inputs(s, [[0, 1], [1, -1], [2, 3]], [2, -1, 0])),
     r"topk_length: entries must be in \[0, 2\], got \[-1\]$"),
    ("packed-lengths-string", lambda s: PackedSeqs.from_lengths(["7"]),
     r"lengths\[0\]: must be a non-negative int, got '7'$"),
    ("packed-lengths-not-a-sequence", lambda s: PackedSeqs.from_lengths(7),
     r"lengths: must be a sequence of ints, got 7$"),
    ("machine-unknown-field", lambda s: Machine.from_dict({"peak_flop": 1.0}),
     r"machine: unknown field\(s\) \['peak_flop'\]"),
    ("memory-estimate-bad-direction",
     lambda s: peak_bytes_estimate(DSv4Config.preset("tiny"), 4, [8], 1, "bwd", torch.float32),
     r"direction: must be one of \('fwd', 'fwd\+bwd'\), got 'bwd'$"),
]


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_error(call, message, seed):
    with pytest.raises(ValueError) as raised:
        call(seed)
    assert re.match(message, str(raised.value)), str(raised.value)


def test_valid_indices_still_run(seed):
    """The range checks reject only what is out of range: -1 slots and full top-k lengths pass."""
    out, lse = sparse_attention(*_attention_inputs(seed, [[0, 4], [1, -1], [-1, -1]], [2, 1, 0]))
    assert torch.isfinite(out).all() and (out[2] == 0).all()


# ------------------------------------------------------------------------------------------ subprocess
# Each row starts a Python with torch (seconds): one usage error, one memory refusal.
SUBPROCESS_CASES = [
    (["overlap", "{garbage_db}"], 2),
    (["layer", "--tokens", "1000000000"], 3),
]


@pytest.mark.parametrize(("argv", "code"), SUBPROCESS_CASES, ids=[" ".join(c[0][:2]) for c in SUBPROCESS_CASES])
def test_no_traceback_reaches_the_user(argv, code, files):
    if code == 3 and torch.cuda.is_available():
        pytest.skip("the refusal row is for a CPU machine")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run([sys.executable, "-m", "dsv4cp.cli.main", *(a.format(**files) for a in argv)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "Warning" not in line]
    assert len(errors) == 1 and errors[0].startswith(f"dsv4cp {argv[0]}: error: "), done.stderr


# ------------------------------------------------------------------------------------------ GPU
_CUDA_BAD_INDEX = """
import torch
from dsv4cp.ops import sparse_attention
q, kv, sink = torch.randn(3, 2, 64, device="cuda"), torch.randn(5, 64, device="cuda"), torch.zeros(2, device="cuda")
idx = torch.tensor([[0, 5], [1, -1], [2, 3]], dtype=torch.int32, device="cuda")
sparse_attention(q, kv, idx, sink, 0.125, backend="torch")
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_checks_cost_no_sync_and_stop_a_bad_run(seed):
    from dsv4cp.ops.sparse_attention import _check_index_values  # the op's own check, apart from any backend

    _, kv, idx, _, _, lengths = (t.cuda() if isinstance(t, torch.Tensor) else t
                                 for t in _attention_inputs(seed, [[0, 4], [1, -1], [-1, -1]], [2, 1, 0]))
    torch.cuda.set_sync_debug_mode("error")
    try:
        _check_index_values(kv.shape[0], idx, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # an assertion that fired on valid input would surface here
    done = subprocess.run([sys.executable, "-c", _CUDA_BAD_INDEX], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "idx: entries must be" in done.stderr or "device-side assert" in done.stderr, done.stderr[-2000:]
