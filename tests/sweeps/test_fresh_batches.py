"""The ``fresh_batches`` axis: steps cycling through distinct batches each build their layout (the
layout cache's miss path, counted by a spy on the builder it calls), the batches are distinct inputs of
the same documents, earlier point ids do not change, values are checked, and ``compare`` treats the
option as configuration."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4cp.cli.main import main
from dsv4cp.cp import layout_cache
from dsv4cp.harness.build import build_step
from dsv4cp.harness.fresh_batches import batch_bytes, batch_seed, fresh_batches
from dsv4cp.records import match_id, point_id, read_records
from dsv4cp.sweeps.measure import measure_point, point_case, point_inputs, point_split
from dsv4cp.sweeps.spec import RunOptions, expand, make_point, parse_spec
from report.report_helpers import grid, write_run


class BuildSpy:
    """Counts :func:`dsv4cp.cp.layout.build_layout` calls made by the layout cache, per batch object, and
    the builds seen at each ``on_step`` call of :func:`measure_point` (its warm-up and timed steps)."""

    def __init__(self, monkeypatch):
        self.batches: list[int] = []  # id() of the batch each build was for, in order
        self.at_step: list[tuple[str, int]] = []
        build = layout_cache.build_layout

        def counting(packed, *args, **kwargs):
            self.batches.append(id(packed))
            return build(packed, *args, **kwargs)

        monkeypatch.setattr(layout_cache, "build_layout", counting)

    def on_step(self, kind: str) -> None:
        self.at_step.append((kind, len(self.batches)))

    def timed_builds(self) -> list[int]:
        """Layouts built by each timed step."""
        counts = [count for _, count in self.at_step]
        per_step = [after - before for before, after in zip([0, *counts], counts)]
        return [built for (kind, _), built in zip(self.at_step, per_step) if kind == "timed"]


@pytest.fixture(autouse=True)
def _no_kept_layouts():
    layout_cache.clear_layouts()
    yield
    layout_cache.clear_layouts()


def _point(seed: int, **axes):
    return make_point({"preset": "tiny", "tokens": 128, "ratio": 4, "packing": "histogram", "seed": seed % 1000,
                       "kernel_backend": "torch", **axes})


@pytest.mark.parametrize("count", [2, 3])
def test_every_timed_step_of_fresh_batches_builds_a_layout(monkeypatch, seed, count):
    spy = BuildSpy(monkeypatch)
    point = _point(seed, fresh_batches=count, **{"pass": "fwd"})
    reps = 2 * count + 1  # fewer batches than the cache keeps, each met more than once
    assert count < layout_cache.MAX_LAYOUTS
    result = measure_point(point, None, torch.device("cpu"), RunOptions(warmup=1, reps=reps), on_step=spy.on_step)
    assert spy.timed_builds() == [1] * reps
    # the steps cycle through `count` distinct batches, in order, warm-up included
    first = spy.batches[:count]
    assert len(set(first)) == count
    assert spy.batches[:1 + reps] == [first[i % count] for i in range(1 + reps)]
    assert result.metrics["time_ms_median"] > 0


def test_repeated_batch_builds_its_layout_once(monkeypatch, seed):
    spy = BuildSpy(monkeypatch)
    measure_point(_point(seed, **{"pass": "fwd"}), None, torch.device("cpu"), RunOptions(warmup=1, reps=3),
                  on_step=spy.on_step)
    assert spy.at_step[0] == ("warmup", 1) and spy.timed_builds() == [0, 0, 0]


def test_fresh_batches_are_distinct_inputs_of_the_same_documents(monkeypatch, seed):
    point = _point(seed, cp=1, **{"pass": "fwd+bwd"})
    cfg, lengths = point_inputs(point)
    step = build_step(point_case(point, cfg, lengths, point_split(point, cfg, lengths), torch.device("cpu")))
    step()  # batch 0's layout is now kept: building the batches forgets it
    spy = BuildSpy(monkeypatch)
    batches = fresh_batches(step, 3, point.seed)
    assert batches.steps[0] is step
    for other in batches.steps[1:]:
        assert other.layer is step.layer and other.split == step.split and other.backward
        assert other.packed is not step.packed and other.packed.cu_seqlens is not step.packed.cu_seqlens
        assert torch.equal(other.packed.cu_seqlens_padded, step.packed.cu_seqlens_padded)
        assert other.x.shape == step.x.shape and other.x.requires_grad
        assert not torch.equal(other.x, step.x) and not torch.equal(other.upstream, step.upstream)
    assert not torch.equal(batches.steps[1].x, batches.steps[2].x)
    # batch b's rows come from the generator of batch_seed: reproducible, and batch 0's seed continued
    drawn = torch.randn(step.x.shape, generator=torch.Generator().manual_seed(batch_seed(point.seed, 2, 1, 0)))
    assert torch.equal(batches.steps[2].x.detach(), drawn)
    assert batch_seed(point.seed, 0, 1, 0) == point.seed * 65_537 + 1
    seeds = {batch_seed(point.seed, b, 4, r) for b in range(5) for r in range(4)}
    assert len(seeds) == 20
    batches()
    assert batches.last is batches.steps[0] and spy.batches == [id(step.packed)]
    batches()
    assert batches.last is batches.steps[1] and batches.steps[1].x.grad is not None
    assert spy.batches == [id(step.packed), id(batches.steps[1].packed)]
    assert batch_bytes(rows=10, hidden=6, dtype=torch.bfloat16, backward=True) == 3 * 10 * 6 * 2
    assert batch_bytes(rows=10, hidden=6, dtype=torch.float32, backward=False) == 2 * 10 * 6 * 4
    with pytest.raises(ValueError, match="^fresh_batches"):
        fresh_batches(step, 1, point.seed)


def test_default_keeps_earlier_point_ids_and_values_are_checked():
    plain = _point(0).axes()
    older = {name: value for name, value in plain.items() if name != "fresh_batches"}
    assert plain["fresh_batches"] == 0 and point_id(plain) == point_id(older)
    fresh = _point(0, fresh_batches=4)
    assert fresh.point_id != point_id(plain) and "fresh-batches 4" in fresh.label()
    assert match_id(fresh.axes()) == match_id(plain)  # compare meets them, then sees the configuration
    for bad in (1, -2, True, "2", 2.0):
        with pytest.raises(ValueError, match="^fresh_batches: must be 0"):
            make_point({"tokens": 64, "fresh_batches": bad})


def test_compiled_fresh_batches_compile_once():
    """Under torch.compile (whose traced layer builds the layout inside its graph) the other batches'
    tensors of the same shapes reuse the graph: fresh batches add no graph and no break."""
    from torch._dynamo.utils import counters

    found = []
    for count in (0, 3):
        point = make_point({"preset": "tiny", "tokens": 128, "ratio": 4, "kernel_backend": "torch", "pass": "fwd",
                            "compile": "eager", "fresh_batches": count})
        metrics = measure_point(point, None, torch.device("cpu"), RunOptions(warmup=1, reps=3)).metrics
        found.append((counters["stats"]["unique_graphs"], metrics["graph_breaks"]))
    assert found[1] == found[0] and found[0][0] >= 1


def test_fresh_batches_with_a_cuda_graph_are_refused_before_work(monkeypatch):
    monkeypatch.setattr("dsv4cp.harness.time.build_step", lambda *a, **k: pytest.fail("no step may be built"))
    point = make_point({"tokens": 64, "fresh_batches": 2, "cuda_graph": True})
    with pytest.raises(ValueError, match="^fresh_batches: CUDA-graph replays"):
        measure_point(point, None, torch.device("cpu"), RunOptions())


def test_a_sweep_varies_fresh_batches_as_an_axis():
    spec = parse_spec({"name": "s", "base": {"preset": "tiny", "tokens": 64}, "axes": {"fresh_batches": [0, 3]}})
    plain, fresh = expand(spec)
    assert (plain.fresh_batches, fresh.fresh_batches) == (0, 3)
    with pytest.raises(ValueError, match=r"^axes.fresh_batches\[1\]: must be 0"):
        parse_spec({"name": "s", "base": {"tokens": 64}, "axes": {"fresh_batches": [0, 1]}})


def test_compare_treats_fresh_batches_as_configuration(tmp_path, seed, capsys):
    points = grid(cp=[1, 2], tokens=[4096])
    base = write_run(tmp_path / "base", points, seed=seed)
    lines = (base / "records.jsonl").read_text().splitlines()
    old = [{k: v for k, v in json.loads(line).items() if k != "fresh_batches"} for line in lines]
    (base / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))  # from before the axis
    new = write_run(tmp_path / "new", [{**p, "fresh_batches": 8} for p in points], seed=seed)
    assert {r["fresh_batches"] for r in read_records(base)} == {0}  # what they measured: one batch
    assert main(["compare", str(base), str(new)]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 matched points is comparable" in err and "configuration differs: fresh_batches 0 -> 8" in err
    assert main(["compare", str(base), str(new), "--ignore-option", "fresh_batches"]) == 0
    assert "2 compared" in capsys.readouterr().out
    same = write_run(tmp_path / "same", [{**p, "fresh_batches": 0} for p in points], seed=seed)
    assert main(["compare", str(base), str(same)]) == 0
    assert "2 compared" in capsys.readouterr().out

