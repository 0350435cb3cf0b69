"""The cost model stays exact far past int64 (it once printed negative TFLOP from 2^33 rows)."""

from __future__ import annotations

import math

import pytest

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.model import estimate, rank_counts

FLASH = DSv4Config.preset("flash")
R = 4


def _visible_closed_form(t: int, r: int) -> int:
    """sum_{u=1..T} floor(u / r) for T = q r: blocks j = 1..q-1 of r values each, then u = T gives q."""
    q = t // r
    return r * q * (q - 1) // 2 + q


def _topk_closed_form(t: int, r: int, k: int) -> int:
    """sum_{u=1..T} min(K, floor(u / r)): the blocks below u = K r, then K for each of the T - K r + 1 rest."""
    return r * k * (k - 1) // 2 + k * (t - k * r + 1)


@pytest.mark.parametrize("exponent", [33, 36, 40])
@pytest.mark.parametrize("cp", [1, 2])
def test_counts_match_closed_forms_past_int64(exponent, cp):
    t = 2**exponent
    counts = rank_counts(FLASH, R, [t], cp)
    visible = sum(counts.visible_entries)
    assert isinstance(visible, int)
    if exponent >= 36:
        assert visible > 2**63  # beyond int64: the count that used to wrap around
    assert visible == _visible_closed_form(t, R)
    assert sum(counts.compressed_keys) == _topk_closed_form(t, R, FLASH.index_topk)
    w = FLASH.window
    assert sum(counts.window_keys) == w * (w + 1) // 2 + (t - w) * w
    assert sum(counts.owned_entries) == t // R


@pytest.mark.parametrize("exponent", [33, 40])
def test_flops_are_float64_exact_and_positive(exponent):
    t = 2**exponent
    est = estimate(FLASH, R, [t], 2)
    score = est.table("fwd")
    score = score[score["phase"] == "indexer.score"]["flops"].sum()
    expected = 2.0 * FLASH.index_n_heads * FLASH.index_head_dim * _visible_closed_form(t, R)
    assert math.isclose(score, expected, rel_tol=1e-12)
    for direction in ("fwd", "bwd", "fwd+bwd"):
        s = est.summary(direction)
        assert s.model_flops > 0 and math.isfinite(s.model_flops)
        assert 1.0 <= s.flops_imbalance <= 2.0  # max / mean over 2 ranks


def test_model_command_prints_no_negative_figure(capsys):
    assert main(["model", "--tokens", "1000000000000", "--cp", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "TFLOP (" in line]
    assert len(lines) == 3
    for line in lines:
        assert " -" not in line and "model -" not in line, line


def test_halo_flops_survive_huge_token_counts():
    """The halo's redundant work (a fixed 128 rows per rank boundary for one document) is summed on its
    own: taken as total - model FLOPs it vanished in float64 rounding at 10^12 tokens (printed +0.00)."""
    small = estimate(FLASH, R, [2**20], 2).summary("fwd+bwd").halo_flops
    huge = estimate(FLASH, R, [2**40], 2).summary("fwd+bwd").halo_flops
    assert small > 0
    assert huge == pytest.approx(small, rel=1e-9)
