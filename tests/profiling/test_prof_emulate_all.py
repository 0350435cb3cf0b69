"""``dsv4cp profile --cp N --emulate-rank all``: every rank of a CP = N run measured in turn in one process.

The run directory gets one record per rank (as ``--emulate-rank R`` writes it) and a summary record whose
per-rank lists are complete, whose time is the slowest rank's and whose imbalance is max/mean of the
per-rank medians; the summary arithmetic is checked on random per-rank metrics too.
"""

from __future__ import annotations

import json
import random

import pytest
import torch.distributed as dist

from dsv4cp.cli.main import main
from dsv4cp.harness.emulate import summary_metrics
from dsv4cp.records import read_records
from dsv4cp.sweeps.emulation import rank_table_lines

COMMON = ["profile", "--preset", "tiny", "--tokens", "512", "--ratio", "4", "--kernel-backend", "torch",
          "--warmup", "0", "--reps", "2", "--progress", "off", "--backward"]


pytestmark = pytest.mark.usefixtures("single_process")  # tests/conftest.py


def _rank_metrics(rank: int, cp: int, rng: random.Random) -> dict:
    """What measure_point gives for emulated rank ``rank``: its own entries, None at the others."""
    median = rng.uniform(5.0, 50.0)
    own = [None] * cp
    times, peaks, used = list(own), list(own), list(own)
    times[rank], peaks[rank], used[rank] = median, rng.randrange(1, 2**34), rng.randrange(1, 2**34)
    return {"rank_time_ms_median": times, "peak_allocated_bytes": peaks, "device_used_bytes": used,
            "time_ms_median": median, "time_ms_p20": median * 0.97, "time_ms_p80": median * 1.04,
            "tflops_per_gpu": 100.0 / median, "mfu": None, "measured_over_bound": median / 3.0,
            "measured_over_measured_bound": median / 3.5, "split": [0, 256, 512], "calibration": None,
            "model_flops": 1e9, "bound_ms": 3.0, "bound_measured_ms": 3.5, "bound_machine": "h200x2"}


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_summary_is_the_slowest_rank_and_max_over_mean(cp, seed):
    print(f"seed {seed}")
    rng = random.Random(seed * 31 + cp)
    per_rank = [_rank_metrics(rank, cp, rng) for rank in range(cp)]
    summary = summary_metrics(per_rank, tokens=4096)
    medians = [m["rank_time_ms_median"][r] for r, m in enumerate(per_rank)]
    slowest = medians.index(max(medians))
    assert summary["rank_time_ms_median"] == medians
    assert summary["slowest_rank"] == slowest and summary["slowest_rank_ms"] == max(medians)
    assert summary["imbalance_max_over_mean"] == pytest.approx(max(medians) * cp / sum(medians), rel=1e-12)
    assert summary["time_ms_median"] == per_rank[slowest]["time_ms_median"]
    assert summary["time_ms_p80"] == per_rank[slowest]["time_ms_p80"]
    for name in ("measured_over_bound", "measured_over_measured_bound", "bound_ms", "bound_measured_ms",
                 "bound_machine"):
        assert summary[name] == per_rank[slowest][name]
    assert summary["tokens_per_s"] == pytest.approx(4096 / (max(medians) / 1e3), rel=1e-12)
    assert summary["peak_allocated_bytes"] == [m["peak_allocated_bytes"][r] for r, m in enumerate(per_rank)]
    assert None not in summary["device_used_bytes"]
    lines = rank_table_lines({**summary})
    assert len(lines) == cp + 2 and f"slowest rank {slowest}" in lines[-1]


def test_summary_refuses_a_rank_without_its_own_time(seed):
    rng = random.Random(seed)
    per_rank = [_rank_metrics(rank, 2, rng) for rank in range(2)]
    per_rank[1]["rank_time_ms_median"] = [per_rank[1]["time_ms_median"], None]  # rank 1's time at rank 0
    with pytest.raises(ValueError, match=r"per_rank\[1\]"):
        summary_metrics(per_rank, tokens=512)


def test_emulate_all_records_every_rank_and_a_summary(tmp_path, capsys, seed):
    out = tmp_path / "run"
    cp = 3
    args = [*COMMON, "--seed", str(seed % 1000), "--cp", str(cp), "--emulate-rank", "all", "--out", str(out),
            "--partition", "balanced", "--tokens", "768"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "EVERY rank emulated in turn" in text and "communication NOT measured" in text
    assert not dist.is_initialized()
    records = read_records(out)
    assert len(records) == cp + 1
    ranks, summary = records[:cp], records[cp]
    assert [r["emulated_rank"] for r in ranks] == list(range(cp)) and summary["emulated_rank"] == "all"
    assert all(r["emulated"] for r in records)
    assert len({r["point_id"] for r in records}) == cp + 1
    medians = [r["rank_time_ms_median"][rank] for rank, r in enumerate(ranks)]
    assert summary["rank_time_ms_median"] == medians
    assert summary["imbalance_max_over_mean"] == pytest.approx(max(medians) * cp / sum(medians), rel=1e-12)
    assert summary["slowest_rank_ms"] == max(medians) and summary["partition"] == "balanced"
    assert summary["split"] == ranks[0]["split"] and summary["cp"] == cp and summary["tokens"] == 768
    assert all(peak > 0 for peak in summary["peak_allocated_bytes"])


def test_emulate_all_refuses_a_bad_rank_word():
    with pytest.raises(SystemExit) as exit_info:
        main([*COMMON, "--cp", "2", "--emulate-rank", "every"])
    assert exit_info.value.code == 2


def test_emulate_a_sample_of_ranks_records_each(tmp_path, capsys, seed):
    out = tmp_path / "run"
    assert main([*COMMON, "--seed", str(seed % 1000), "--cp", "4", "--emulate-rank", "3,0", "--out", str(out)]) == 0
    assert "EVERY rank" not in capsys.readouterr().out
    records = read_records(out)
    assert [r["emulated_rank"] for r in records] == [3, 0]
    assert records[0]["rank_time_ms_median"][3] > 0 and records[0]["rank_time_ms_median"][0] is None


@pytest.mark.parametrize("ranks", ["0,0", "1,4"])
def test_emulate_a_bad_sample_is_refused(ranks, capsys):
    """A repeated rank is refused by the parser, a rank outside the cp by the flag check: exit 2 both."""
    try:
        code = main([*COMMON, "--cp", "4", "--emulate-rank", ranks])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2 and "--emulate-rank" in capsys.readouterr().err


def test_measured_partition_rounds_then_reuse_of_its_files(tmp_path, capsys, seed):
    out, split_file, cal_file = tmp_path / "run", tmp_path / "split.json", tmp_path / "cal.json"
    args = [*COMMON, "--seed", str(seed % 1000), "--cp", "2", "--emulate-rank", "all", "--partition", "measured",
            "--max-rounds", "2", "--target-imbalance", "1.0"]
    assert main([*args, "--out", str(out), "--save-split", str(split_file), "--save-calibration", str(cal_file)]) == 0
    text = capsys.readouterr().out
    assert "round 0: split" in text and "measured split: round" in text and "per-rank factors of the refit" in text
    records = read_records(out)
    assert [r["emulated_rank"] for r in records] == [0, 1, "all"]
    assert all(r["partition"] == "measured" and r["calibration"] for r in records)
    saved = json.loads(split_file.read_text())
    assert records[-1]["split"] == saved["split"] and 1 <= len(saved["rounds"]) <= 2
    again = tmp_path / "again"
    assert main([*args[:-4], "--split-file", str(split_file), "--calibration", str(cal_file), "--out", str(again)]) == 0
    assert "round 0" not in capsys.readouterr().out
    assert read_records(again)[-1]["split"] == saved["split"]


@pytest.mark.parametrize(("extra", "flag"), [
    (["--cp", "2", "--emulate-rank", "0", "--partition", "measured"], "--partition measured"),
    (["--cp", "2", "--emulate-rank", "all", "--split-file", "x.json"], "--split-file"),
    (["--cp", "2", "--emulate-rank", "all", "--save-split", "x.json"], "--save-split"),
])
def test_measured_partition_misuse_is_refused(extra, flag, capsys):
    assert main([*COMMON, *extra]) == 2
    assert flag in capsys.readouterr().err
