"""Bad input under CP: every rank raises a clear ValueError before issuing any collective."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn

_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv", "all_reduce",
                "all_gather_single", "reduce_scatter_single", "broadcast")
# (isend/irecv are not patched: P2POp checks their identity; batch_isend_irecv covers them.)


def _try_bad_calls(rank: int, world: int, device: torch.device, cases: list[str]) -> list[tuple[str, list[str]]]:
    """Make each bad call with every collective patched to record itself; return (error, collectives)."""
    issued: list[str] = []
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            original = getattr(dist, name)
            setattr(dist, name, lambda *a, _n=name, _o=original, **k: (issued.append(_n), _o(*a, **k))[1])
    results = []
    for case in cases:
        issued.clear()
        message = _try_bad_call(case, world)
        results.append((message, list(issued)))
    return results


def _try_bad_call(case: str, world: int) -> str:
    cfg = DSv4Config.preset("tiny")
    layer = DSv4Attention(cfg, 4)
    group = dist.group.WORLD
    packed = PackedSeqs.from_lengths([40], total=40)
    rows = packed.total // world
    x = torch.randn(rows, cfg.hidden)
    try:
        if case == "rows_below_halo":
            small = PackedSeqs.from_lengths([6 * world], total=6 * world)
            layer(torch.randn(6, cfg.hidden), small, group)
        elif case == "total_not_divisible":
            odd = PackedSeqs.from_lengths([41], total=41)
            layer(torch.randn(20, cfg.hidden), odd, group)
        elif case == "packed_disagrees_with_x":
            layer(torch.randn(rows + 2, cfg.hidden), packed, group)
        elif case == "group_of_wrong_size":  # x sized for cp = 4 but the group has 2 ranks
            layer(torch.randn(packed.total // 4, cfg.hidden), packed, group)
        elif case == "wrong_dtype":
            layer(x.double(), packed, group)
        elif case == "backend_not_available":  # a name that exists, but not on this device
            DSv4Attention(cfg, 4, backend="flashmla")(x, packed, group)
        elif case == "valid_call":  # control: proves the recorder sees the layer's collectives
            layer(x, packed, group)
    except ValueError as err:
        return str(err)
    return "no error"


BAD_CASES = {
    "rows_below_halo": "halo",
    "total_not_divisible": "divisible",
    "packed_disagrees_with_x": "x:",
    "group_of_wrong_size": "x:",
    "wrong_dtype": "dtype",
    "backend_not_available": "backend",
}


def test_bad_input_raises_on_every_rank_before_any_collective() -> None:
    cases = list(BAD_CASES) + ["valid_call"]
    for rank_results, _ in _run_both():
        control_message, control_issued = rank_results[-1]
        assert control_message == "no error" and "batch_isend_irecv" in control_issued, rank_results[-1]
        assert any("gather" in name for name in control_issued), control_issued
        for case, (message, issued) in zip(cases[:-1], rank_results):
            assert BAD_CASES[case] in message, (case, message)
            assert issued == [], f"{case}: collectives issued before the error: {issued}"


def _one_rank_bad_rows(rank: int, world: int, device: torch.device) -> str:
    """Rank 1 alone passes an ``x`` with two extra rows; with ``check_ranks`` every rank must raise."""
    cfg = DSv4Config.preset("tiny")
    layer = DSv4Attention(cfg, 4, check_ranks=True)
    packed = PackedSeqs.from_lengths([40], total=40)
    rows = packed.total // world + (2 if rank == 1 else 0)
    try:
        layer(torch.randn(rows, cfg.hidden), packed, dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


def _both(rank: int, world: int, device: torch.device, cases: list[str]) -> tuple[list, str]:
    """Both tests' rank bodies in one spawn (each costs seconds): the one-rank fault first, before
    :func:`_try_bad_calls` wraps the collectives with its recorder."""
    message = _one_rank_bad_rows(rank, world, device)
    return _try_bad_calls(rank, world, device, cases), message


@functools.cache
def _run_both() -> list[tuple[list, str]]:
    """Per rank: (:func:`_try_bad_calls`' results for every bad case and the control, the one-rank fault's
    message)."""
    return spawn(_both, 2, list(BAD_CASES) + ["valid_call"])


def test_input_rejected_on_one_rank_raises_on_every_rank() -> None:
    """A fault only rank 1 can see (its own rows) must not leave rank 0 waiting in the halo exchange."""
    messages = [message for _, message in _run_both()]
    assert messages[1].startswith("x: holds 22 rows"), messages
    assert messages[0].startswith("rank 1 rejected its input: x: holds 22 rows"), messages
