"""The decision of ``dsv4cp compare`` for one matched point: a rank test on the repetitions' times AND a
minimum effect size, or (without usable samples) the older rule on the p20..p80 bands.

With samples (``time_ms_samples`` on both sides): the one-sided Mann-Whitney U test of "NEW's times are
larger (worse) than BASELINE's" (scipy's, exact for small samples without ties, else the normal
approximation with tie correction), at the per-point level ``alpha / points`` (Bonferroni over the
points judged, so a run of many points does not raise false alarms by their number); a regression
needs that AND a ratio of medians beyond ``1 + threshold`` (and, when asked, a slowdown beyond an
absolute floor). An improvement is the mirror image. A point with too few samples to ever reach the
per-point level (3 and 3 samples cannot go below p = 0.05) is judged by the band rule instead, and says so.

Band rule (old records without samples): beyond the threshold AND the two p20..p80 bands apart.

Every comparison can run against a baseline scaled by a machine factor (``scale``: how much slower the
machine runs now, e.g. the CI gate's median ratio over all points): the baseline's times are multiplied
by it (its rates divided) before the test and the ratio.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import mannwhitneyu

REGRESSION, IMPROVEMENT, WITHIN_NOISE, SAME = "regression", "improvement", "within noise", "same"

RANK_TEST, BAND_RULE = "U test", "bands"


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


def decide(base: Measured, new: Measured, rule: Rule, *, higher_is_better: bool) -> Decision:
    """The verdict for one point with finite values on both sides (see the module docstring)."""
    cost = _cost(base.value * (1 / rule.scale if higher_is_better else rule.scale), new.value, higher_is_better)
    big_enough = higher_is_better or new.value - base.value * rule.scale > rule.min_difference
    if rank_test_usable(base, new, rule):
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
