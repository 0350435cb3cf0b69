"""CI performance gate: the smoke sweep and the CPU benchmarks against the committed CPU baselines.

    python .ci/gate.py                       # what .ci/run calls, from the repository root
    python .ci/gate.py --skip-bench          # the sweep half only
    python .ci/gate.py --refresh             # re-record results/baselines/cpu-ci/ the same way

Steps (a step's failure fails the gate; the first line of the log says which):

1. ``dsv4cp sweep`` of ``sweeps/smoke.yaml`` with ``run.reps`` set to :data:`REPS` (a copy of the spec
   in the work directory) must exit 0 (or 1, a failed point, named by the next check), record every point
   of the baseline, and record no point as ``error: ...`` or ``oom`` and no invalid line (a broken pipeline);
2. ``pytest bench -m "not gpu" --benchmark-json WORK/bench.json`` must pass (the CPU sizes run a few
   rounds each: the quick mode of the benchmarks);
3. each is judged against its baseline by ``dsv4cp compare``'s own rule (:mod:`dsv4cp.report.compare`),
   with the gate's thresholds passed in, so the printed verdicts are exactly what the gate acts on.

A matched point REGRESSES only when all hold (loose on purpose: a shared 2-core machine swings tiny CPU
timings by several x, and its load changes between the baseline's recording and CI):

* new / (baseline x machine factor) > 1 + ``--max-regression`` (default ``200%``: more than 3x slower),
  the machine factor being the median new/baseline ratio of the whole run (at least 1): how much slower
  the machine runs now; load slows every point, a regressed code path only its points;
* the test of ``dsv4cp compare`` says so: with repetition times on both sides (a baseline recorded by
  ``--refresh``), the one-sided Mann-Whitney U test at ``--alpha`` / points; without them (an older
  baseline), the band rule: the noise bands apart. The printed table says which rule judged each point;
* it is slower by more than ``--min-slowdown-ms`` (default 50 ms: stalls of a loaded machine cost
  tens of ms, whatever the point's size);
* and all of the above AGAIN when the regressed points are measured once more (the sweep resumes a copy
  of the run without them; the benchmarks rerun by node id), with the first run's machine factor.

A run whose machine factor itself exceeds ``1 + --max-regression`` fails (everything slowed down, or the
machine is too loaded to measure). A point that failed in the new run (status not ``ok``), or holds a
value that cannot be a measurement, fails at once; so does a point of the baseline that is missing or
not comparable (its kernel configuration differs; a configuration column the baseline does not record
at all is not compared, and the gate says so). Different machine labels are reported but allowed (CI
machines differ from the one that recorded the baseline; the gate is coarse).
Exit status: 0 pass, 1 regression or broken pipeline, 2 unusable input (missing baseline, nothing
matched).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from dsv4cp.records import CONFIG_FIELDS, META_FILE, RECORDS_FILE, STATUS_OK, append_record, read_records
from dsv4cp.report.compare import (
    DEFAULT_ALPHA,
    Comparison,
    Side,
    UnusableInputError,
    compare,
    load_side,
    parse_threshold,
    render,
)

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "results" / "baselines" / "cpu-ci"
METRIC = "time_ms_median"

REPS = 20
"""Timed repetitions of every smoke point, in the gate and in ``--refresh`` (the spec's own 3 only smoke
test the pipeline). Why 20: a point's U test must be able to reach alpha / points = 0.01 / 30 = 3.3e-4
while a few of its repetitions are stalls of the loaded machine. 3 and 3 samples cannot go below
p = 0.05; 10 and 10 reach 1e-5 only when every sample is apart (one baseline stall above all new
samples leaves p = 7.5e-4: missed, so 10 catch a 1.3x slowdown in only ~40% of synthetic runs with
10% stalls); 20 and 20 catch it in ~99% of runs under 5% jitter and 5% stalls up to 2.5x (93% with
10% stalls up to 3x) while honest reruns of 30 points alarm in under 1% of runs
(tests/report/test_compare_decision.py). The 17 extra steps of the tiny CPU points cost seconds."""

SweepRunner = Callable[[Path, Path, bool], None]
"""``(spec, out, resume)``: measure the spec's points missing from ``out`` (all of them unless resuming)."""
BenchRunner = Callable[[Path, "list[str] | None"], None]
"""``(json_out, node_ids)``: run the CPU benchmarks (only ``node_ids`` when given) into ``json_out``."""


class GateFailure(Exception):
    """The gate fails: a regression or a broken pipeline (exit 1)."""


@dataclass(frozen=True)
class Thresholds:
    max_regression: float
    """Allowed relative slowdown (2.0: fail beyond 3x)."""
    min_slowdown_ms: float
    """A point must also be slower by more than this, in ms."""
    alpha: float = DEFAULT_ALPHA
    """False-alarm level of the rank test over all points of one comparison."""


def _one_thread_env() -> dict[str, str]:
    """The environment of every measurement: ONE intra-op thread. On a loaded 2-core machine torch's
    default two OpenMP threads wait on each other and a tiny op's time swings 10x (the sweep's spawned
    ranks already run one thread each)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def gate_spec(spec: Path, reps: int, folder: Path) -> Path:
    """A copy of ``spec`` in ``folder`` (same file name, so the run directory's name is unchanged) with
    ``run.reps`` set to ``reps``; point ids do not depend on the run options, so its points match the
    baseline's."""
    data = yaml.safe_load(spec.read_text())
    data["run"] = {**(data.get("run") or {}), "reps": reps}
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / spec.name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def run_sweep_cli(spec: Path, out: Path, resume: bool) -> None:
    command = [sys.executable, "-m", "dsv4cp", "sweep", str(spec), "--out", str(out), "--progress", "off"]
    done = subprocess.run(command + (["--resume"] if resume else []), cwd=ROOT, env=_one_thread_env())
    if done.returncode not in (0, 1):  # 1: a point failed, which the records check then names
        raise GateFailure(f"sweep: `{' '.join(command)}` exited with {done.returncode}")


def run_bench_cli(json_out: Path, node_ids: list[str] | None) -> None:
    command = [sys.executable, "-m", "pytest", *(node_ids or ["bench"]), "-m", "not gpu", "-q",
               "-p", "no:cacheprovider", "--benchmark-json", str(json_out), "--benchmark-columns", "median,rounds"]
    done = subprocess.run(command, cwd=ROOT, env=_one_thread_env())
    if done.returncode != 0:
        raise GateFailure(f"bench: `{' '.join(command)}` exited with {done.returncode}")


def machine_factor(comparison: Comparison) -> float:
    """How much slower this machine runs right now than when the baseline was recorded: the median
    new/baseline ratio over the compared points, never below 1 (a faster machine makes no rule stricter).
    A loaded CI machine slows every point alike; a regressed code path slows some points only."""
    ratios = comparison.table["ratio"].dropna()
    return max(1.0, float(ratios.median())) if len(ratios) else 1.0


def _unrecorded_config(baseline: Side) -> list[str]:
    """The configuration columns no point of ``baseline`` records (a baseline from before they existed):
    not compared, since "unknown" against a recorded value would make every point incomparable."""
    configs = baseline.points["config"]
    return [name for name in CONFIG_FIELDS if all(config.get(name) is None for config in configs)]


def _compare(baseline: Path, new: Path, thresholds: Thresholds, what: str, *, keys: list[str] | None = None,
             factor: float | None = None) -> tuple[Comparison, float]:
    """Judge ``new`` against ``baseline`` with the gate's thresholds and print the verdicts. ``factor``:
    the machine factor to scale the baseline by (None: this comparison's own, checked to be plausible);
    ``keys``: judge only these points (a rerun)."""
    base_side, new_side = load_side(baseline, METRIC), load_side(new, METRIC)
    if keys is not None:  # only the points measured again, on both sides
        base_side, new_side = (dataclasses.replace(side, points=side.points.loc[
            side.points.index.intersection(pd.Index(keys))]) for side in (base_side, new_side))
    if base_side.hardware != new_side.hardware:
        print(f"gate: note: baseline ran on {base_side.hardware!r}, this run on {new_side.hardware!r}")
    ignored = _unrecorded_config(base_side)
    if ignored:
        print(f"gate: note: the baseline records no {', '.join(ignored)}: points are matched by their axes only")
    options = dict(threshold=thresholds.max_regression, alpha=thresholds.alpha, ignore_options=ignored,
                   allow_different_hardware=True)
    if factor is None:
        factor = machine_factor(compare(base_side, new_side, METRIC, **options))
        _check_machine_factor(factor, thresholds, what)
    comparison = compare(base_side, new_side, METRIC, scale=factor, min_difference=thresholds.min_slowdown_ms,
                         **options)
    print(render(comparison, base_side, new_side))
    return comparison, factor


def _check_machine_factor(factor: float, thresholds: Thresholds, what: str) -> None:
    print(f"gate: {what}: this run is {factor:.2f}x the baseline's time at the median point")
    if factor > 1 + thresholds.max_regression:
        raise GateFailure(f"{what}: the median point is {factor:.2f}x slower than the baseline: everything "
                          "regressed, or this machine is too loaded to measure")


def _check_sweep_records(run_dir: Path) -> None:
    problems: list = []
    records = read_records(run_dir / RECORDS_FILE, problems)
    if problems:
        raise GateFailure("sweep: invalid record lines:\n  " + "\n  ".join(map(str, problems)))
    if not records:
        raise GateFailure(f"sweep: {run_dir} holds no records")
    broken = [f"{r['point_id']}: {r['status']}" for r in records
              if r["status"] != STATUS_OK and not r["status"].startswith("skipped: ")]
    if broken:
        raise GateFailure("sweep: points did not run:\n  " + "\n  ".join(broken))


def _fail_on_broken(comparison: Comparison, what: str) -> None:
    """Fail on what no rerun can mend: invalid values, lines that are no record, points of the
    baseline that are missing or not comparable."""
    if len(comparison.errors) or comparison.skipped:
        raise GateFailure(f"{what}: {len(comparison.errors)} points hold invalid values, {len(comparison.skipped)} "
                          "lines are no record (the INVALID and skipped lines above)")
    if comparison.missing:
        raise GateFailure(f"{what}: points of the baseline missing from the new run: " + "; ".join(comparison.missing))
    if comparison.not_comparable:
        raise GateFailure(f"{what}: points of the baseline not comparable: " + "; ".join(comparison.not_comparable))


def _regressed(baseline: Path, new: Path, thresholds: Thresholds, what: str) -> tuple[list[str], float]:
    """First verdict on ``new`` against ``baseline``: fail on a broken run or an implausible machine
    factor, else return the regressed keys and the machine factor their re-measurement is judged by."""
    comparison, factor = _compare(baseline, new, thresholds, what)
    _fail_on_broken(comparison, what)
    return comparison.regressions["key"].tolist(), factor


def _regressed_again(baseline: Path, rerun: Path, thresholds: Thresholds, what: str, keys: list[str],
                     factor: float) -> None:
    comparison, _ = _compare(baseline, rerun, thresholds, what, keys=keys, factor=factor)
    _fail_on_broken(comparison, what)
    again = comparison.regressions
    if len(again):
        noun = "benchmarks" if what == "bench" else "points"
        raise GateFailure(f"{what}: {len(again)} {noun} regressed twice (the REGRESSION lines above)")


def gate_sweep(spec: Path, baseline: Path, work: Path, thresholds: Thresholds,
               run_sweep: SweepRunner = run_sweep_cli, reps: int = REPS) -> None:
    """Run the sweep (``reps`` repetitions per point) into ``work/<spec stem>``, compare with
    ``baseline``, re-measure regressed points once."""
    spec = gate_spec(spec, reps, work / "specs")
    run_dir = work / spec.stem
    run_sweep(spec, run_dir, False)
    _check_sweep_records(run_dir)
    suspects, factor = _regressed(baseline, run_dir, thresholds, "sweep")
    if not suspects:
        return
    print(f"gate: sweep: {len(suspects)} points regressed; measuring them once more")
    rerun = work / f"{spec.stem}-rerun"
    rerun.mkdir(parents=True)
    shutil.copy(run_dir / META_FILE, rerun / META_FILE)
    for record in read_records(run_dir / RECORDS_FILE):
        if record["point_id"] not in suspects:
            append_record(rerun / RECORDS_FILE, record)
    run_sweep(spec, rerun, True)
    _check_sweep_records(rerun)
    _regressed_again(baseline, rerun, thresholds, "sweep", suspects, factor)


def gate_bench(baseline: Path, work: Path, thresholds: Thresholds, run_bench: BenchRunner = run_bench_cli) -> None:
    """Run the CPU benchmarks into ``work/bench.json``, compare, rerun regressed benchmarks once."""
    work.mkdir(parents=True, exist_ok=True)
    new = work / "bench.json"
    run_bench(new, None)
    suspects, factor = _regressed(baseline, new, thresholds, "bench")
    if not suspects:
        return
    print(f"gate: bench: {len(suspects)} benchmarks regressed; running them once more")
    rerun = work / "bench-rerun.json"
    run_bench(rerun, suspects)
    _regressed_again(baseline, rerun, thresholds, "bench", suspects, factor)


def refresh(spec: Path, sweep_baseline: Path, bench_baseline: Path, skip_sweep: bool, skip_bench: bool,
            run_sweep: SweepRunner = run_sweep_cli, run_bench: BenchRunner = run_bench_cli,
            reps: int = REPS) -> int:
    """Replace the baselines by new runs of exactly what the gate measures (``reps`` repetitions per
    sweep point, every repetition's time recorded)."""
    try:
        if not skip_sweep:
            if sweep_baseline.exists():
                shutil.rmtree(sweep_baseline)
            with tempfile.TemporaryDirectory(prefix="dsv4cp-gate-spec-") as folder:
                run_sweep(gate_spec(spec, reps, Path(folder)), sweep_baseline, False)
            _check_sweep_records(sweep_baseline)
        if not skip_bench:
            bench_baseline.parent.mkdir(parents=True, exist_ok=True)
            run_bench(bench_baseline, None)
    except GateFailure as failure:
        print(f"gate: refresh FAILED: {failure}", file=sys.stderr)
        return 1
    print(f"gate: baselines written: {'' if skip_sweep else sweep_baseline} {'' if skip_bench else bench_baseline}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, default=ROOT / "sweeps" / "smoke.yaml", help="sweep spec to run")
    parser.add_argument("--sweep-baseline", type=Path, default=BASELINES / "smoke", help="baseline run directory")
    parser.add_argument("--bench-baseline", type=Path, default=BASELINES / "bench.json",
                        help="baseline pytest-benchmark JSON")
    parser.add_argument("--max-regression", default="200%", help="allowed slowdown ratio - 1 (default 200%%: 3x)")
    parser.add_argument("--min-slowdown-ms", type=float, default=50.0,
                        help="a regression must also cost more than this many ms (default 50)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help=f"false-alarm level of the rank test over all points (default {DEFAULT_ALPHA})")
    parser.add_argument("--work", type=Path, default=None, help="where the new runs go (default: a temp dir)")
    parser.add_argument("--skip-sweep", action="store_true", help="do not run the sweep half")
    parser.add_argument("--skip-bench", action="store_true", help="do not run the benchmark half")
    parser.add_argument("--refresh", action="store_true",
                        help="re-record the baselines (replacing them) with the gate's own commands, then exit")
    args = parser.parse_args(argv)
    if args.refresh:
        return refresh(args.spec, args.sweep_baseline, args.bench_baseline, args.skip_sweep, args.skip_bench)
    try:
        if not 0 < args.alpha < 1:
            raise ValueError(f"--alpha: must lie in (0, 1), got {args.alpha}")
        thresholds = Thresholds(parse_threshold(args.max_regression), args.min_slowdown_ms, args.alpha)
        if thresholds.min_slowdown_ms < 0:
            raise ValueError(f"--min-slowdown-ms: must be >= 0, got {thresholds.min_slowdown_ms}")
        for flag, path in (("--sweep-baseline", args.sweep_baseline), ("--bench-baseline", args.bench_baseline)):
            if not path.exists():
                raise ValueError(f"{flag}: {path} does not exist")
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dsv4cp-gate-"))
        if work.exists() and any(work.iterdir()):
            raise ValueError(f"--work: {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
        print(f"gate: new runs in {work}; fail beyond {1 + thresholds.max_regression:g}x of the machine factor, "
              f"significant (alpha {thresholds.alpha:g}) and {thresholds.min_slowdown_ms:g} ms slower, twice")
        if not args.skip_sweep:
            gate_sweep(args.spec, args.sweep_baseline, work, thresholds)
        if not args.skip_bench:
            gate_bench(args.bench_baseline, work, thresholds)
    except GateFailure as failure:
        print(f"gate: FAILED: {failure}", file=sys.stderr)
        return 1
    except (UnusableInputError, ValueError) as err:
        print(f"gate: unusable input: {err}", file=sys.stderr)
        return 2
    print("gate: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
