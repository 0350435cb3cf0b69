"""Baseline vs new: match points by their identity, judge each from its repetitions' times, and never
let a broken value pass as noise.

Inputs (one per side, :mod:`dsv4cp.report.compare_sides`): a run directory or ``.jsonl`` of records
(points keyed by ``point_id``, i.e. all their axes) or a pytest-benchmark JSON file (keyed by the
test's ``fullname``). Two matched points are the same measurement only when their configuration
(``records.CONFIG_FIELDS``: ``kernel_options``, ``backends`` and ``fresh_batches``, resolved as ``sweep
--resume`` and the report resolve them: :func:`dsv4cp.records.configuration_differences`; a side without
them is "unknown", equal to another unknown) agrees too; otherwise they are *not comparable*, printed as
``configuration differs: KEY a -> b``, unless ``ignore_options`` names the key (the difference is what is
compared).

Verdict per comparable point (the rule: :mod:`dsv4cp.report.compare_stats`), with ``cost`` = new /
baseline (baseline / new for a higher-is-better metric, so cost > 1 is always worse):

* ``regression``: cost > 1 + threshold AND (with samples) the one-sided Mann-Whitney U test rejects
  "no slower" at ``alpha / points``, or (without samples: the band rule) the p20..p80 bands are apart;
* ``improvement``: the mirror image; ``within noise``: beyond the threshold, not significant;
  ``same``: within the threshold; ``undecided``: beyond the threshold where nothing measures the noise
  (repetition times too few for the test, or a noisy metric without band or times): never a regression;
* an exact metric (the cost model's ``model_flops``, ``bound_ms``): beyond the threshold is a change;
* ``failed: <status>``: measured in the baseline, not ``ok`` in the new run (counts as a regression);
* ``invalid in BASELINE|NEW: <reason>``: a value that cannot be a measurement (non-finite, negative,
  outside its own band or samples, two ``ok`` records of one point): an error, never noise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field

import pandas as pd

from dsv4cp.records import STATUS_OK, configuration_differences
from dsv4cp.report.compare_sides import (
    EXACT_METRICS,
    HIGHER_IS_BETTER,
    INVERSE_OF_TIME,
    STATUS_INVALID,
    TIME_BANDS,
    Side,
    UnusableInputError,
    load_side,
    unit_of,
)
from dsv4cp.report.compare_stats import (
    BAND_RULE,
    EXACT,
    IMPROVEMENT,
    NO_SPREAD,
    RANK_TEST,
    REGRESSION,
    TOO_FEW,
    UNDECIDED,
    Measured,
    Rule,
    decide,
    smallest_p,
)

__all__ = ["DEFAULT_ALPHA", "Comparison", "Side", "UnusableInputError", "benchmark_action_json", "compare",
           "config_differences", "load_side", "parse_threshold", "render"]

DEFAULT_ALPHA = 0.01
"""Family-wise false-alarm level of the rank test: an honest rerun of any number of points is called
a regression at most this often (before the effect-size threshold, which lowers it further)."""

TABLE_COLUMNS: tuple[str, ...] = (
    "key", "name", "baseline", "baseline_low", "baseline_high", "baseline_n", "new", "new_low", "new_high",
    "new_n", "ratio", "cost", "method", "statistic", "verdict",
)


def parse_threshold(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; ``ValueError`` naming ``--max-regression`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", text)
    if not match:
        raise ValueError(f"--max-regression: expected a percentage like 5% or a fraction like 0.05, got {text!r}")
    value = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
    if not match.group(2) and value >= 1.0:
        raise ValueError(f"--max-regression: {text!r} is ambiguous: write {text}% or {value / 100:g}")
    return value


@dataclass(frozen=True)
class Comparison:
    """The judged points (``table``, columns :data:`TABLE_COLUMNS`) and everything that was not judged."""

    metric: str
    rule: Rule
    table: pd.DataFrame
    baseline_only: list[str] = field(default_factory=list)
    new_only: list[str] = field(default_factory=list)
    not_comparable: list[str] = field(default_factory=list)
    """``name: why`` of matched points that are not the same measurement (configuration, no baseline value)."""
    not_measured: list[str] = field(default_factory=list)
    """Points measured in BASELINE whose NEW record holds no value of the metric (missing, like ``baseline_only``)."""
    skipped: list[str] = field(default_factory=list)
    """``SIDE file:line: reason`` of the lines of either side that are no record of any point."""
    duplicates: list[str] = field(default_factory=list)
    ignored_options: tuple[str, ...] = ()

    @property
    def threshold(self) -> float:
        return self.rule.threshold

    @property
    def regressions(self) -> pd.DataFrame:
        verdicts = self.table["verdict"]
        return self.table[(verdicts == REGRESSION) | verdicts.str.startswith("failed")]

    @property
    def errors(self) -> pd.DataFrame:
        """Points with a value that cannot be a measurement, on either side."""
        return self.table[self.table["verdict"].str.startswith("invalid")]

    @property
    def improvements(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] == IMPROVEMENT]

    @property
    def missing(self) -> list[str]:
        """Points of BASELINE without a value in NEW (what ``--fail-on-missing`` fails on)."""
        return [*self.baseline_only, *self.not_measured]


def _shown(value: object) -> str:
    if value is None:
        return "unknown"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 48 else text[:45] + "..."


def _is_ignored(column: str, key: str | None, ignored: Collection[str]) -> bool:
    return column in ignored or (key is not None and (key in ignored or f"{column}.{key}" in ignored))


def config_differences(base: dict, new: dict, ignored: Collection[str] = ()) -> list[str]:
    """``KEY a -> b`` for each entry on which two points' configurations differ as they ran
    (:func:`records.configuration_differences`: kernel options resolved as ``sweep --resume`` and the report
    resolve them; None: unknown, equal to another unknown); a KEY is ``column.option`` (e.g.
    ``kernel_options.topk_impl``) or a whole column when one side lacks it. ``ignored``: column
    names, option names or ``column.option`` keys whose differences do not count."""
    out = []
    for key, (a, b) in configuration_differences(base, new).items():
        column, _, option = key.partition(".")
        if not _is_ignored(column, option or None, ignored):
            out.append(f"{key} {_shown(a)} -> {_shown(b)}")
    return out


def _measured(row: pd.Series) -> Measured:
    return Measured(float(row["value"]), float(row["low"]), float(row["high"]), row["samples"])


def compare(baseline: Side, new: Side, metric: str, *, threshold: float, alpha: float = DEFAULT_ALPHA,
            scale: float = 1.0, min_difference: float = 0.0, ignore_options: Collection[str] = (),
            allow_different_hardware: bool = False) -> Comparison:
    """Match the sides' points and give each a verdict (see the module docstring).

    ``threshold``: minimum effect (0.05: 5 %); ``alpha``: the rank test's family-wise level;
    ``scale``: machine factor the baseline's times are multiplied by; ``min_difference``: a
    lower-is-better regression must also be worse by this much (the metric's unit);
    ``ignore_options``: configuration keys whose differences do not make points incomparable.
    Raises :class:`UnusableInputError` for sides of different kinds, different hardware (unless
    allowed), no matched or no comparable point, or no value of ``metric`` on any matched point.
    """
    if baseline.kind != new.kind:
        raise UnusableInputError(f"inputs: BASELINE is a {baseline.kind} and NEW a {new.kind}: compare like with like")
    if baseline.hardware != new.hardware and not allow_different_hardware:
        raise UnusableInputError(f"hardware: BASELINE ran on {baseline.hardware!r}, NEW on {new.hardware!r}; "
                                 "pass --allow-different-hardware to compare anyway")
    measured = baseline.points[baseline.points["status"].isin([STATUS_OK, STATUS_INVALID])]
    keys = [k for k in measured.index if k in new.points.index]
    if not keys:
        raise UnusableInputError(
            f"points: no point of BASELINE ({len(measured)} measured) matches one of NEW ({len(new.points)}) "
            f"by its {'benchmark names' if new.kind == 'pytest-benchmark' else 'axes'}")
    ignored = tuple(ignore_options)
    rows, judged, not_comparable, not_measured = [], [], [], []
    for key in keys:
        b, n = measured.loc[key], new.points.loc[key]
        row = {"key": key, "name": b["name"], "baseline": b["value"], "baseline_low": b["low"],
               "baseline_high": b["high"], "baseline_n": len(b["samples"] or ()), "new": n["value"],
               "new_low": n["low"], "new_high": n["high"], "new_n": len(n["samples"] or ()),
               "ratio": n["value"] / b["value"] if b["value"] > 0 else math.nan, "cost": math.nan,
               "method": "", "statistic": ""}
        differences = config_differences(b["config"], n["config"], ignored)
        if b["status"] == STATUS_INVALID:
            rows.append({**row, "verdict": f"invalid in BASELINE: {b['problem']}"})
        elif n["status"] == STATUS_INVALID:
            rows.append({**row, "verdict": f"invalid in NEW: {n['problem']}"})
        elif differences:
            not_comparable.append(f"{b['name']}: configuration differs: " + "; ".join(differences))
        elif math.isnan(b["value"]):
            not_comparable.append(f"{b['name']}: {metric} not measured in BASELINE")
        elif n["status"] != STATUS_OK:
            rows.append({**row, "new": math.nan, "ratio": math.nan, "verdict": f"failed: {n['status']}"})
        elif math.isnan(n["value"]):
            not_measured.append(f"{b['name']}: {metric} not measured in NEW")
        else:
            judged.append((len(rows), b, n))
            rows.append(row)
    if not rows:
        if not_measured and not any("configuration differs" in line for line in not_comparable):
            raise UnusableInputError(f"--metric: {metric} was not measured on any matched point of NEW")
        if not any("configuration differs" in line for line in not_comparable):
            raise UnusableInputError(f"--metric: {metric} was not measured on any matched point of BASELINE")
        raise UnusableInputError(
            f"points: none of the {len(keys)} matched points is comparable (the first: {not_comparable[0]}); "
            "pass --ignore-option KEY when that difference is what you compare")
    rule = Rule(threshold, alpha, len(judged), scale, min_difference)
    for index, b, n in judged:
        # a noisy metric without a band is judged on repetition times where both sides hold them
        spread = (new.kind == "pytest-benchmark" or metric in TIME_BANDS or metric in INVERSE_OF_TIME
                  or (b["samples"] is not None and n["samples"] is not None))
        decision = decide(_measured(b), _measured(n), rule, higher_is_better=metric in HIGHER_IS_BETTER,
                          exact=metric in EXACT_METRICS, spread=spread)
        rows[index].update(cost=decision.cost, method=decision.method, statistic=decision.statistic,
                           verdict=decision.verdict)
    return Comparison(
        metric=metric, rule=rule, table=pd.DataFrame(rows, columns=list(TABLE_COLUMNS)),
        baseline_only=[baseline.points.loc[k, "name"] for k in baseline.points.index if k not in new.points.index],
        new_only=[new.points.loc[k, "name"] for k in new.points.index if k not in baseline.points.index],
        not_comparable=not_comparable, not_measured=not_measured,
        skipped=[f"BASELINE {line}" for line in baseline.skipped] + [f"NEW {line}" for line in new.skipped],
        duplicates=[f"BASELINE {line}" for line in baseline.duplicates] + [f"NEW {line}" for line in new.duplicates],
        ignored_options=ignored,
    )


def _short_names(names: pd.Series) -> pd.Series:
    """Names without the ``axis=value`` words every matched point shares (the table's varying part)."""
    words = [name.split(" ") for name in names]
    shared = set.intersection(*map(set, words)) if words else set()
    return pd.Series([" ".join(w for w in ws if w not in shared) or " ".join(ws) for ws in words], index=names.index)


def _band(low: float, high: float) -> str:
    return "" if math.isnan(low) or math.isnan(high) else f"{low:.4g}..{high:.4g}"


def decision_lines(comparison: Comparison) -> list[str]:
    """How the points were judged: the thresholds, each method with how many points it judged, and why
    points fell back to the band rule."""
    rule, t = comparison.rule, comparison.table
    ratio = "baseline/new" if comparison.metric in HIGHER_IS_BETTER else "new/baseline"
    unit = unit_of(comparison.metric)
    floor = f" AND worse by more than {rule.min_difference:g} {unit}" if rule.min_difference else ""
    tested, banded = t[t["method"] == RANK_TEST], t[t["method"] == BAND_RULE]
    lines = [f"decision: a point regresses when {ratio} > 1 + {100 * rule.threshold:g}% (--max-regression){floor} "
             "AND its test says so:",
             f"  {RANK_TEST} ({len(tested)} points): one-sided Mann-Whitney U on both sides' repetition times "
             f"(time_ms_samples), p < alpha/points = {rule.alpha:g}/{rule.points} = {rule.point_alpha:.2g} "
             "(Bonferroni)"]
    if len(banded):
        lines.append(f"  FALLBACK {BAND_RULE} for {len(banded)} points (without repetition times on a side: older "
                     "records): the p20..p80 bands must not overlap; the bands of a few repetitions do not measure "
                     "the noise: record more repetitions with their times")
    few = t[t["method"] == TOO_FEW]
    if len(few):
        new_n, base_n = int(few["new_n"].iloc[0]), int(few["baseline_n"].iloc[0])
        lines.append(f"  {TOO_FEW} ({len(few)} points): {new_n} and {base_n} repetition times cannot reach it "
                     f"(p >= {smallest_p(new_n, base_n):.2g}): beyond the threshold is {UNDECIDED}, never a "
                     "regression; record more repetitions")
    unspread = t[t["method"] == NO_SPREAD]
    if len(unspread):
        lines.append(f"  {NO_SPREAD} ({len(unspread)} points): {comparison.metric} has no noise band or repetition "
                     f"times here: beyond the threshold is {UNDECIDED}, never a regression")
    exact = t[t["method"] == EXACT]
    if len(exact):
        lines.append(f"  {EXACT} ({len(exact)} points): {comparison.metric} is computed by the cost model, not "
                     "measured: beyond the threshold is a change")
    if rule.scale != 1.0:
        lines.append(f"  machine factor: the baseline's times x {rule.scale:.3g} before the test and the ratio")
    if comparison.ignored_options:
        lines.append(f"  configuration differences ignored: {', '.join(comparison.ignored_options)}")
    return lines


def render(comparison: Comparison, baseline: Side, new: Side) -> str:
    """The printed report: how points are judged, the table with both bands and each point's statistic,
    what was not compared, then one line per regression, error and improvement, and the counts."""
    unit = unit_of(comparison.metric)
    t = comparison.table
    shown = pd.DataFrame({
        "point": _short_names(t["name"]),
        f"baseline ({unit})": t["baseline"].map("{:.4g}".format),
        "band": [_band(lo, hi) for lo, hi in zip(t["baseline_low"], t["baseline_high"])],
        "n": t["baseline_n"].map(lambda n: n or "-"),
        f"new ({unit})": t["new"].map("{:.4g}".format),
        "new band": [_band(lo, hi) for lo, hi in zip(t["new_low"], t["new_high"])],
        "new n": t["new_n"].map(lambda n: n or "-"),
        "new/baseline": t["ratio"].map("{:.3f}".format),
        "test": [f"{m} {s}".strip() for m, s in zip(t["method"], t["statistic"])],
        "verdict": t["verdict"].map(lambda v: v.split(":")[0] if v.startswith("invalid") else v),  # reason below
    })
    direction = "higher" if comparison.metric in HIGHER_IS_BETTER else "lower"
    lines = [
        f"compare {comparison.metric} ({direction} is better): BASELINE {baseline.source} vs NEW {new.source}",
        f"hardware: {baseline.hardware} vs {new.hardware}; noise band: {baseline.band} / {new.band}",
        *decision_lines(comparison), "", shown.to_string(index=False), "",
    ]
    sections = (("skipped (not a record of any point)", comparison.skipped),
                ("duplicate", comparison.duplicates), ("NOT COMPARABLE", comparison.not_comparable),
                ("only in BASELINE", comparison.baseline_only), ("not measured in NEW", comparison.not_measured),
                ("only in NEW", comparison.new_only))
    for title, entries in sections:
        if entries:
            lines.append(f"{title} ({len(entries)}): " + "; ".join(entries))
    for row in comparison.improvements.itertuples(index=False):
        lines.append(f"IMPROVEMENT: {row.name}: {row.ratio:.3f}x ({row.method} {row.statistic})")
    for row in comparison.errors.itertuples(index=False):
        lines.append(f"INVALID: {row.name}: {row.verdict}")
    for row in comparison.regressions.itertuples(index=False):
        if row.verdict == REGRESSION:
            lines.append(f"REGRESSION: {row.name}: {row.ratio:.3f}x ({row.method} {row.statistic}; bands "
                         f"{_band(row.baseline_low, row.baseline_high)} vs {_band(row.new_low, row.new_high)} {unit})")
        else:
            lines.append(f"REGRESSION: {row.name}: {row.verdict} (measured in the baseline)")
    lines.append(f"{len(t)} compared, {len(comparison.regressions)} regressed, {len(comparison.errors)} invalid, "
                 f"{len(comparison.improvements)} improved, {int((t['verdict'] == UNDECIDED).sum())} undecided, "
                 f"{len(comparison.not_comparable)} not comparable, "
                 f"{len(comparison.missing)} missing, {len(comparison.skipped)} lines skipped")
    return "\n".join(lines)


def benchmark_action_json(comparison: Comparison) -> list[dict]:
    """github-action-benchmark's custom format: one ``{name, unit, value, range, extra}`` per compared
    point with a finite new value (``range``: the new band; ``extra``: baseline, ratio, test, verdict)."""
    unit = unit_of(comparison.metric)
    entries = []
    for row in comparison.table.itertuples(index=False):
        if not math.isfinite(row.new):
            continue
        entries.append({
            "name": f"{comparison.metric} {row.name}", "unit": unit, "value": float(row.new),
            "range": f"{row.new_low:.6g}..{row.new_high:.6g}",
            "extra": f"baseline {row.baseline:.6g} {unit}; new/baseline {row.ratio:.4f}; "
                     f"{row.method} {row.statistic}; {row.verdict}",
        })
    return entries
