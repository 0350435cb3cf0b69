"""The RoPE tables kept by :func:`dsv4cp.kernels.norm_rope_triton.rope_table`: the same table for the same
positions and frequencies, a new one after either is written or for another view, equal to a fresh
formation (bitwise) in every case, at most ``MAX_TABLES`` kept. CPU; positions from the per-test seed."""

from __future__ import annotations

import torch

from dsv4cp.kernels import norm_rope_triton
from dsv4cp.kernels.norm_rope_triton import MAX_TABLES, clear_rope_tables, rope_table


def _fresh(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return angles.cos().float(), angles.sin().float()


def _assert_table(got, positions, freqs) -> None:
    for have, want in zip(got, _fresh(positions, freqs)):
        assert have.dtype == torch.float32 and have.is_contiguous() and torch.equal(have, want)


def test_kept_tables_equal_fresh_ones_and_follow_writes(seed):
    clear_rope_tables()
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 70_000, (40,), generator=gen)
    freqs = torch.rand(8, generator=gen, dtype=torch.float64)
    first = rope_table(base[4:], freqs)
    _assert_table(first, base[4:], freqs)
    again = rope_table(base[4:], freqs.detach())  # a new view of the same memory: the kept table
    assert again[0] is first[0] and again[1] is first[1]
    other = rope_table(base[3:], freqs)  # another view: its own table
    _assert_table(other, base[3:], freqs)
    base[10] += 1  # writing the positions (a view's base) makes the kept table stale
    rewritten = rope_table(base[4:], freqs)
    assert rewritten[0] is not first[0]
    _assert_table(rewritten, base[4:], freqs)
    freqs.mul_(1.5)
    _assert_table(rope_table(base[4:], freqs), base[4:], freqs)


def test_tables_go_with_the_positions(seed):
    clear_rope_tables()
    gen = torch.Generator().manual_seed(seed)
    freqs = torch.rand(4, generator=gen, dtype=torch.float64)
    base = torch.randint(0, 100, (16,), generator=gen)
    rope_table(base[2:], freqs)
    assert len(norm_rope_triton._TABLES) == 1
    del base
    assert not norm_rope_triton._TABLES


def test_at_most_max_tables_are_kept(seed):
    clear_rope_tables()
    gen = torch.Generator().manual_seed(seed)
    freqs = torch.rand(4, generator=gen, dtype=torch.float64)
    positions = [torch.randint(0, 100, (16,), generator=gen) for _ in range(MAX_TABLES + 2)]
    for p in positions:
        rope_table(p, freqs)
    assert len(norm_rope_triton._TABLES) == MAX_TABLES
    _assert_table(rope_table(positions[0], freqs), positions[0], freqs)  # dropped, formed again
