"""Backward phase ranges of regions fed tensors that do not require grad (the indexer's regions):
the range opens when the region's output gradient arrives and closes once its parameters'
gradients are accumulated, never left open; numerics are unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import seed_of
from dsv4cp.profiling import nvtx
from dsv4cp.profiling.autograd_ranges import BackwardRegion, phase_region


class _Recorder:
    """Stands in for the NVTX domain: logs span starts and ends into ``events``."""

    def __init__(self, events: list[str]) -> None:
        self.events, self._next = events, 0

    def start_range(self, attributes) -> int:
        self._next += 1
        self.events.append("open")
        return self._next

    def end_range(self, range_id) -> None:
        self.events.append("close")

    def push_range(self, attributes) -> None:  # forward ranges nest: not what these tests look at
        pass

    def pop_range(self) -> None:
        pass


@pytest.fixture
def events(monkeypatch) -> list[str]:
    log: list[str] = []
    monkeypatch.setattr(nvtx, "_DOMAIN_HANDLE", _Recorder(log))
    before = nvtx.is_enabled()
    nvtx.set_enabled(True)
    yield log
    nvtx.set_enabled(before)


def _logged_module(events: list[str], seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(8, 8)
    lin.weight.register_post_accumulate_grad_hook(lambda p: events.append("weight"))
    lin.bias.register_post_accumulate_grad_hook(lambda p: events.append("bias"))
    return lin


def test_region_without_input_grad_closes_after_its_parameters(events) -> None:
    lin = _logged_module(events, seed_of("region_closes"))
    other = torch.randn(3, requires_grad=True)
    other.register_post_accumulate_grad_hook(lambda p: events.append("other"))
    x = torch.randn(4, 8)  # a detached input: the region is trained through its parameters only
    for _ in range(3):
        events.clear()
        before = (other * 2).sum()  # created first, so autograd back-propagates it after the region
        y = phase_region("indexer.compress", lambda t: lin(t).tanh(), x)
        (before + y.square().sum()).backward()
        assert events.count("open") == events.count("close") == 1, events
        assert events.index("open") < events.index("weight") < events.index("close"), events
        assert events.index("bias") < events.index("close") < events.index("other"), events


def test_region_with_several_outputs_closes_after_all(events) -> None:
    lin_a, lin_b = _logged_module(events, seed_of("outputs_a")), torch.nn.Linear(8, 2)
    lin_b.weight.register_post_accumulate_grad_hook(lambda p: events.append("b"))
    region = BackwardRegion("indexer.q_proj.bwd")
    x = torch.randn(4, 8)
    a, b = region.outputs(lin_a(region.input(x)), lin_b(x))
    (a.sum() + b.square().sum()).backward()
    assert events.count("open") == events.count("close") == 1, events
    assert events.index("close") > max(events.index(e) for e in ("weight", "bias", "b")), events


def test_range_closes_when_backward_skips_a_parameter(events) -> None:
    lin = _logged_module(events, seed_of("skips"))
    y = phase_region("indexer.compress", lin, torch.randn(4, 8))
    torch.autograd.backward(y.sum(), inputs=[lin.weight])  # the bias gets no gradient in this pass
    assert events == ["open", "weight", "close"], events
    assert lin.bias.grad is None


def test_marked_region_gives_identical_gradients(events) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed_of("identical")))
    grads = []
    for marked in (True, False):
        lin = _logged_module([], seed_of("identical_module"))
        y = phase_region("indexer.compress", lin, x) if marked else lin(x)
        y.square().sum().backward()
        grads.append((lin.weight.grad, lin.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert grads[0][0].abs().max() > 0
