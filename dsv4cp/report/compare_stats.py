"""The statistics of ``dsv4cp compare`` and of the CI gate's A/B comparison.

``dsv4cp compare``'s decision for one matched point: a rank test on the repetitions' times AND a
minimum effect size; an exact metric (the cost model's) by its values alone; the older rule on the
p20..p80 bands only for records that hold no repetition times at all. Where the noise cannot be told
(repetition times too few to reach the per-point level, or a noisy metric with no spread recorded)
a change beyond the threshold is ``undecided``, never a regression: an honest rerun of a 3-repetition
sweep is no alarm.

With samples (``time_ms_samples`` on both sides): the one-sided Mann-Whitney U test of "NEW's times are
larger (worse) than BASELINE's" (scipy's, exact for small samples without ties, else the normal
approximation with tie correction), at the per-point level ``alpha / points`` (Bonferroni over the
points judged, so a run of many points does not raise false alarms by their number); a regression
needs that AND a ratio of medians beyond ``1 + threshold`` (and, when asked, a slowdown beyond an
absolute floor). An improvement is the mirror image. A point with too few samples to ever reach the
per-point level (3 and 3 samples cannot go below p = 0.05) is ``undecided`` beyond the threshold
(method ``too few``), and says so.

Band rule (old records without samples): beyond the threshold AND the two p20..p80 bands apart.

A/B (the CI gate, :func:`ratio_interval` and :func:`ab_verdict`): head and base samples taken
interleaved in one job, in pairs (one step of each, next to each other); the head/base ratio is the
Hodges-Lehmann estimate of the pairs' log ratios, its interval the distribution-free one of the
Wilcoxon signed-rank statistic (k from its exact null distribution). Pairing cancels the loaded
machine's slow spells, which an unpaired test counts as noise. FASTER / SLOWER
need the interval to exclude 1 AND the estimate beyond the threshold; an estimate beyond the threshold
with an interval that holds 1 is UNDECIDED (too noisy to tell); the rest is SAME.

Every comparison can run against a baseline scaled by a machine factor (``scale``: how much slower the
machine runs now, e.g. the CI gate's median ratio over all points): the baseline's times are multiplied
by it (its rates divided) before the test and the ratio.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import mannwhitneyu

REGRESSION, IMPROVEMENT, WITHIN_NOISE, SAME = "regression", "improvement", "within noise", "same"
UNDECIDED = "undecided"
"""Beyond the threshold, but nothing measured the noise well enough to tell (never a regression)."""

RANK_TEST, BAND_RULE, EXACT, TOO_FEW, NO_SPREAD = "U test", "bands", "exact", "too few", "no spread"
"""How a point was judged: the rank test, the band rule (records without repetition times), an exact
metric's values, repetition times too few to reach the per-point level, a noisy metric with no
recorded spread."""

FASTER, SLOWER, AB_SAME, AB_UNDECIDED = "FASTER", "SLOWER", "SAME", "UNDECIDED"
"""The A/B verdicts of :func:`ab_verdict`."""


@dataclass(frozen=True)
class Rule:
    """The thresholds of one comparison."""

    threshold: float
    """Minimum effect: a ratio beyond ``1 + threshold`` (or below ``1 - threshold``)."""
    alpha: float
    """Family-wise false-alarm level of the rank test over all points judged."""
    points: int
    """How many points the comparison judges (the Bonferroni divisor)."""
    scale: float = 1.0
    """Machine factor the baseline's times are multiplied by."""
    min_difference: float = 0.0
    """A lower-is-better regression must also be worse by more than this, in the metric's unit."""

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"threshold: must be >= 0, got {self.threshold}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"--alpha: must lie in (0, 1), got {self.alpha}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale: the machine factor must be a finite number > 0, got {self.scale}")
        if not self.min_difference >= 0:
            raise ValueError(f"min_difference: must be >= 0, got {self.min_difference}")

    @property
    def point_alpha(self) -> float:
        return self.alpha / max(self.points, 1)


@dataclass(frozen=True)
class Measured:
    """One side of a point: the compared value, its p20..p80 band, and the repetitions' times (ms)."""

    value: float
    low: float
    high: float
    samples: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Decision:
    verdict: str
    method: str
    """:data:`RANK_TEST` or :data:`BAND_RULE`."""
    cost: float
    """How much worse NEW is, > 1 worse: new / (baseline x scale), inverted for higher-is-better."""
    statistic: str
    """What the verdict rests on, printed per point: the p-value, or whether the bands are apart."""


@functools.lru_cache(maxsize=256)
def smallest_p(new_count: int, base_count: int) -> float:
    """The smallest one-sided p-value the U test can give for these sample counts (every NEW time
    above every BASELINE time), computed the way the test itself computes it."""
    return float(mannwhitneyu(np.arange(base_count, base_count + new_count), np.arange(base_count),
                              alternative="greater").pvalue)


def rank_test_usable(base: Measured, new: Measured, rule: Rule) -> bool:
    """Whether both sides have samples, enough of them to reach the per-point level."""
    if base.samples is None or new.samples is None:
        return False
    return smallest_p(len(new.samples), len(base.samples)) < rule.point_alpha


def decide(base: Measured, new: Measured, rule: Rule, *, higher_is_better: bool, exact: bool = False,
           spread: bool = True) -> Decision:
    """The verdict for one point with finite values on both sides (see the module docstring). ``exact``:
    the metric is computed, not measured (a change is real); ``spread``: the metric has a noise band or
    repetition times (without either a change beyond the threshold is undecided)."""
    cost = _cost(base.value * (1 / rule.scale if higher_is_better else rule.scale), new.value, higher_is_better)
    big_enough = higher_is_better or new.value - base.value * rule.scale > rule.min_difference
    beyond = cost > 1 + rule.threshold or cost < 1 - rule.threshold
    if exact:
        worse_apart = better_apart = True
        method, statistic = EXACT, "computed"
    elif base.samples is not None and new.samples is not None and not rank_test_usable(base, new, rule):
        return Decision(UNDECIDED if beyond else SAME, TOO_FEW,
                        cost, f"n={len(new.samples)},{len(base.samples)}")
    elif not spread:
        return Decision(UNDECIDED if beyond else SAME, NO_SPREAD, cost, "no noise measure")
    elif rank_test_usable(base, new, rule):
        scaled = np.asarray(base.samples) * rule.scale
        worse = float(mannwhitneyu(new.samples, scaled, alternative="greater").pvalue)
        better = float(mannwhitneyu(new.samples, scaled, alternative="less").pvalue)
        p = worse if cost >= 1 else better
        worse_apart, better_apart = worse < rule.point_alpha, better < rule.point_alpha
        method, statistic = RANK_TEST, f"p={p:.2g}"
    else:
        if higher_is_better:  # rates: the baseline's band divided by the machine factor
            low, high = base.low / rule.scale, base.high / rule.scale
            worse_apart, better_apart = new.high < low, new.low > high
        else:
            low, high = base.low * rule.scale, base.high * rule.scale
            worse_apart, better_apart = new.low > high, new.high < low
        method = BAND_RULE
        statistic = "apart" if worse_apart or better_apart else "overlap"
    if cost > 1 + rule.threshold:
        verdict = REGRESSION if worse_apart and big_enough else WITHIN_NOISE
    elif cost < 1 - rule.threshold:
        verdict = IMPROVEMENT if better_apart else WITHIN_NOISE
    else:
        verdict = SAME
    return Decision(verdict, method, cost, statistic)


def _cost(base: float, new: float, higher_is_better: bool) -> float:
    """new / base (base / new for higher-is-better); 1 when both are 0, inf when only the better one is."""
    worse, better = (base, new) if higher_is_better else (new, base)
    if better == 0:
        return 1.0 if worse == 0 else math.inf
    return worse / better


@dataclass(frozen=True)
class RatioInterval:
    """The head/base time ratio of one A/B point: the Hodges-Lehmann estimate and its interval."""

    ratio: float
    low: float
    high: float
    confidence: float
    """Two-sided coverage of ``low .. high``."""


@functools.lru_cache(maxsize=64)
def signed_rank_cdf(n: int) -> tuple[float, ...]:
    """P(T <= t) for t = 0 .. n(n+1)/2 under the null: the Wilcoxon signed-rank statistic's exact
    distribution (each of the ranks 1..n counted in T with probability 1/2, independently). Built as
    probabilities, halved per rank, not as counts of ways: the counts pass float64's range at n ~ 1000
    (a gate's pooled suite has 30 cases x its rounds)."""
    probability = np.zeros(n * (n + 1) // 2 + 1)
    probability[0] = 1.0
    for rank in range(1, n + 1):
        probability[rank:] = (probability[rank:] + probability[:-rank]) / 2
        probability[:rank] /= 2
    return tuple(np.cumsum(probability))


def excluded_averages(n: int, confidence: float) -> int:
    """How many of the n(n+1)/2 Walsh averages each end of the interval drops: the largest k with
    P(T < k) <= (1 - confidence) / 2 (0: the pairs are too few, the interval is unbounded)."""
    cdf = signed_rank_cdf(n)
    tail = (1 - confidence) / 2
    k = 0
    while k < len(cdf) and cdf[k] <= tail:
        k += 1
    return k


def ratio_interval(base: Sequence[float], head: Sequence[float], confidence: float) -> RatioInterval:
    """The head/base ratio of PAIRED samples (``base[i]`` and ``head[i]`` taken next to each other, so a
    slow spell of the machine slows both): the Hodges-Lehmann estimate exp(median of the Walsh averages
    of log(head_i / base_i)) with the signed-rank interval at ``confidence``. ``ValueError`` for unequal
    or fewer than 2 pairs, or a time that is not finite and > 0."""
    b, h = np.asarray(base, dtype=float), np.asarray(head, dtype=float)
    for name, values in (("base", b), ("head", h)):
        if len(values) < 2 or not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(f"{name}: needs at least 2 finite times > 0, got {values.tolist()}")
    if len(b) != len(h):
        raise ValueError(f"head: {len(h)} samples for {len(b)} of base: the samples must be paired")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must lie in (0, 1), got {confidence}")
    logs = np.log(h) - np.log(b)
    upper = np.triu_indices(len(logs))
    walsh = np.sort((logs[upper[0]] + logs[upper[1]]) / 2)
    k = excluded_averages(len(logs), confidence)
    low, high = (walsh[k - 1], walsh[len(walsh) - k]) if k > 0 else (-math.inf, math.inf)
    return RatioInterval(float(np.exp(np.median(walsh))), float(np.exp(low)), float(np.exp(high)), confidence)


def ab_verdict(interval: RatioInterval, threshold: float) -> str:
    """SLOWER / FASTER: the interval excludes 1 and the ratio is beyond ``1 + threshold`` (below
    ``1 / (1 + threshold)``); UNDECIDED: beyond it, the interval holding 1; SAME otherwise."""
    if interval.ratio > 1 + threshold:
        return SLOWER if interval.low > 1 else AB_UNDECIDED
    if interval.ratio < 1 / (1 + threshold):
        return FASTER if interval.high < 1 else AB_UNDECIDED
    return AB_SAME
