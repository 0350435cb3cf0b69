"""``dsv4cp check-determinism``: a replay in this process and one in a fresh process, compared bit for bit;
bad input exits 2 naming its flag before any run."""

from __future__ import annotations

import pytest

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
