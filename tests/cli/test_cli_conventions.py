"""The conventions every sub-command shares: help, names, defaults, progress, output paths."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from dsv4cp.cli.common import (
    EXIT_OOM,
    EXIT_USAGE,
    check_output_dir,
    check_output_file,
    flag_message,
    free_bytes,
    progress_enabled,
    run_command,
)
from dsv4cp.cli.main import COMMANDS, build_parser, main
from dsv4cp.profiling.progress import step_progress
from dsv4cp.profiling.timing import benchmark

MEASURING = ("layer", "check-cp", "profile")
"""Commands that run the layer (and so share its options' defaults)."""


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1] if a.option_strings else a.dest: a for a in parser._actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_a_help_line_and_shows_its_default(command):
    parser = _subparsers()[command]
    text = parser.format_help()
    for name, action in _options(parser).items():
        assert action.help, f"{command} {name} has no help line"
        meaningful = action.default is not None and not isinstance(action, argparse._StoreTrueAction)
        if meaningful and action.option_strings:
            assert f"(default: {action.default})" in " ".join(text.split()), f"{command} {name}"


def test_examples_in_descriptions_stay_as_written():
    text = _subparsers()["model"].format_help()
    assert "\n  dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2\n" in text
    top = build_parser().format_help()
    assert "\n  dsv4cp layer --preset tiny --ratio 4 --tokens 4096 --backward\n" in top
    assert "exit codes:\n  0  success" in top and "  3  out of memory" in top


def test_one_name_per_meaning():
    """--kernel-backend is always the kernels, --dist-backend always torch.distributed; no live --backend."""
    for command, parser in _subparsers().items():
        options = _options(parser)
        assert "--backend" not in options, command
        if "--dist-backend" in options:
            assert set(options["--dist-backend"].choices) == {"gloo", "nccl"}
    for command in MEASURING:
        assert "--kernel-backend" in _options(_subparsers()[command])


def test_defaults_agree_across_the_measuring_commands():
    parsers = _subparsers()
    for option in ("--preset", "--ratio", "--packing", "--loss", "--seed", "--kernel-backend"):
        defaults = {c: _options(parsers[c])[option].default for c in MEASURING}
        assert len(set(defaults.values())) == 1, (option, defaults)
    assert _options(parsers["check-cp"])["--overlap"].default == _options(parsers["profile"])["--overlap"].default
    # model differs on --preset on purpose, and says so in its source; its --ratio agrees
    assert _options(parsers["model"])["--ratio"].default == _options(parsers["layer"])["--ratio"].default


def test_field_names_become_the_flags_users_typed():
    assert flag_message("total: must be >= the padded end 110, got 100") == (
        "--tokens: must be >= the padded end 110, got 100")
    assert flag_message("lengths[2]: must be a non-negative int, got -1") == (
        "--lengths[2]: must be a non-negative int, got -1")
    assert flag_message("backend: unknown") == "--kernel-backend: unknown"
    assert flag_message("window: stays as it is") == "window: stays as it is"


def test_output_paths_are_checked_before_any_work(tmp_path):
    assert check_output_file(tmp_path / "x.csv", "--csv") == tmp_path / "x.csv"
    with pytest.raises(ValueError, match=r"^--csv: folder .*nowhere does not exist$"):
        check_output_file(tmp_path / "nowhere" / "x.csv", "--csv")
    with pytest.raises(ValueError, match=r"^--csv: .* is a directory, expected a file path$"):
        check_output_file(tmp_path, "--csv")
    made = check_output_dir(tmp_path / "a" / "b", "--trace-dir")
    assert made.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^--trace-dir: .*file exists and is not a directory$"):
        check_output_dir(tmp_path / "file", "--trace-dir")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match=r"^--out: folder .*locked is not writable$"):
            check_output_file(locked / "x.jsonl", "--out")


def test_benchmark_reports_every_step_to_the_progress_callback():
    seen: list[str] = []
    result = benchmark(lambda: None, warmup=2, reps=3, device="cpu", on_step=seen.append)
    assert seen == ["warmup", "warmup", "timed", "timed", "timed"] and result.reps == 3


def test_progress_bar_draws_on_stderr_only_when_enabled(capsys):
    with step_progress(1, 1, extra=1, enabled=True, desc="layer") as advance:
        for phase in ("warmup", "timed", "memory"):
            advance(phase)
    out, err = capsys.readouterr()
    assert out == "" and "layer:" in err and "/3 " in err
    with step_progress(1, 2, enabled=False) as advance:
        assert advance is None
    assert progress_enabled("on", rank=0) and not progress_enabled("on", rank=1)
    assert not progress_enabled("off") and not progress_enabled("auto")  # pytest's stderr is no terminal


def test_layer_runs_and_reports_with_the_shared_options(capsys):
    assert main(["layer", "--tokens", "64", "--ratio", "4", "--backward", "--reps", "1", "--warmup", "0",
                 "--progress", "off", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kind=C tokens=64 docs=1" in out and "fwd+bwd: median" in out


def test_env_lists_every_backend_with_a_reason(capsys):
    from dsv4cp.ops import backend_names

    assert main(["env", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    backends = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("backends:")) + 1:]
    status = dict(line.strip().split(": ", 1) for line in backends)
    assert list(status) == backend_names()
    for name, text in status.items():
        assert text.startswith(("available", "missing (", "missing on CPU without TRITON_INTERPRET=1")), (name, text)
    assert status["torch"].startswith("available")


def test_cpu_free_memory_is_read_from_the_system():
    free = free_bytes(torch.device("cpu"))
    if not Path("/proc/meminfo").exists():
        assert free is None
    else:
        assert free is not None and 0 < free < 2**50


def _raise(err: BaseException):
    def command():
        raise err
    return command


def test_run_command_maps_errors_to_one_line_and_an_exit_code(capsys):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert run_command("profile", _raise(oom)) == EXIT_OOM
    assert capsys.readouterr().err == (
        "dsv4cp profile: error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); try more ranks "
        "(--cp / --nproc-per-node), --recompute, fewer --tokens or a smaller --preset\n")
    assert run_command("overlap", _raise(FileNotFoundError(2, "No such file or directory", "x.json"))) == EXIT_USAGE
    assert capsys.readouterr().err == "dsv4cp overlap: error: x.json: No such file or directory\n"
    assert run_command("layer", _raise(ValueError("total: must be positive, got 0"))) == EXIT_USAGE
    assert capsys.readouterr().err == "dsv4cp layer: error: --tokens: must be positive, got 0\n"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_command("layer", _raise(KeyError("bug")))


def test_adversarial_packing_is_built_for_the_commands_ranks(seed):
    """--packing adversarial needs the rank count: check-cp and profile pass theirs, as the sweeps do."""
    from dsv4cp.cli.common import layer_inputs
    from dsv4cp.workloads import packing_lengths

    args = _subparsers()["check-cp"].parse_args(["--tokens", "64", "--packing", "adversarial", "--ratio", "4",
                                                 "--seed", str(seed % 1000)])
    inputs = layer_inputs(args, 2)
    assert inputs.lengths == packing_lengths("adversarial", 64, cp=2, ratio=4, seed=seed % 1000)
    assert inputs.packed.total == 64 and len(inputs.lengths) > 2


def test_model_builds_the_adversarial_packing_for_its_cp_and_ratio(capsys, seed):
    """``model --packing adversarial`` models the batch the sweeps and profile measure (not a refusal for
    want of a rank count, nor documents up to the fixed packing's --doc-len)."""
    from dsv4cp.workloads import packing_lengths

    argv = ["model", "--preset", "tiny", "--packing", "adversarial", "--tokens", "256", "--ratio", "4", "--cp", "2",
            "--seed", str(seed % 1000)]
    assert main(argv) == 0
    docs = len(packing_lengths("adversarial", 256, cp=2, ratio=4, seed=seed % 1000))
    assert f" docs={docs} " in capsys.readouterr().out
