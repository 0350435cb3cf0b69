"""MTP rolls emit their declared phases and read no device data.

* ``roll_left`` records ``mtp.roll.fwd``; ``roll_hidden_left`` records ``mtp.roll.fwd`` in its forward and
  ``mtp.roll.bwd`` in its backward (after the forward's range), as ``record_function`` ranges in a
  ``torch.profiler`` trace;
* both rolls run on ``meta`` tensors, which hold no data: any read of a tensor's value (the fill
  checks used to call ``.item()`` on a device tensor, one synchronisation per field) would raise.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.cp.mtp import roll_hidden_left, roll_left
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling import nvtx

LENGTHS, TOTAL = (5, 0, 9, 3), 20


@pytest.fixture(autouse=True)
def ranges_on():
    before = nvtx.is_enabled()
    nvtx.set_enabled(True)
    yield
    nvtx.set_enabled(before)


def _phases(fn) -> list[str]:
    """The ``dsv4cp.mtp.*`` ranges recorded while ``fn`` runs, in start order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return [e.name for e in events if e.name.startswith("dsv4cp.mtp.")]


def _fields(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    fields = {
        "tokens": torch.randint(1, 1000, (TOTAL,), generator=gen),
        "labels": torch.randint(1, 1000, (TOTAL,), generator=gen),
        "padding_mask": torch.rand(TOTAL, generator=gen) < 0.2,
        "embeds": torch.randn(TOTAL, 3, generator=gen),
    }
    return {name: t.to(device) for name, t in fields.items()}


def test_roll_left_emits_the_forward_phase(seed):
    pk = PackedSeqs.from_lengths(LENGTHS, total=TOTAL)
    fields = _fields(seed)
    assert _phases(lambda: roll_left(fields, pk, 2, fill={"labels": -100})) == ["dsv4cp.mtp.roll.fwd"]


def test_roll_hidden_left_emits_forward_then_backward_phase(seed):
    pk = PackedSeqs.from_lengths(LENGTHS, total=TOTAL)
    h = torch.randn(TOTAL, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    weight = torch.randn(TOTAL, 4, generator=torch.Generator().manual_seed(seed + 1))

    def step():
        (roll_hidden_left(h, pk, 3) * weight).sum().backward()

    assert _phases(step) == ["dsv4cp.mtp.roll.fwd", "dsv4cp.mtp.roll.bwd"]
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_rolls_read_no_tensor_values(seed):
    """On ``meta`` tensors every op runs on shapes only; reading a value raises."""
    pk = PackedSeqs.from_lengths(LENGTHS, total=TOTAL).to("meta")
    out = roll_left(_fields(seed, "meta"), pk, 2, fill={"labels": -100, "embeds": 0.5})
    assert {n: (t.shape, t.dtype, t.device.type) for n, t in out.items()} == {
        n: (t.shape, t.dtype, "meta") for n, t in _fields(seed).items()
    }
    h = torch.empty(TOTAL, 4, device="meta", requires_grad=True)
    rolled = roll_hidden_left(h, pk, 3)
    (grad,) = torch.autograd.grad(rolled.sum(), h)
    assert grad.shape == h.shape and grad.device.type == "meta"
