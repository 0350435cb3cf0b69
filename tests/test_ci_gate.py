"""The CI performance gate (``.ci/gate.py``): its verdict rule on synthetic paired samples drawn from fixed
seeds (honest pairs raise no alarm, a 20% slowdown is caught, the interval covers the truth), the exact
null distribution it rests on, the counters' acceptance, and the gate end to end at small scale: a head
whose sparse_attn phase was made slower on purpose (a busy loop edited into a scratch copy of the
package) turns it red, the unchanged head green."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import wilcoxon

from dsv4cp.report.compare import parse_threshold
from dsv4cp.report.compare_stats import (
    AB_SAME,
    AB_UNDECIDED,
    FASTER,
    SLOWER,
    ab_verdict,
    excluded_averages,
    ratio_interval,
    signed_rank_cdf,
)

ROOT = Path(__file__).resolve().parent.parent


def _load_gate():
    spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gate = _load_gate()
CASES = 30
ROUNDS = gate.DEFAULT_ROUNDS
CONFIDENCE = 1 - gate.DEFAULT_ALPHA / CASES  # the gate's defaults
THRESHOLD = parse_threshold(gate.DEFAULT_THRESHOLD)


def loaded_pairs(rng: np.random.Generator, ms: float, slowdown: float = 1.0, n: int = ROUNDS, jitter: float = 0.065):
    """``n`` (base, head) step pairs of a loaded machine: a slow spell shared by both steps of a pair
    (up to 1.6x, drifting), 6.5% jitter of each step (the pair's log-ratio spreads by 0.09, as measured on
    the CI machine: results/2026-12-02-cpu-gate-process-bias), and in 3% of the steps a stall of up to 1.3x."""
    spell = np.exp(np.cumsum(0.15 * rng.standard_normal(n)).clip(-0.5, 0.5))
    steps = []
    for factor in (1.0, slowdown):
        times = ms * factor * spell * np.exp(jitter * rng.standard_normal(n))
        stalls = rng.random(n) < 0.03
        times[stalls] *= rng.uniform(1.1, 1.3, stalls.sum())
        steps.append(times)
    return steps


def test_the_signed_rank_distribution_is_scipys_exact_one(seed):
    rng = np.random.default_rng(seed)
    for n in (5, 9, 12):
        cdf = signed_rank_cdf(n)
        differences = rng.normal(0.2, 1.0, n)
        found = wilcoxon(differences, alternative="less", method="exact")
        assert cdf[int(found.statistic)] == pytest.approx(found.pvalue, rel=1e-9)
    strict = 1 - 0.01 / CASES
    assert excluded_averages(12, strict) == 0 and excluded_averages(13, strict) == 1


def confirmed(rng: np.random.Generator, ms: float, slowdown: float = 1.0, jitter: float = 0.065,
              threshold: float = THRESHOLD) -> str:
    """The gate's rule on one point: a first pass, and a second of fresh pairs where the first alarms."""
    first = ab_verdict(ratio_interval(*loaded_pairs(rng, ms, slowdown, jitter=jitter), CONFIDENCE), threshold)
    if first not in (SLOWER, FASTER):
        return first
    again = ab_verdict(ratio_interval(*loaded_pairs(rng, ms, slowdown, jitter=jitter), CONFIDENCE), threshold)
    return first if again == first else AB_UNDECIDED


def test_honest_pairs_raise_no_false_alarm_over_many_gates(seed):
    rng = np.random.default_rng(seed)
    first_alarms = confirmed_alarms = 0
    for _ in range(40):  # 40 gates of 30 cases: 1200 point comparisons
        for ms in rng.uniform(3, 20, CASES):
            first_alarms += ab_verdict(ratio_interval(*loaded_pairs(rng, ms), CONFIDENCE), 0.05) in (SLOWER, FASTER)
            # (at 5%, the rule's noise alone: the default threshold only removes alarms)
            verdict = confirmed(rng, ms)
            assert verdict in (AB_SAME, AB_UNDECIDED, SLOWER, FASTER)
            confirmed_alarms += verdict in (SLOWER, FASTER)
    assert first_alarms <= 12 and confirmed_alarms == 0, (first_alarms, confirmed_alarms)  # 1-7 at seeds 0-5


def test_a_20pct_slowdown_is_slower_and_the_interval_covers_it(seed):
    rng = np.random.default_rng(seed)
    caught = covered = 0
    for ms in rng.uniform(3, 20, 100):
        interval = ratio_interval(*loaded_pairs(rng, ms, 1.2), CONFIDENCE)
        caught += confirmed(rng, ms, 1.2) == SLOWER
        covered += interval.low <= 1.2 <= interval.high
    assert caught >= 97 and covered >= 95, (caught, covered)
    noisier = sum(confirmed(rng, ms, 1.2, jitter=0.105) == SLOWER for ms in rng.uniform(3, 20, 100))
    assert noisier >= 90, noisier  # a paired log-sd of 0.15: still >= 90% with both passes


def test_a_10pct_slowdown_is_caught_often_and_pooled_cases_catch_6pct(seed):
    rng = np.random.default_rng(seed)
    caught = sum(confirmed(rng, ms, 1.1, threshold=0.05) == SLOWER for ms in rng.uniform(3, 20, 100))
    assert caught >= 60, caught  # 10% at a paired log-sd of 0.09 and --threshold 5%: 71-83% at seeds 0-5
    suites = 0
    for _ in range(10):  # a suite of 30 cases, each 6% slower: one point would not tell, the pool does
        pooled = [loaded_pairs(rng, ms, 1.06) for ms in rng.uniform(3, 20, CASES)]
        interval = ratio_interval(np.concatenate([b for b, _ in pooled]), np.concatenate([h for _, h in pooled]),
                                  0.99)
        suites += ab_verdict(interval, 0.05) == SLOWER
    assert suites >= 9, suites


def test_the_signed_rank_distribution_stays_finite_for_a_pooled_suite():
    cdf = np.asarray(signed_rank_cdf(30 * ROUNDS))
    n = 30 * ROUNDS
    assert np.all(np.isfinite(cdf)) and cdf[-1] == pytest.approx(1.0, abs=1e-9) and np.all(np.diff(cdf) >= 0)
    mean, sd = n * (n + 1) / 4, (n * (n + 1) * (2 * n + 1) / 24) ** 0.5
    k = excluded_averages(n, 0.99)  # the normal approximation's 0.5% tail, to within a few ranks in 10^5
    assert abs(k - (mean - 2.5758 * sd)) < 0.002 * mean, (k, mean - 2.5758 * sd)


def test_no_worker_times_two_steps_in_a_row():
    for sides in (["head", "head2"], ["base", "head", "head2"], ["base", "head", "head2", "inject"]):
        for round_ in range(5):
            order = [side for case in range(7) for side in gate.rotated(sides, round_, case)]
            assert all(a != b for a, b in zip(order, order[1:])), (sides, round_, order)
            assert all(sorted(gate.rotated(sides, round_, case)) == sorted(sides) for case in range(7))
        firsts = {gate.rotated(sides, round_, 0)[0] for round_ in range(len(sides))}
        assert firsts == set(sides)  # every side leads a pair in turn


def test_an_alarm_the_confirmation_contradicts_is_undecided(seed):
    rng = np.random.default_rng(seed)
    plan = gate.Plan(rounds=ROUNDS, blocks=1, injections=0, threshold=0.05, suite_threshold=0.05, alpha=0.01)
    comparison = gate.Comparison("self", 0, "head", "head2")
    samples = gate.Samples()
    for case, (first_slowdown, again) in enumerate(((1.3, 1.3), (1.3, 1.0), (1.0, 1.0))):
        a, b = loaded_pairs(rng, 10.0, first_slowdown)
        for x, y in zip(a, b):
            samples.add("head", 0, case, float(x))
            samples.add("head2", 0, case, float(y))
        a, b = loaded_pairs(rng, 10.0, again)
        samples.confirmations[(comparison, case, "head")] = list(a)
        samples.confirmations[(comparison, case, "head2")] = list(b)
    firsts = gate.first_verdicts(samples, comparison, 3, plan)
    assert [v for v, _ in firsts] == [SLOWER, SLOWER, AB_SAME]
    final = gate.final_verdicts(samples, comparison, firsts, plan)
    assert [p["verdict"] for p in final] == [SLOWER, AB_UNDECIDED, AB_SAME]
    assert final[0]["confirmation"].ratio == pytest.approx(1.3, rel=0.1) and final[2]["confirmation"] is None


def test_verdict_edges_and_bad_samples():
    interval = ratio_interval([10.0] * 6, [10.0 * 1.3 + i * 0.01 for i in range(6)], 0.9)
    assert ab_verdict(interval, 0.05) == SLOWER and interval.ratio == pytest.approx(1.3025, rel=1e-3)
    assert ab_verdict(ratio_interval([10.0] * 6, [7.0 + i * 0.01 for i in range(6)], 0.9), 0.05) == FASTER
    wide = ratio_interval([10.0, 10.0, 10.0], [13.0, 13.0, 13.0], CONFIDENCE)  # 3 pairs cannot exclude 1
    assert ab_verdict(wide, 0.05) == AB_UNDECIDED and wide.low == 0
    for base, head, message in (([1.0], [1.0], "base: needs at least 2"),
                                ([1.0, 2.0], [1.0, 2.0, 3.0], "samples must be paired"),
                                ([1.0, float("nan")], [1.0, 1.0], "base: needs at least 2 finite")):
        with pytest.raises(ValueError, match=message):
            ratio_interval(base, head, 0.9)


def test_a_counter_change_fails_unless_an_entry_accepts_exactly_it():
    base = {"p": {"ops_per_step": 10, "host_syncs_per_step": 1}}
    head = {"p": {"ops_per_step": 12, "host_syncs_per_step": 1}}
    failing, passed, unsteady = gate.counter_changes(base, head, head, [])
    assert failing == ["p: ops_per_step 10 -> 12"] and not passed and not unsteady
    entry = {"point": "p", "counter": "ops_per_step", "old": 10, "new": 12, "reason": "fused two ops"}
    failing, passed, _ = gate.counter_changes(base, head, head, [entry])
    assert not failing and passed == ["p: ops_per_step 10 -> 12 (accepted: fused two ops)"]
    stale = {**entry, "new": 11}  # accepts another change: not this one
    assert gate.counter_changes(base, head, head, [stale])[0] == ["p: ops_per_step 10 -> 12"]
    drifting = {"p": {"ops_per_step": 13, "host_syncs_per_step": 1}}
    failing, _, unsteady = gate.counter_changes(base, head, drifting, [])
    assert not failing and unsteady == ["p: ops_per_step 12 vs 13 in two head processes"]


def test_refresh_needs_a_reason_and_a_clean_tree(capsys):
    assert gate.main(["--refresh"]) == 2
    assert "--reason: a refresh needs a reason" in capsys.readouterr().err


SPEC = """name: gate_test
description: the gate end to end at small scale
run: {warmup: 1, reps: 3}
base: {preset: tiny, tokens: 256, dtype: fp32, kernel_backend: torch, overlap: async, packing: adversarial}
axes:
  ratio: [0, 8]
  pass: [fwd+bwd]
"""

SLOWED_PHASE = """

import time  # noqa: E402


def _slowed(direction):
    def run(ctx, *args):
        start = time.process_time()
        result = direction(ctx, *args)
        until = time.process_time() + 0.6 * (time.process_time() - start)
        while time.process_time() < until:  # the phase 60% slower on purpose
            pass
        return result
    return staticmethod(run)


_SparseAttention.forward = _slowed(_SparseAttention.forward)
_SparseAttention.backward = _slowed(_SparseAttention.backward)
"""


def _slowed_copy(folder: Path) -> Path:
    """A scratch copy of the package whose sparse_attn forward and backward spin 60% of their own time
    longer (over the 30 smoke cases the step ran 10% slower: results/2026-12-03-cpu-gate-ab/slowed.log)."""
    tree = folder / "head"
    shutil.copytree(ROOT / "dsv4cp", tree / "dsv4cp", ignore=shutil.ignore_patterns("__pycache__"))
    op = tree / "dsv4cp" / "ops" / "sparse_attention.py"
    text = op.read_text()
    assert "class _SparseAttention(torch.autograd.Function):" in text
    op.write_text(text + SLOWED_PHASE)
    return tree


def test_a_slowed_phase_turns_the_gate_red_and_the_unchanged_head_green(tmp_path, capsys):
    spec = tmp_path / "gate_test.yaml"
    spec.write_text(SPEC)
    flags = ["--spec", str(spec), "--skip-sweep", "--base", "HEAD", "--blocks", "1", "--injections", "0"]
    assert gate.main([*flags, "--head-tree", str(_slowed_copy(tmp_path))]) == 1
    out = capsys.readouterr()
    assert "SLOWER" in out.out and "points SLOWER than the base" in out.err
    assert gate.main(flags) == 0
    out = capsys.readouterr().out
    assert "0 SLOWER" in out and "gate: passed" in out and "COUNTER CHANGED" not in out
