"""``dsv4cp profile --cp N --emulate-rank R``: one process measures rank R of a CP = N run alone.

The record names the emulated rank (a point of its own: its id differs from the real run's, which
keeps its old id), holds the rank's time and memory at its own index and None at the others, leaves
the imbalance and the communication metrics empty, and the output says communication is not
measured. Bad flag combinations are refused before any process group exists.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dsv4cp.cli.main import main
from dsv4cp.records import point_id, read_records
from dsv4cp.sweeps.spec import make_point

COMMON = ["profile", "--preset", "tiny", "--tokens", "256", "--ratio", "4", "--kernel-backend", "torch",
          "--warmup", "0", "--reps", "2", "--progress", "off"]


pytestmark = pytest.mark.usefixtures("single_process")  # tests/conftest.py


def test_emulated_profile_records_one_rank(tmp_path, capsys, seed):
    out = tmp_path / "run"
    args = [*COMMON, "--seed", str(seed % 1000), "--backward", "--out", str(out)]
    for rank in (1, 0):
        assert main([*args, "--cp", "2", "--emulate-rank", str(rank)]) == 0
        text = capsys.readouterr().out
        assert f"EMULATED rank {rank} of cp 2" in text and "communication NOT measured" in text
        assert f"rank {1 - rank}: peak" not in text
    assert not dist.is_initialized()
    first, second = read_records(out)
    for record, rank in ((first, 1), (second, 0)):
        assert record["emulated_rank"] == rank and record["cp"] == 2 and record["status"] == "ok"
        times, peaks = record["rank_time_ms_median"], record["peak_allocated_bytes"]
        assert times[1 - rank] is None and peaks[1 - rank] is None
        assert times[rank] > 0 and peaks[rank] > 0 and record["time_ms_median"] > 0
        assert record["imbalance_max_over_mean"] is None and record["exposed_comm_ms"] is None
    assert first["point_id"] != second["point_id"]
    real = {**{k: v for k, v in first.items() if k != "emulated_rank"}, "emulated_rank": None}
    assert point_id(real) not in (first["point_id"], second["point_id"])


def test_real_points_keep_their_ids():
    """Records written before the ``emulated_rank`` axis existed have no such key: same id as now."""
    axes = make_point({"preset": "tiny", "cp": 2, "tokens": 256}).axes()
    assert axes["emulated_rank"] is None
    older = {name: value for name, value in axes.items() if name != "emulated_rank"}
    assert point_id(axes) == point_id(older) == "1882ba87eca3"  # the id the records.py of commit 3a2923b gave


@pytest.mark.parametrize(("extra", "flag"), [
    (["--emulate-rank", "0"], "--cp"),
    (["--cp", "2"], "--cp"),
    (["--cp", "1", "--emulate-rank", "0"], "--cp"),
    (["--cp", "2", "--emulate-rank", "2"], "--emulate-rank"),
])
def test_bad_emulation_flags_are_refused(extra, flag, capsys):
    assert main([*COMMON, *extra]) == 2
    assert flag in capsys.readouterr().err
    assert not dist.is_initialized()


def test_emulation_is_refused_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*COMMON, "--cp", "2", "--emulate-rank", "0"]) == 2
    assert "--emulate-rank" in capsys.readouterr().err and not dist.is_initialized()


def test_a_sweep_spec_cannot_ask_for_an_emulated_rank():
    with pytest.raises(ValueError, match="emulated_rank"):
        make_point({"preset": "tiny", "cp": 2, "tokens": 256, "emulated_rank": 0})
