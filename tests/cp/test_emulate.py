"""Rank emulation (dsv4cp.cp.emulate): one process running rank r of a CP group alone on torch's fake
process group does the same work as the real rank r.

* Against a real gloo run at cp 2 and 3 (C and H layers, async overlap, a balanced split): the emulated
  rank r enters the same set of phases and produces outputs and gradients of the same shapes, all
  finite (a fake collective may leave uninitialised memory: the fills must overwrite it). Rank 0 sees
  no earlier rank, so its forward output equals the real rank 0's exactly: the drawn peer rows can
  only reach it through a mask, where NaN or garbage would show.
* The fake group is never taken for a real one: a real gloo group is not emulated, the fills leave its
  buffers alone, and creating an emulated group inside a torchrun-style rank is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import seed_of
from dsv4cp.config import DSv4Config
from dsv4cp.cp.emulate import (
    destroy_emulated_group,
    emulated_rank,
    emulated_shift,
    fill_all_gather,
    fill_reduce_scatter,
    init_emulated_group,
    is_emulated,
)
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.build import build_case
from dsv4cp.harness.case import Case
from dsv4cp.model.partition import partition
from dsv4cp.profiling import nvtx
from host_reads import HostReads


def cases(world: int) -> tuple[Case, ...]:
    balanced = partition([264], world, DSv4Config.preset("tiny"), 8, policy="balanced").bounds
    return (
        Case(ratio=4, lengths=(90, 150, 24), overlap="async", backend="torch",
                  seed=seed_of("emulate", 4)),
        Case(ratio=8, lengths=(264,), overlap="async", recompute=True, split=balanced,
                  backend="torch", seed=seed_of("emulate", 8)),
    )


class _Phases:
    """Phase listener: the set of phases entered (forward and backward threads)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def enter(self, phase: str) -> None:
        self.seen.add(phase)

    def exit(self, phase: str) -> None:
        pass


def _step(rank: int, world: int, device: torch.device, case: Case, group: dist.ProcessGroup) -> dict:
    """One forward + backward of rank ``rank``'s rows: its phases, output, and what is finite."""
    layer, packed, x, weight = build_case(case, device)  # the parity check's layer and tensors
    split = case.row_split(world)
    mine = slice(split.start(rank), split.start(rank) + split.rows(rank))
    x_local = x[mine].clone().requires_grad_()

    phases = _Phases()
    before, enabled = nvtx.set_phase_listener(phases), nvtx.is_enabled()
    nvtx.set_enabled(True)
    try:
        result = layer(x_local, packed, cp_group=group, split=split)
        loss = (result.out * weight[mine]).sum()
        if result.indexer_loss is not None:
            loss = loss + result.indexer_loss
        loss.backward()
    finally:
        nvtx.set_phase_listener(before)
        nvtx.set_enabled(enabled)

    tensors = {"out": result.out, "x_grad": x_local.grad}
    if result.indexer_loss is not None:
        tensors["indexer_loss"] = result.indexer_loss
    tensors.update({f"grad.{name}": p.grad for name, p in layer.named_parameters() if p.grad is not None})
    return {
        "phases": phases.seen,
        "shapes": {name: tuple(t.shape) for name, t in tensors.items()},
        "finite": {name: bool(torch.isfinite(t).all()) for name, t in tensors.items()},
        "out": result.out.detach().cpu(),
    }


def _real_rank(rank: int, world: int, device: torch.device, cases: tuple[Case, ...]) -> dict:
    group = dist.group.WORLD
    fills_untouched = _fills_leave_real_group_alone(group, rank, world)
    try:
        init_emulated_group(world, rank)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"steps": [_step(rank, world, device, case, group) for case in cases],
            "emulated": is_emulated(group), "emulated_rank": emulated_rank(group),
            "fills_untouched": fills_untouched, "refused": refused}


def _fills_leave_real_group_alone(group: dist.ProcessGroup, rank: int, world: int) -> bool:
    local = torch.full((3, 2), float(rank + 1))
    gathered = torch.empty(world * 3, 2)
    dist.all_gather_into_tensor(gathered, local, group=group)
    expected = gathered.clone()
    fill_all_gather(gathered, local, group)
    scattered = torch.full((3, 2), -1.0)
    fill_reduce_scatter(scattered, gathered, group)
    return torch.equal(gathered, expected) and bool((scattered == -1.0).all())


def _emulated(rank: int, world: int, cases: tuple[Case, ...]) -> list[dict]:
    group = init_emulated_group(world, rank, seed=seed_of("emulate fills", world, rank))
    try:
        assert is_emulated(group) and emulated_rank(group) == rank and group.size() == world
        return [_step(rank, world, torch.device("cpu"), case, group) for case in cases]
    finally:
        destroy_emulated_group(group)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_emulated_rank_does_the_real_ranks_work(world, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # the emulated ranks run in this process
        monkeypatch.delenv(name, raising=False)
    real = spawn(_real_rank, world, cases(world))
    for rank in range(world):
        mine = real[rank]
        assert not mine["emulated"] and mine["emulated_rank"] is None
        assert mine["fills_untouched"], "a fill changed a real group's buffers"
        assert mine["refused"] is not None and "torchrun" in mine["refused"]
        for case, want, got in zip(cases(world), mine["steps"], _emulated(rank, world, cases(world))):
            where = f"cp {world} rank {rank} ratio {case.ratio}"
            assert got["phases"] == want["phases"], where
            assert got["shapes"] == want["shapes"], where
            assert all(want["finite"].values()), where
            bad = [name for name, finite in got["finite"].items() if not finite]
            assert not bad, f"{where}: not finite under emulation: {bad}"
            if rank == 0:
                torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-6, msg=where)
    assert not dist.is_initialized()


def test_emulated_fills_are_deterministic_and_shaped_like_the_local_rows(seed):
    local = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed)) * 4 + 2
    runs = []
    for _ in range(2):
        group = init_emulated_group(3, 1, seed=seed)
        try:
            out = torch.full((15, 3), float("nan"))  # what uninitialised memory may hold
            fill_all_gather(out, local, group)
            scattered = torch.full((5, 3), float("nan"))
            fill_reduce_scatter(scattered, out, group)
            runs.append((out, scattered))
        finally:
            destroy_emulated_group(group)
    (out, scattered), (again, _) = runs
    assert torch.equal(out, again)
    assert torch.isfinite(out).all()
    assert torch.equal(out[5:10], local) and torch.equal(scattered, local)
    peers = torch.cat((out[:5], out[10:]))
    assert not any(torch.equal(peers[i], local[j]) for i in range(10) for j in range(5))
    assert abs(float(peers.mean()) - 2) < 2.0 and 1.0 < float(peers.std()) < 8.0


def test_fills_read_no_tensor_data_on_the_host(seed):
    """The fills run inside the measured step after every collective: no host read of tensor data (a
    device synchronisation on CUDA), also for one local row (the spread's floor)."""
    local = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    group = init_emulated_group(2, 0, seed=seed)
    try:
        with HostReads() as reads:
            fill_all_gather(torch.empty(8, 3), local, group)
            fill_all_gather(torch.empty(2, 3), local[:1], group)
            fill_reduce_scatter(torch.empty(4, 3), torch.randn(8, 3), group)
            received = emulated_shift(local, group, -1)  # from rank 1: drawn rows
    finally:
        destroy_emulated_group(group)
    assert not reads.events, reads.report()
    assert received.shape == local.shape and not torch.equal(received, torch.zeros_like(local))


@pytest.mark.parametrize(("cp", "rank", "field"), [(1, 0, "cp"), (2, 2, "emulate_rank"), (2, -1, "emulate_rank")])
def test_bad_emulation_is_refused_before_any_group(cp, rank, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        init_emulated_group(cp, rank)
    assert not dist.is_initialized()


def test_emulation_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="torchrun"):
        init_emulated_group(2, 0)
    assert not dist.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_emulated_ranks_on_the_gpu(monkeypatch):
    """bf16 with the fast kernels (``auto``): both emulated ranks finite, and rank 0's forward output
    equal to the CP = 1 layer's first rows (rank 0 sees no earlier rank)."""
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    device = torch.device("cuda")
    case = Case(ratio=4, lengths=(512, 1536), overlap="async", dtype="bf16", backend="auto",
                     seed=seed_of("emulate gpu"))
    steps = []
    for rank in (0, 1):
        group = init_emulated_group(2, rank, seed=seed_of("emulate gpu fills", rank))
        try:
            steps.append(_step(rank, 2, device, case, group))
        finally:
            destroy_emulated_group(group)
    for rank, step in enumerate(steps):
        bad = [name for name, finite in step["finite"].items() if not finite]
        assert not bad, f"rank {rank}: not finite under emulation: {bad}"
    whole = _step(0, 1, device, case, None)
    rows = steps[0]["out"].shape[0]
    cosine = torch.nn.functional.cosine_similarity(steps[0]["out"].float().flatten(),
                                                   whole["out"][:rows].float().flatten(), dim=0)
    assert cosine > 0.999, f"rank 0 output differs from CP = 1: cosine {float(cosine):.5f}"


def test_a_real_group_after_an_emulated_one_is_real():
    """Group names are reused ("0" for every default group): a real group created in the same process
    after an emulated run must not be taken for the fake one (its data would be replaced by fills)."""
    fake = init_emulated_group(2, 1, seed=3)
    assert is_emulated(fake)
    dist.destroy_process_group()  # as an error path that skipped destroy_emulated_group would leave it
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        real = dist.group.WORLD
        assert not is_emulated(real) and emulated_rank(real) is None
        out, local = torch.zeros(2, 3), torch.ones(2, 3)
        fill_all_gather(out, local, real)
        assert bool((out == 0).all())  # untouched: fills only act on fake groups
    finally:
        dist.destroy_process_group()
