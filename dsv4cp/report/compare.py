"""Baseline vs new: match points, ratio per point with its noise band, regressions and improvements.

Inputs (one per side): a run directory or ``.jsonl`` of records (read by ``load_runs``; points matched
by ``point_id``, i.e. by all their axes), or a pytest-benchmark JSON file (matched by the test's
``fullname``). A pytest-benchmark point's value and band are the project's own timer when the bench
harness stored it (``extra_info`` ``median_ms`` with ``p20_ms``..``p80_ms``), else pytest-benchmark's
``stats``: ``median`` with the interquartile band ``q1``..``q3``.

Verdict per matched point, with ``cost`` = new / baseline (baseline / new for a higher-is-better
metric, so cost > 1 is always worse):

* ``regression``: cost > 1 + threshold AND the noise bands do not overlap (new entirely worse);
* ``improvement``: cost < 1 - threshold AND the bands do not overlap (new entirely better);
* ``within noise``: beyond the threshold but the bands overlap; ``same`` otherwise;
* ``failed: <status>``: measured in the baseline, not ``ok`` in the new run (counts as a regression).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dsv4cp.records import AXES, METRICS, STATUS_OK
from dsv4cp.report.load import load_runs


class UnusableInputError(ValueError):
    """The inputs cannot be compared (no matched point, other hardware, missing metric)."""


TIME_BANDS: dict[str, tuple[str, str]] = {"time_ms_median": ("time_ms_p20", "time_ms_p80")}
"""Metrics whose records carry their own noise band."""

INVERSE_OF_TIME: tuple[str, ...] = ("tokens_per_s", "tflops_per_gpu", "mfu")
"""Rates proportional to 1 / time: their band is the time band inverted."""

HIGHER_IS_BETTER: frozenset[str] = frozenset({*INVERSE_OF_TIME, "overlap_ratio"})

UNITS: dict[str, str] = {"tokens_per_s": "tokens/s", "tflops_per_gpu": "TFLOP/s", "mfu": "fraction",
                         "model_flops": "FLOP", "overlap_ratio": "fraction", "measured_over_bound": "x",
                         "imbalance_max_over_mean": "x"}

BENCH_METRICS: dict[str, str] = {"time_ms_median": "median", "time_ms_mean": "mean", "time_ms_min": "min"}
"""Metrics of a pytest-benchmark JSON, by the ``stats`` field they read (seconds there, ms here)."""

SCALAR_METRICS: tuple[str, ...] = tuple(m for m in METRICS if m not in
                                        ("rank_time_ms_median", "peak_allocated_bytes", "device_used_bytes", "phases"))


def unit_of(metric: str) -> str:
    if metric.endswith("_ms") or metric.startswith("time_ms"):
        return "ms"
    return UNITS.get(metric, "")


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
class Side:
    """One side's comparable points: index ``key``; columns ``name``, ``status``, ``value``, ``low``, ``high``."""

    source: str
    kind: str
    """``"run"`` or ``"pytest-benchmark"``."""
    hardware: str
    points: pd.DataFrame
    band: str
    """How the noise band was obtained, for the printed table."""


def _is_bench_json(path: Path) -> bool:
    return path.is_file() and path.suffix == ".json"


def _run_name(row: pd.Series) -> str:
    """A stable, complete point name (every axis with a value), for the JSON output and messages."""
    return " ".join(f"{a}={row[a]}" for a in AXES if row[a] is not None and not pd.isna(row[a]))


def _run_side(path: Path, metric: str) -> Side:
    if metric not in SCALAR_METRICS:
        raise UnusableInputError(f"--metric: {metric!r} is not a scalar record metric; choose one of {SCALAR_METRICS}")
    df = load_runs([path]).drop_duplicates("point_id", keep="last")  # a re-measured point: its latest record
    value = pd.to_numeric(df[metric], errors="coerce")
    if metric in TIME_BANDS:
        low_col, high_col = TIME_BANDS[metric]
        low, high, band = (pd.to_numeric(df[low_col], errors="coerce"),
                           pd.to_numeric(df[high_col], errors="coerce"), "p20..p80 of the record")
    elif metric in INVERSE_OF_TIME:  # rate = k / time: the time band maps onto the rate
        median = pd.to_numeric(df["time_ms_median"], errors="coerce")
        low = value * median / pd.to_numeric(df["time_ms_p80"], errors="coerce")
        high = value * median / pd.to_numeric(df["time_ms_p20"], errors="coerce")
        band = "p20..p80 of the time, as a rate"
    else:
        low, high, band = value, value, "none (the metric has no spread)"
    points = pd.DataFrame({"name": df.apply(_run_name, axis=1), "status": df["status"],
                           "value": value, "low": low.fillna(value), "high": high.fillna(value)})
    points.index = pd.Index(df["point_id"], name="key")
    machines = sorted({str(m) for m in df["machine"] if m is not None}) or ["unknown"]
    return Side(str(path), "run", ", ".join(machines), points, band)


def _bench_side(path: Path, metric: str) -> Side:
    if metric not in BENCH_METRICS:
        raise UnusableInputError(f"--metric: {metric!r} is not available in pytest-benchmark JSON {path}; "
                                 f"choose one of {tuple(BENCH_METRICS)}")
    rows, own_timer = [], 0
    try:
        data = json.loads(path.read_text())
        benchmarks = data["benchmarks"]
        for bench in benchmarks:
            extra = bench.get("extra_info") or {}
            if metric == "time_ms_median" and {"median_ms", "p20_ms", "p80_ms"} <= set(extra):
                own_timer += 1
                value, low, high = extra["median_ms"], extra["p20_ms"], extra["p80_ms"]
            else:
                stats = bench["stats"]
                value = stats[BENCH_METRICS[metric]] * 1e3
                low, high = stats["q1"] * 1e3, stats["q3"] * 1e3
            rows.append({"key": bench["fullname"], "name": bench["fullname"], "status": STATUS_OK,
                         "value": float(value), "low": float(low), "high": float(high)})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise UnusableInputError(f"path: {path} is not a pytest-benchmark JSON file "
                                 f"({type(err).__name__}: {err})") from None
    if own_timer == len(rows):
        band = "p20..p80 of the bench harness's timer (extra_info)"
    elif own_timer == 0:
        band = "q1..q3 of pytest-benchmark's stats"
    else:
        band = "p20..p80 (extra_info) where stored, else q1..q3 (stats)"
    devices = sorted({str((b.get("extra_info") or {}).get("device")) for b in benchmarks
                      if (b.get("extra_info") or {}).get("device")})
    cpu = (data.get("machine_info") or {}).get("cpu", {}).get("brand_raw", "unknown cpu")
    hardware = ", ".join(devices) if devices else cpu
    points = pd.DataFrame(rows, columns=["key", "name", "status", "value", "low", "high"]).set_index("key")
    return Side(str(path), "pytest-benchmark", hardware, points[~points.index.duplicated(keep="last")], band)


def load_side(path: str | Path, metric: str) -> Side:
    """One side from a run directory, a ``.jsonl`` of records, or a pytest-benchmark ``.json``."""
    path = Path(path)
    if not path.exists():
        raise UnusableInputError(f"path: {path} does not exist")
    try:
        return _bench_side(path, metric) if _is_bench_json(path) else _run_side(path, metric)
    except UnusableInputError:
        raise
    except ValueError as err:  # the loader's own message names the path and the problem
        raise UnusableInputError(str(err)) from None


@dataclass(frozen=True)
class Comparison:
    """The matched points (``table``) and what each side has alone."""

    metric: str
    threshold: float
    table: pd.DataFrame
    """Columns: name, baseline, baseline_low, baseline_high, new, new_low, new_high, ratio, verdict."""
    baseline_only: list[str] = field(default_factory=list)
    new_only: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> pd.DataFrame:
        verdicts = self.table["verdict"]
        return self.table[(verdicts == "regression") | verdicts.str.startswith("failed")]

    @property
    def improvements(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] == "improvement"]


def _verdict(row: pd.Series, threshold: float, higher_is_better: bool) -> str:
    if row["new_status"] != STATUS_OK:
        return f"failed: {row['new_status']}"
    if math.isnan(row["baseline"]) or math.isnan(row["new"]):
        return "no value"
    if higher_is_better:
        cost = row["baseline"] / row["new"]
        worse_apart, better_apart = row["new_high"] < row["baseline_low"], row["new_low"] > row["baseline_high"]
    else:
        cost = row["new"] / row["baseline"]
        worse_apart, better_apart = row["new_low"] > row["baseline_high"], row["new_high"] < row["baseline_low"]
    if cost > 1.0 + threshold:
        return "regression" if worse_apart else "within noise"
    if cost < 1.0 - threshold:
        return "improvement" if better_apart else "within noise"
    return "same"


def compare(baseline: Side, new: Side, metric: str, *, threshold: float,
            allow_different_hardware: bool = False) -> Comparison:
    """Match the sides' points and give each a verdict (see the module docstring).

    Raises :class:`UnusableInputError` for sides of different kinds, different hardware (unless
    allowed), no matched point, or no value of ``metric`` on any matched point.
    """
    if threshold < 0:
        raise ValueError(f"threshold: must be >= 0, got {threshold}")
    if baseline.kind != new.kind:
        raise UnusableInputError(f"inputs: BASELINE is a {baseline.kind} and NEW a {new.kind}: compare like with like")
    if baseline.hardware != new.hardware and not allow_different_hardware:
        raise UnusableInputError(f"hardware: BASELINE ran on {baseline.hardware!r}, NEW on {new.hardware!r}; "
                                 "pass --allow-different-hardware to compare anyway")
    base_ok = baseline.points[baseline.points["status"] == STATUS_OK]
    keys = [k for k in base_ok.index if k in new.points.index]
    if not keys:
        raise UnusableInputError(
            f"points: no point of BASELINE ({len(base_ok)} measured) matches one of NEW ({len(new.points)}) "
            f"by its axes{' (benchmark names)' if new.kind == 'pytest-benchmark' else ''}")
    b, n = base_ok.loc[keys], new.points.loc[keys]
    table = pd.DataFrame({
        "name": b["name"], "baseline": b["value"], "baseline_low": b["low"], "baseline_high": b["high"],
        "new": n["value"].where(n["status"] == STATUS_OK), "new_low": n["low"], "new_high": n["high"],
        "new_status": n["status"],
    })
    if table["baseline"].isna().all() or table["new"].isna().all():
        side = "BASELINE" if table["baseline"].isna().all() else "NEW"
        raise UnusableInputError(f"--metric: {metric} was not measured on any matched point of {side}")
    table["ratio"] = table["new"] / table["baseline"]
    higher = metric in HIGHER_IS_BETTER
    table["verdict"] = table.apply(_verdict, axis=1, threshold=threshold, higher_is_better=higher)
    return Comparison(
        metric=metric, threshold=threshold, table=table.drop(columns="new_status").reset_index(),
        baseline_only=[baseline.points.loc[k, "name"] for k in baseline.points.index if k not in new.points.index],
        new_only=[new.points.loc[k, "name"] for k in new.points.index if k not in baseline.points.index],
    )


def _short_names(names: pd.Series) -> pd.Series:
    """Names without the ``axis=value`` words every matched point shares (the table's varying part)."""
    words = [name.split(" ") for name in names]
    shared = set.intersection(*map(set, words)) if words else set()
    return pd.Series([" ".join(w for w in ws if w not in shared) or " ".join(ws) for ws in words], index=names.index)


def render(comparison: Comparison, baseline: Side, new: Side) -> str:
    """The printed report: the ratio table with both bands, then the verdict lines."""
    unit = unit_of(comparison.metric)
    t = comparison.table
    shown = pd.DataFrame({
        "point": _short_names(t["name"]),
        f"baseline ({unit})": t["baseline"].map("{:.4g}".format),
        "baseline band": [f"{lo:.4g}..{hi:.4g}" for lo, hi in zip(t["baseline_low"], t["baseline_high"])],
        f"new ({unit})": t["new"].map("{:.4g}".format),
        "new band": [f"{lo:.4g}..{hi:.4g}" for lo, hi in zip(t["new_low"], t["new_high"])],
        "new/baseline": t["ratio"].map("{:.3f}".format),
        "verdict": t["verdict"],
    })
    direction = "higher" if comparison.metric in HIGHER_IS_BETTER else "lower"
    lines = [
        f"compare {comparison.metric} ({direction} is better): BASELINE {baseline.source} vs NEW {new.source}",
        f"hardware: {baseline.hardware} vs {new.hardware}; noise band: {baseline.band} / {new.band}",
        f"threshold: {100 * comparison.threshold:g}% beyond the baseline AND outside both bands",
        "", shown.to_string(index=False), "",
    ]
    if comparison.baseline_only:
        lines.append(f"only in BASELINE ({len(comparison.baseline_only)}): " + "; ".join(comparison.baseline_only))
    if comparison.new_only:
        lines.append(f"only in NEW ({len(comparison.new_only)}): " + "; ".join(comparison.new_only))
    for row in comparison.improvements.itertuples(index=False):
        lines.append(f"IMPROVEMENT: {row.name}: {row.ratio:.3f}x")
    for row in comparison.regressions.itertuples(index=False):
        if row.verdict == "regression":
            lines.append(f"REGRESSION: {row.name}: {row.ratio:.3f}x (bands {row.baseline_low:.4g}.."
                         f"{row.baseline_high:.4g} vs {row.new_low:.4g}..{row.new_high:.4g} {unit})")
        else:
            lines.append(f"REGRESSION: {row.name}: {row.verdict} (measured in the baseline)")
    lines.append(f"{len(t)} matched, {len(comparison.regressions)} regressed, {len(comparison.improvements)} improved")
    return "\n".join(lines)


def benchmark_action_json(comparison: Comparison) -> list[dict]:
    """github-action-benchmark's custom format: one ``{name, unit, value, range, extra}`` per matched
    point with a new value (``range``: the new band; ``extra``: baseline, ratio, verdict)."""
    unit = unit_of(comparison.metric)
    entries = []
    for row in comparison.table.itertuples(index=False):
        if math.isnan(row.new):
            continue
        entries.append({
            "name": f"{comparison.metric} {row.name}", "unit": unit, "value": float(row.new),
            "range": f"{row.new_low:.6g}..{row.new_high:.6g}",
            "extra": f"baseline {row.baseline:.6g} {unit}; new/baseline {row.ratio:.4f}; {row.verdict}",
        })
    return entries
