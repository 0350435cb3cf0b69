"""MTP left rolls under contiguous CP (DESIGN 3.7).

* the single-rank roll equals a plain-Python per-document oracle (fixed packings and hypothesis);
* rolls on cp = 1, 2, 3, 4 ranks, gathered, equal the single-rank roll, for every field dtype;
* the hidden-state roll's output and gradient equal the single-rank ones (borrowed rows' gradients are
  summed into their owner's rows);
* one P2P exchange per call for all fields;
* bad input raises ValueError naming the field on every rank before any communication.

Every distributed case runs inside ONE 4-process spawn (each spawn costs seconds), on CP groups of 1-4 of its
ranks; the results are cached.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4cp.cp.launch import spawn
from dsv4cp.cp.mtp import default_fill, roll_hidden_left, roll_left, rolled_source_valid
from dsv4cp.packing import PackedSeqs

CPS = (1, 2, 3, 4)
DEPTHS = (1, 2, 3)
FILL_OVERRIDE = {"labels": -100, "tag": 7}
HIDDEN = 4


# ------------------------------------------------------------------------------------ cases
def packings(cp: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, lengths, pad_to_multiple, total); totals divisible by every cp in CPS."""
    total = 24
    rows = total // cp
    rng = random.Random(1000 + cp)
    out = [
        ("one_long", (total,), 1, total),
        ("ends_at_rank_boundary", tuple([rows] * cp), 1, total),
        ("ends_one_after_boundary", (rows + 1, total - rows - 1) if cp > 1 else (13, 11), 1, total),
        ("shorter_than_depth", (1, 2, 1, 3, 0, 2, 1, 1, 5, 0, 2, 1, 1, 1), 1, total),
        ("empty_docs", (0, 5, 0, 0, 11, 0, 3, 0), 1, total),
        ("padded_docs", (3, 5, 1, 6), 4, total),
        ("padded_with_tail", (3, 2, 6), 4, total),
        ("tail_only", (), 1, total),
        ("tail_starts_mid_rank", (rows + 2,) if cp > 1 else (21,), 1, total),
        ("depth_equals_rows", (5, 7), 1, 12),  # cp = 4: L = 3 = the largest depth
    ]
    for i in range(3):
        lengths, left = [], total - rng.randint(0, 5)
        while left > 0:
            n = min(rng.choice([0, 1, 2, 3, 4, 7, 9]), left)
            lengths.append(n)
            left -= n
        pad = rng.choice([1, 1, 2])
        if PackedSeqs.from_lengths(lengths, pad_to_multiple=pad).padded_end > total:
            pad = 1
        out.append((f"random{i}", tuple(lengths), pad, total))
    return out


def cases(cp: int) -> list[dict]:
    return [
        dict(name=name, lengths=lengths, pad=pad, total=total, depth=depth, seed=i * 10 + depth)
        for i, (name, lengths, pad, total) in enumerate(packings(cp))
        for depth in DEPTHS
    ]


def packed_of(case: dict) -> PackedSeqs:
    return PackedSeqs.from_lengths(case["lengths"], pad_to_multiple=case["pad"], total=case["total"])


def full_fields(total: int, seed: int) -> dict[str, torch.Tensor]:
    """Fresh random fields of several dtypes and trailing shapes (odd byte sizes test the buffer packing)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, 50_000, (total,), generator=g),
        "labels": torch.randint(1, 50_000, (total,), generator=g),
        "loss_mask": torch.randint(0, 2, (total,), generator=g).float() + 0.5,
        "position_ids": torch.randint(1, 4096, (total,), generator=g),
        "padding_mask": torch.rand(total, generator=g) < 0.5,
        "aux_bf16": (torch.randn(total, 3, generator=g) + 5).to(torch.bfloat16),
        "tag": torch.randint(-100, 100, (total,), generator=g).to(torch.int8),
        "pair32": torch.randint(1, 1000, (total, 2), generator=g).to(torch.int32),
    }


def hidden_inputs(total: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return (torch.randn(total, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(total, HIDDEN, generator=g, dtype=torch.float64))


def local(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    rows = x.shape[0] // cp
    return x[rank * rows : (rank + 1) * rows].clone()


# ------------------------------------------------------------------------------------ oracle
def oracle_sources(lengths_padded: list[int], total: int, depth: int) -> list[int | None]:
    """Per row: the row it takes (same document, ``depth`` later), or None for a fill. Plain Python."""
    src: list[int | None] = [None] * total
    start = 0
    for n in lengths_padded:
        for i in range(start, start + n):
            if i + depth < start + n:
                src[i] = i + depth
        start += n
    return src  # rows past the padded end (tail padding) stay None


def oracle_roll(x: torch.Tensor, packed: PackedSeqs, depth: int, fill) -> torch.Tensor:
    src = oracle_sources(packed.padded_lengths(), packed.total, depth)
    out = torch.empty_like(x)
    for i, s in enumerate(src):
        if s is None:
            out[i] = fill
        else:
            out[i] = x[s]
    return out


def oracle_hidden_grad(gup: torch.Tensor, packed: PackedSeqs, depth: int) -> torch.Tensor:
    grad = torch.zeros_like(gup)
    for i, s in enumerate(oracle_sources(packed.padded_lengths(), packed.total, depth)):
        if s is not None:
            grad[s] += gup[i]
    return grad


def fill_of(name: str):
    return FILL_OVERRIDE.get(name, default_fill(name))


# ------------------------------------------------------------------------------------ spawned body
class _Counter:
    """Counts ``dist.batch_isend_irecv`` calls (and their op counts) while installed."""

    def __init__(self):
        self.calls: list[int] = []
        self._orig = None

    def __enter__(self):
        self._orig = dist.batch_isend_irecv

        def counting(ops):
            self.calls.append(len(ops))
            return self._orig(ops)

        dist.batch_isend_irecv = counting
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self._orig


def _bad_inputs(rank: int, cp: int, group) -> list[tuple[str, str | None]]:
    """Each bad call's expected message prefix (naming the field) and the ValueError message it raised
    (None: no error)."""
    case = dict(lengths=(10, 14), pad=1, total=24)
    packed = packed_of(case)
    rows = 24 // cp
    base = {n: local(x, rank, cp) for n, x in full_fields(24, 0).items()}
    h = torch.randn(rows, HIDDEN)
    bad_total = PackedSeqs.from_lengths((10, 14), total=24 + 1)
    calls = [
        ("depth:", lambda: roll_left(base, packed, 0, group)),
        ("depth:", lambda: roll_left(base, packed, rows + 1, group)),
        ("depth:", lambda: roll_left(base, packed, 1.0, group)),
        ("fields['labels']", lambda: roll_left({**base, "labels": torch.zeros(rows + 1).long()}, packed, 1, group)),
        ("fields['loss_mask']", lambda: roll_left({**base, "loss_mask": [0.0] * rows}, packed, 1, group)),
        ("fill: names ['bogus']", lambda: roll_left(base, packed, 1, group, fill={"bogus": 1})),
        ("fill['input_ids']", lambda: roll_left(base, packed, 1, group, fill={"input_ids": 0.5})),
        ("fields:", lambda: roll_left({}, packed, 1, group)),
        ("h:", lambda: roll_hidden_left(h[:-1], packed, 1, group)),
        ("depth:", lambda: roll_hidden_left(h, packed, 0, group)),
    ]
    if cp > 1:
        calls.append(("packed.total:", lambda: roll_left(base, bad_total, 1, group)))
        calls.append(("packed.total:", lambda: roll_hidden_left(h, bad_total, 1, group)))
    out = []
    for field, call in calls:
        try:
            call()
            out.append((field, None))
        except ValueError as err:
            out.append((field, str(err)))
    return out


def _run_cp(rank: int, world: int, group) -> dict:
    """Every distributed check of one CP size; ``rank``/``world`` are the rank and size inside ``group``."""
    all_cases = cases(world)
    rolled, hidden = [], []
    for case in all_cases:
        packed = packed_of(case)
        fields = {n: local(x, rank, world) for n, x in full_fields(case["total"], case["seed"]).items()}
        rolled.append(roll_left(fields, packed, case["depth"], group, fill=FILL_OVERRIDE))
        h_full, gup_full = hidden_inputs(case["total"], case["seed"])
        h = local(h_full, rank, world).requires_grad_()
        out = roll_hidden_left(h, packed, case["depth"], group)
        out.backward(local(gup_full, rank, world))
        hidden.append((out.detach(), h.grad))

    # one exchange per call: 5 fields, then the hidden roll's forward and backward
    packed = PackedSeqs.from_lengths((7, 17), total=24)
    five = {n: local(x, rank, world) for n, x in full_fields(24, 99).items()
            if n in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")}
    with _Counter() as fields_calls:
        roll_left(five, packed, 2, group)
    h = local(hidden_inputs(24, 99)[0], rank, world).requires_grad_()
    with _Counter() as fwd_calls:
        out = roll_hidden_left(h, packed, 2, group)
    with _Counter() as bwd_calls:
        out.sum().backward()

    # bad input: every rank raises before any communication; a good call afterwards proves the ranks agree
    with _Counter() as bad_calls:
        bad = _bad_inputs(rank, world, group)
    after = roll_left(five, packed, 1, group)
    after_expected = {n: local(oracle_roll(x, packed, 1, default_fill(n)), rank, world)
                      for n, x in full_fields(24, 99).items() if n in five}
    return dict(rolled=rolled, hidden=hidden, fields_calls=fields_calls.calls, fwd_calls=fwd_calls.calls,
                bwd_calls=bwd_calls.calls, bad=bad, bad_calls=bad_calls.calls, after=after,
                after_expected=after_expected)


# CP groups carved out of ONE 4-process spawn (a spawn costs seconds); their global ranks are not 0..cp-1,
# so the P2P helper's group-rank -> global-rank mapping is exercised too.
GROUP_MEMBERS = {1: [2], 2: [1, 3], 3: [0, 1, 3], 4: [0, 1, 2, 3]}
WORLD = 4


def _body(rank: int, world: int, device) -> dict[int, tuple[int, dict]]:
    """cp -> (group rank, results) for every CP group this rank belongs to."""
    mine = {}
    for cp in CPS:
        group = dist.new_group(GROUP_MEMBERS[cp])  # collective over the world: every rank calls it, in order
        if rank in GROUP_MEMBERS[cp]:
            group_rank = dist.get_rank(group)
            mine[cp] = (group_rank, _run_cp(group_rank, cp, group))
    return mine


@functools.cache
def _run_all() -> dict[int, list[dict]]:
    per_rank = spawn(_body, WORLD)
    by_cp: dict[int, dict[int, dict]] = {cp: {} for cp in CPS}
    for mine in per_rank:
        for cp, (group_rank, result) in mine.items():
            by_cp[cp][group_rank] = result
    return {cp: [by_cp[cp][r] for r in range(cp)] for cp in CPS}


def run(cp: int) -> list[dict]:
    """Per group rank, the results of :func:`_run_cp` on a CP group of ``cp`` ranks."""
    return _run_all()[cp]


# ------------------------------------------------------------------------------------ single rank
@pytest.mark.parametrize("case", cases(4), ids=lambda c: f"{c['name']}-d{c['depth']}")
def test_single_rank_roll_matches_oracle(case):
    packed = packed_of(case)
    fields = full_fields(case["total"], case["seed"])
    got = roll_left(fields, packed, case["depth"], fill=FILL_OVERRIDE)
    assert list(got) == list(fields)
    for name, x in fields.items():
        expected = oracle_roll(x, packed, case["depth"], fill_of(name))
        assert got[name].dtype == x.dtype and got[name].shape == x.shape
        assert torch.equal(got[name], expected), name


@pytest.mark.parametrize("case", cases(4), ids=lambda c: f"{c['name']}-d{c['depth']}")
def test_single_rank_hidden_roll_matches_oracle(case):
    packed = packed_of(case)
    h_full, gup = hidden_inputs(case["total"], case["seed"])
    h = h_full.clone().requires_grad_()
    out = roll_hidden_left(h, packed, case["depth"])
    out.backward(gup)
    assert torch.equal(out.detach(), oracle_roll(h_full, packed, case["depth"], 0.0))
    assert torch.equal(h.grad, oracle_hidden_grad(gup, packed, case["depth"]))


def test_hidden_roll_gradcheck():
    packed = PackedSeqs.from_lengths((3, 0, 1, 5), pad_to_multiple=2, total=14)
    h = torch.randn(14, 3, dtype=torch.float64, requires_grad=True)
    for depth in (1, 2, 3):
        assert torch.autograd.gradcheck(lambda x, depth=depth: roll_hidden_left(x, packed, depth), (h,))


def test_default_fill_rule():
    assert default_fill("padding_mask") is True
    assert default_fill("mtp_padding_mask") is True
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask"):
        assert default_fill(name) == 0
    packed = PackedSeqs.from_lengths((2,), total=4)
    got = roll_left({"padding_mask": torch.zeros(4, dtype=torch.bool), "loss_mask": torch.ones(4, dtype=torch.bool),
                     "position_ids": torch.arange(4), "int_padding_mask": torch.zeros(4, dtype=torch.int32)},
                    packed, 1)
    assert got["padding_mask"].tolist() == [False, True, True, True]
    assert got["loss_mask"].tolist() == [True, False, False, False]
    assert got["position_ids"].tolist() == [1, 0, 0, 0]
    assert got["int_padding_mask"].tolist() == [0, 1, 1, 1]
    got = roll_left({"padding_mask": torch.zeros(4, dtype=torch.bool)}, packed, 1, fill={"padding_mask": False})
    assert got["padding_mask"].tolist() == [False] * 4


def test_valid_rows_per_rank_concatenate():
    packed = PackedSeqs.from_lengths((0, 5, 0, 2, 7), pad_to_multiple=3, total=24)
    for depth in (1, 2, 3):
        src = oracle_sources(packed.padded_lengths(), packed.total, depth)
        for cp in CPS:
            rows = 24 // cp
            got = torch.cat([rolled_source_valid(packed, depth, r, rows) for r in range(cp)])
            assert got.tolist() == [s is not None for s in src]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), max_size=8),
    pad=st.integers(1, 4),
    tail=st.integers(0, 5),
    depth=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_single_rank_roll_property(lengths, pad, tail, depth, seed):
    packed = PackedSeqs.from_lengths(lengths, pad_to_multiple=pad)
    total = packed.padded_end + tail
    if total < depth:
        total = depth
    packed = PackedSeqs.from_lengths(lengths, pad_to_multiple=pad, total=total)
    fields = full_fields(total, seed)
    got = roll_left(fields, packed, depth)
    for name, x in fields.items():
        assert torch.equal(got[name], oracle_roll(x, packed, depth, default_fill(name))), name
    h, gup = hidden_inputs(total, seed)
    h.requires_grad_()
    out = roll_hidden_left(h, packed, depth)
    out.backward(gup)
    assert torch.equal(h.grad, oracle_hidden_grad(gup, packed, depth))


# ------------------------------------------------------------------------------------ distributed
@pytest.mark.parametrize("cp", CPS)
def test_cp_roll_equals_single_rank(cp):
    per_rank = run(cp)
    for i, case in enumerate(cases(cp)):
        packed = packed_of(case)
        fields = full_fields(case["total"], case["seed"])
        single = roll_left(fields, packed, case["depth"], fill=FILL_OVERRIDE)
        for name in fields:
            gathered = torch.cat([r["rolled"][i][name] for r in per_rank])
            assert torch.equal(gathered, single[name]), (case["name"], case["depth"], name)


@pytest.mark.parametrize("cp", CPS)
def test_cp_hidden_roll_and_gradient_equal_single_rank(cp):
    per_rank = run(cp)
    borrowed_grad_seen = False
    for i, case in enumerate(cases(cp)):
        packed, depth = packed_of(case), case["depth"]
        h_full, gup = hidden_inputs(case["total"], case["seed"])
        h = h_full.clone().requires_grad_()
        out = roll_hidden_left(h, packed, depth)
        out.backward(gup)
        got_out = torch.cat([r["hidden"][i][0] for r in per_rank])
        got_grad = torch.cat([r["hidden"][i][1] for r in per_rank])
        assert torch.equal(got_out, out.detach()), (case["name"], depth)
        torch.testing.assert_close(got_grad, h.grad, rtol=0, atol=0, msg=f"{case['name']} depth {depth}")
        rows = case["total"] // cp
        for rho in range(1, cp):  # rows whose gradient came back from the previous rank
            borrowed_grad_seen |= bool(h.grad[rho * rows : rho * rows + depth].abs().sum() > 0)
    assert borrowed_grad_seen or cp == 1


@pytest.mark.parametrize("cp", CPS)
def test_one_exchange_per_call(cp):
    for r in run(cp):
        assert len(r["fields_calls"]) == (0 if cp == 1 else 1), r["fields_calls"]
        assert all(n <= 2 for n in r["fields_calls"])  # one send and one receive at most
        assert len(r["fwd_calls"]) == (0 if cp == 1 else 1)
        assert len(r["bwd_calls"]) == (0 if cp == 1 else 1)
    if cp > 1:  # interior ranks send and receive, the edge ranks do one of the two
        ops = [r["fields_calls"][0] for r in run(cp)]
        assert ops[0] == 1 and ops[-1] == 1 and all(n == 2 for n in ops[1:-1])


@pytest.mark.parametrize("cp", CPS)
def test_bad_input_raises_on_every_rank_before_communication(cp):
    for rank, r in enumerate(run(cp)):
        assert r["bad_calls"] == [], f"rank {rank} communicated during bad calls"
        for prefix, message in r["bad"]:
            assert message is not None, f"rank {rank}: bad {prefix} did not raise"
            assert message.startswith(prefix), (prefix, message)
        for name, x in r["after"].items():
            assert torch.equal(x, r["after_expected"][name]), name


def test_bad_input_single_rank():
    packed = PackedSeqs.from_lengths((4,), total=6)
    x = {"input_ids": torch.arange(6)}
    with pytest.raises(ValueError, match="^depth: must be <= the rows per rank L = 6, got 7"):
        roll_left(x, packed, 7)
    with pytest.raises(ValueError, match=r"fields\['input_ids'\]"):
        roll_left({"input_ids": torch.arange(5)}, packed, 1)
    with pytest.raises(ValueError, match=r"fill\['input_ids'\]: must be a scalar"):
        roll_left(x, packed, 1, fill={"input_ids": torch.zeros(2)})
    with pytest.raises(ValueError, match="^h: must have L = 6 rows"):
        roll_hidden_left(torch.zeros(5, 2), packed, 1)
