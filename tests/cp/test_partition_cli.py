"""``--partition`` end to end: ``dsv4cp model`` prints the split and both policies' predictions, a
sweep's ``partition`` axis runs balanced points, ``check-cp --partition balanced`` passes."""

from __future__ import annotations

import pytest
import yaml

from dsv4cp.cli.main import main
from dsv4cp.cp.partition import RowSplit
from dsv4cp.records import read_records


def test_model_prints_the_balanced_split_and_both_policies(capsys) -> None:
    assert main(["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--cp", "4",
                 "--partition", "balanced", "--align", "8"]) == 0
    out = capsys.readouterr().out
    split_line = next(line for line in out.splitlines() if line.startswith("split points: "))
    bounds = tuple(int(b) for b in split_line.removeprefix("split points: ").split(", "))
    split = RowSplit(bounds).validate(65536, 4, 128)
    assert split.rank_rows[0] > split.rank_rows[-1] and all(b % 8 == 0 for b in bounds)
    policies = {
        line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["equal"], ["balanced"])
    }
    # columns: partition, min_rows, max_rows, max_compute_ms, mean_compute_ms, max/mean, bound_overlap_ms
    equal, balanced = float(policies["equal"][5]), float(policies["balanced"][5])
    assert balanced < 1.005 < 1.05 < equal, policies
    assert "partition=balanced" in out


def test_model_rejects_a_bad_partition(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["model", "--partition", "zigzag"])
    assert "--partition" in capsys.readouterr().err


def test_sweep_partition_axis_runs_balanced_points(tmp_path) -> None:
    spec = tmp_path / "partition.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "partition", "run": {"warmup": 0, "reps": 1},
        "base": {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "overlap": "async", "cp": 2,
                 "tokens": 192, "ratio": 4, "pass": "fwd+bwd", "packing": "one"},
        "axes": {"partition": ["equal", "balanced"]},
    }))
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "2", "--progress", "off"]) == 0
    records = read_records(out)
    assert [r["partition"] for r in records] == ["equal", "balanced"]
    assert all(r["status"] == "ok" for r in records), [r["status"] for r in records]
    # same work on another split: the model's FLOPs agree, not its per-rank bound
    equal, balanced = records
    assert balanced["model_flops"] == pytest.approx(equal["model_flops"])
    assert balanced["bound_ms"] != equal["bound_ms"]


@pytest.mark.slow
def test_check_cp_balanced_passes(capsys) -> None:
    assert main(["check-cp", "--cp", "3", "--lengths", "5,127,0,300", "--partition", "balanced"]) == 0
    out = capsys.readouterr().out
    assert "partition=balanced split=(0, " in out and "FAIL" not in out
