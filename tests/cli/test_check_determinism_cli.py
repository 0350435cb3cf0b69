"""``dsv4cp check-determinism``: a replay in this process and one in a fresh process, compared bit for bit;
bad input exits 2 naming its flag before any run."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4cp.cli.main import main


def test_cp1_replays_and_fresh_process_are_identical(capsys):
    code = main(["check-determinism", "--cp", "1", "--lengths", "9,0,23", "--replays", "2", "--ties",
                 "--deterministic"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fresh process (cp 1)" in out and "claims bitwise replay: yes" in out
    for quantity in ("out", "indexer_loss", "selected", "x_grad", "grad/wkv.weight"):
        assert any(line.startswith(quantity + " ") and "cp=1: identical" in line for line in out.splitlines()), out
    assert "ties cp=1: 0 of 32 rows break the earliest-entry rule" in out


@pytest.mark.parametrize("argv,flag", [
    (["--ties", "--ratio", "0"], "--ties:"),
    (["--kernel-backend", "nope"], "--kernel-backend:"),
])
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys):
    code = main(["check-determinism", "--cp", "1", "--lengths", "9,23", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"dsv4cp check-determinism: error: {flag}"), err


def test_zero_replays_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["check-determinism", "--replays", "0"])
    assert raised.value.code == 2 and "--replays" in capsys.readouterr().err


def test_a_nonfinite_step_fails_although_its_nans_replay_bit_for_bit(monkeypatch, capsys):
    from dsv4cp.cli import check_determinism
    from dsv4cp.harness import build

    original = build.randomize_

    def poisoned(layer, generator):  # one NaN weight: every replay computes the same NaNs
        original(layer, generator)
        with torch.no_grad():
            layer.wkv.weight.view(-1)[0] = math.nan

    monkeypatch.setattr(build, "randomize_", poisoned)
    # the fresh process would not see the poisoned weight: replay it here instead
    monkeypatch.setattr(check_determinism, "_fresh_process", lambda args, extra: {
        1: [check_determinism.replay_rank(0, 1, torch.device("cpu"),
                                          check_determinism._replay_case(args, 1, torch.device("cpu")))[0]]})
    code = main(["check-determinism", "--cp", "1", "--lengths", "9,23", "--ratio", "0", "--replays", "2"])
    out = capsys.readouterr().out
    assert "quantities identical in every run" in out  # the bits agree ...
    assert code == 1, out  # ... and the check fails all the same, naming what is not finite
    assert "FAIL: non-finite (NaN or infinity) at cp=1: out, x_grad" in out, out
