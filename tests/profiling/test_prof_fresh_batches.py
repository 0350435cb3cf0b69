"""``dsv4cp profile --fresh-batches N``: the steps cycle through N batches, each building its layout.

Two gloo ranks measure one point on fresh batches and on its one repeated batch: with fresh batches
every timed and traced step of every rank builds a layout (counted by a spy on the builder the layout
cache calls), on the repeated batch none does, and both traced runs give their phase tables. The CLI
records the option, prints it, and refuses a bad count, a CUDA graph, or batches that do not fit,
before any work.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from dsv4cp.cli import profile
from dsv4cp.cli.main import main
from dsv4cp.cp import layout_cache
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.fresh_batches import batch_bytes
from dsv4cp.records import read_records
from dsv4cp.sweeps.measure import measure_point
from dsv4cp.sweeps.spec import RunOptions, make_point

COMMON = ["profile", "--preset", "tiny", "--tokens", "256", "--ratio", "4", "--kernel-backend", "torch",
          "--warmup", "1", "--reps", "2", "--progress", "off"]
REPS, TRACE_STEPS = 3, 2

pytestmark = pytest.mark.usefixtures("single_process")  # tests/conftest.py


def _measure_counting_builds(rank: int, world: int, device: torch.device, root: str, seed: int) -> dict:
    """Per point (fresh batches, then the repeated batch): the layouts built by each timed step, by the
    traced steps (their one warm-up step included) and the traced phases, on this rank of a gloo group."""
    torch.set_num_threads(1)  # two ranks share the CI machine's two cores
    builds: list[int] = []
    build = layout_cache.build_layout

    def counting(packed, *args, **kwargs):
        builds.append(id(packed))
        return build(packed, *args, **kwargs)

    layout_cache.build_layout = counting  # this spawned process's own module
    found = {}
    for fresh in (3, 0):
        layout_cache.clear_layouts()
        point = make_point({"preset": "tiny", "tokens": 256, "ratio": 4, "cp": world, "packing": "histogram",
                            "seed": seed, "kernel_backend": "torch", "pass": "fwd+bwd", "fresh_batches": fresh})
        seen: list[tuple[str, int]] = []  # after each warm-up and timed step: its kind, the builds so far

        def on_step(kind: str, seen=seen) -> None:
            seen.append((kind, len(builds)))

        measurement = measure_point(point, dist.group.WORLD, device, RunOptions(warmup=1, reps=REPS,
                                    trace_steps=TRACE_STEPS), trace_dir=f"{root}/trace{fresh}", on_step=on_step)
        timed = [after - before for (_, before), (kind, after) in zip(seen, seen[1:]) if kind == "timed"]
        phases = measurement.metrics.get("phases")
        found[fresh] = {"timed": timed, "memory_and_traced": len(builds) - seen[-1][1], "distinct": len(set(builds)),
                        "phases": None if phases is None else sorted({row["phase"] for row in phases})}
        builds.clear()
    return found


def test_gloo_profile_on_fresh_batches_misses_the_layout_cache_every_step(tmp_path, seed):
    per_rank = spawn(_measure_counting_builds, 2, str(tmp_path), seed % 1000)
    for rank, found in enumerate(per_rank):
        fresh, repeated = found[3], found[0]
        assert fresh["timed"] == [1] * REPS, rank
        assert repeated["timed"] == [0] * REPS, rank
        # after timing: the peak-memory step and the traced steps (one warm-up + TRACE_STEPS)
        assert fresh["memory_and_traced"] == 1 + 1 + TRACE_STEPS and repeated["memory_and_traced"] == 0
        assert fresh["distinct"] == 3 and repeated["distinct"] == 1
    phases = per_rank[0][3]["phases"]
    assert phases is not None and "dsv4cp.layout.fwd" in phases and phases == per_rank[0][0]["phases"]



def test_profile_records_and_prints_fresh_batches(tmp_path, capsys, seed):
    out = tmp_path / "run"
    assert main([*COMMON, "--seed", str(seed % 1000), "--fresh-batches", "2", "--out", str(out),
                 "--trace-dir", str(tmp_path / "trace")]) == 0
    text = capsys.readouterr().out
    assert "fresh-batches 2" in text and "every step ran on the next of 2 batches and built its layout" in text
    (record,) = read_records(out)
    assert record["status"] == "ok" and record["fresh_batches"] == 2 and record["phases"]
    assert not dist.is_initialized()


def test_fresh_batches_flag_has_help_and_reaches_the_point():
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "--fresh-batches N" in help_text and "All N batches stay in memory" in help_text
    cpu = torch.device("cpu")
    assert profile.point_from_args(parser.parse_args(["--tokens", "256", "--fresh-batches", "4"]), 1,
                                   cpu).fresh_batches == 4
    assert profile.point_from_args(parser.parse_args(["--tokens", "256"]), 1, cpu).fresh_batches == 0


def _no_work(*args, **kwargs):
    raise AssertionError("profile did work before refusing --fresh-batches")


@pytest.mark.parametrize(("value", "message"), [
    ("1", "must be 0 (one batch, its layout built once) or N >= 2"), ("-3", "must be a non-negative int"),
    ("two", "must be an int")])
def test_a_bad_count_exits_2_before_any_work(value, message, monkeypatch, capsys):
    monkeypatch.setattr(profile, "check_memory", _no_work)
    monkeypatch.setattr(profile, "measure_point", _no_work)
    with pytest.raises(SystemExit) as exited:  # an argparse usage error
        main([*COMMON, "--fresh-batches", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --fresh-batches: " + message in err and len(err.splitlines()) == 1


def test_fresh_batches_with_a_cuda_graph_exit_2_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(profile, "check_memory", _no_work)
    monkeypatch.setattr(profile, "measure_point", _no_work)
    assert main([*COMMON, "--fresh-batches", "2", "--cuda-graph"]) == 2
    assert "error: --fresh-batches: CUDA-graph replays run the one captured batch" in capsys.readouterr().err


@pytest.mark.parametrize("count", [2, 5])
def test_batches_that_do_not_fit_exit_3_naming_the_flag(count, monkeypatch, capsys):
    """The step's estimate plus (N - 1) batches of 256 rows (CP = 1) must fit the free memory: exactly
    fitting runs, one byte less is refused before any work."""
    from dsv4cp.config import DSv4Config

    step_bytes = 10_000
    more = (count - 1) * batch_bytes(256, DSv4Config.preset("tiny").hidden, torch.float32, backward=True)
    measured = []
    monkeypatch.setattr(profile, "check_memory", lambda *a, **k: step_bytes)
    monkeypatch.setattr(profile, "_measure_and_report", lambda *a, **k: measured.append(True))
    for free, code in ((step_bytes + more, 0), (step_bytes + more - 1, 3)):
        monkeypatch.setattr(profile, "free_bytes", lambda device, free=free: free)
        assert main([*COMMON, "--backward", "--fresh-batches", str(count)]) == code
    assert measured == [True]
    err = capsys.readouterr().err
    assert f"error: --fresh-batches: {count} batches need" in err and "use fewer batches" in err
    monkeypatch.setattr(profile, "free_bytes", lambda device: 1)
    assert main([*COMMON, "--backward", "--fresh-batches", str(count), "--force"]) == 0
    assert measured == [True, True]
