"""Backward reduce-scatters overlap independent work (DESIGN 3.5), on 2 gloo ranks.

The recorded backward phase order must hold, between each ``reducescatter.*.launch`` and its
``.wait``, at least one compute phase (the query-path backward ``q_proj.bwd`` at least), and the
wait must come before the backward of the compressor that consumes the scattered rows. The order
is fixed by graph edges, so it holds for every layer type, with and without recompute; the same
graph serves ``overlap="none"``, so both modes give bitwise-identical gradients.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import seed_of
from cp_steps import seeded_cp_forward
from dsv4cp import PackedSeqs
from dsv4cp.cp.comm import all_gather_rows
from dsv4cp.cp.launch import spawn
from dsv4cp.layer import attention

CASES = [(4, False), (4, True), (8, False), (8, True)]
"""(ratio, recompute): a C layer (both gathers) and an H layer (compressed kv only)."""
GATHERS = {4: ("kv", "index_k"), 8: ("kv",)}
"""ratio -> the gathers whose reduce-scatters must overlap compute."""
CONSUMER = {"kv": "compress.bwd", "index_k": "indexer.compress.bwd"}
"""gather -> the compressor backward that consumes its scattered rows (it must follow the wait)."""
PREFIX = "dsv4cp."


def _step(rank: int, world: int, ratio: int, recompute: bool, overlap: str, seed: int, record: bool):
    packed = PackedSeqs.from_lengths([50, 0, 94], total=160)
    layer, x, _, loss = seeded_cp_forward(rank, world, packed, ratio, seed, overlap=overlap, recompute=recompute)
    phases = []
    if record:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss.backward()
        phases = sorted(
            (e.time_range.start, e.time_range.end, e.name.removeprefix(PREFIX))
            for e in prof.events() if e.name.startswith(PREFIX)
        )
    else:
        loss.backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return phases, grads


def _gathered_tensors_watched(refs: list[weakref.ref]):
    """The layer's gather, keeping a weak reference to every gathered tensor it creates."""
    gather = all_gather_rows

    def watched(*args, **kwargs):
        pending = gather(*args, **kwargs)
        refs.append(weakref.ref(pending.gathered))
        return pending

    return watched


def _record_all(rank: int, world: int, device: torch.device, seed: int) -> list[dict]:
    refs: list[weakref.ref] = []
    attention.all_gather_rows = _gathered_tensors_watched(refs)  # this worker process only
    results = []
    for ratio, recompute in CASES:
        phases, grads_async = _step(rank, world, ratio, recompute, "async", seed, record=True)
        _, grads_none = _step(rank, world, ratio, recompute, "none", seed, record=False)
        same = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_async, grads_none))
        results.append({"phases": phases, "none_equals_async": same})
    gc.collect()
    results.append({"gathered": len(refs), "gathered_alive": sum(r() is not None for r in refs)})
    return results


def _only(phases, name: str) -> tuple[float, float]:
    hits = [(start, end) for start, end, n in phases if n == name]
    assert len(hits) == 1, f"expected one {name} range, got {len(hits)}"
    return hits[0]


def _order(phases) -> str:
    return " -> ".join(n for _, _, n in phases)


@pytest.fixture(scope="module")
def recorded() -> list[list[dict]]:
    """Each rank's recorded phases and mode comparison, per case: one spawn serves every test."""
    return spawn(_record_all, 2, seed_of("backward_overlap"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"ratio{r}-recompute{int(c)}" for r, c in CASES])
def test_reduce_scatters_overlap_compute(recorded, case: int) -> None:
    ratio, _ = CASES[case]
    for rank, per_case in enumerate(recorded):
        phases = per_case[case]["phases"]
        for gather in GATHERS[ratio]:
            _, launch_end = _only(phases, f"reducescatter.{gather}.launch")
            wait_start, _ = _only(phases, f"reducescatter.{gather}.wait")
            between = [n for s, e, n in phases
                       if s >= launch_end and e <= wait_start and not n.endswith((".launch", ".wait"))]
            assert "q_proj.bwd" in between, (
                f"rank {rank}, {gather}: no query-path backward between launch and wait: {_order(phases)}"
            )
            consumer_start, _ = _only(phases, CONSUMER[gather])
            assert wait_start < consumer_start, f"rank {rank}, {gather}: the compressor backward ran before the wait"


def test_indexer_query_backward_is_marked(recorded) -> None:
    for per_case in recorded:
        for case, (ratio, _) in enumerate(CASES):
            names = {n for _, _, n in per_case[case]["phases"]}
            assert ("indexer.q_proj.bwd" in names) == (ratio == 4), sorted(names)


def test_overlap_modes_give_identical_gradients(recorded) -> None:
    for rank, per_case in enumerate(recorded):
        same = [c["none_equals_async"] for c in per_case[: len(CASES)]]
        assert all(same), f"rank {rank}: async and none gradients differ for cases {CASES}: {same}"


def test_each_steps_graph_is_freed(recorded) -> None:
    """No reference cycle keeps a step's graph (and its gathered tensors) alive after backward."""
    for rank, per_case in enumerate(recorded):
        counts = per_case[-1]
        assert counts["gathered"] == 2 * sum(len(GATHERS[r]) for r, _ in CASES)
        assert counts["gathered_alive"] == 0, f"rank {rank}: {counts}"
