"""``dsv4cp model``: the per-phase table, the extrapolation and bad input."""

from __future__ import annotations

import pandas as pd

from dsv4cp.cli.main import main
from dsv4cp.model import COLUMNS


def test_model_cli_flash_cp2(capsys):
    assert main(["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    for phase in ("halo", "indexer.score", "allgather.kv", "sparse_attn", "indexer.loss"):
        assert phase in out
    assert "fwd+bwd" in out and "TFLOP/s/GPU" in out


def test_model_cli_internode_per_rank_csv(tmp_path, capsys):
    path = tmp_path / "records.csv"
    argv = ["model", "--preset", "tiny", "--ratio", "8", "--tokens", "512", "--cp", "4", "--packing",
            "histogram", "--machine", "internode", "--bandwidth", "25", "--per-rank", "--csv", str(path)]
    assert main(argv) == 0
    assert "25 GB/s" in capsys.readouterr().out
    assert list(pd.read_csv(path).columns) == list(COLUMNS)


def test_model_cli_extrapolate(capsys):
    argv = ["model", "--preset", "flash", "--ratio", "4", "--extrapolate", "--machine", "internode",
            "--cps", "8,64", "--tokens-per-rank", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "comm/attn" in out and "exceeds" in out


def test_model_cli_bad_input(capsys):
    assert main(["model", "--preset", "tiny", "--tokens", "100", "--cp", "3"]) == 2
    assert "divisible" in capsys.readouterr().err
