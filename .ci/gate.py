"""CI performance gate: the smoke sweep and the CPU benchmarks against the committed CPU baselines.

    python .ci/gate.py                       # what .ci/run calls, from the repository root
    python .ci/gate.py --skip-bench          # the sweep half only
    python .ci/gate.py --refresh             # re-record results/baselines/cpu-ci/ the same way

Steps (a step's failure fails the gate; the first line of the log says which):

1. ``dsv4cp sweep sweeps/smoke.yaml --out WORK/smoke`` must exit 0 (or 1, a failed point, named by the
   next check), record every point of the baseline, and record no point as ``error: ...`` or ``oom`` (a
   broken pipeline);
2. ``pytest bench -m "not gpu" --benchmark-json WORK/bench.json`` must pass (the CPU sizes run a few
   rounds each: the quick mode of the benchmarks);
3. each is compared with its baseline by ``dsv4cp compare``'s own code (:mod:`dsv4cp.report.compare`:
   points matched by their axes / benchmark names, median time, p20..p80 noise bands).

Thresholds, loose on purpose (a shared 2-core machine swings tiny CPU timings by several x, and its
load changes between the baseline's recording and CI): a matched point REGRESSES only when all hold:

* new / baseline > 1 + ``--max-regression`` (default ``200%``: more than 3x slower) AFTER dividing by
  the machine factor: the median new/baseline ratio of the whole run (at least 1), i.e. how much slower
  the machine runs now; load slows every point, a regressed code path only its points;
* its noise band lies entirely above the baseline's (``dsv4cp compare``'s verdict ``regression``);
* it is slower by more than ``--min-slowdown-ms`` (default 50 ms: stalls of a loaded machine cost
  tens of ms, whatever the point's size);
* and all of the above AGAIN when the regressed points are measured once more (the sweep resumes a copy
  of the run without them; the benchmarks rerun by node id), with the first run's machine factor.

A run whose machine factor itself exceeds ``1 + --max-regression`` fails (everything slowed down, or the
machine is too loaded to measure). A point that failed in the new run (status not ``ok``) fails at once.
Different machine labels are reported but allowed (CI machines differ from the one that recorded the
baseline; the gate is coarse).
Exit status: 0 pass, 1 regression or broken pipeline, 2 unusable input (missing baseline, nothing
matched).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dsv4cp.records import META_FILE, RECORDS_FILE, STATUS_OK, read_records
from dsv4cp.report.compare import Comparison, UnusableInputError, compare, load_side, parse_threshold, render

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "results" / "baselines" / "cpu-ci"
METRIC = "time_ms_median"

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


def _one_thread_env() -> dict[str, str]:
    """The environment of every measurement: ONE intra-op thread. On a loaded 2-core machine torch's
    default two OpenMP threads wait on each other and a tiny op's time swings 10x (the sweep's spawned
    ranks already run one thread each)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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
    new/baseline ratio over the matched points, never below 1 (a faster machine makes no rule stricter).
    A loaded CI machine slows every point alike; a regressed code path slows some points only."""
    ratios = comparison.table["ratio"].dropna()
    return max(1.0, float(ratios.median())) if len(ratios) else 1.0


def regressed_keys(comparison: Comparison, thresholds: Thresholds, factor: float) -> list[str]:
    """Keys (point ids / benchmark names) of the matched points that fail the gate's rules, with
    ``factor`` (:func:`machine_factor` of the full run) discounted from each ratio."""
    table = comparison.table
    failed = table["verdict"].str.startswith("failed")
    slower = ((table["verdict"] == "regression") & (table["ratio"] / factor > 1 + thresholds.max_regression)
              & (table["new"] - table["baseline"] > thresholds.min_slowdown_ms))
    for name, ratio, verdict in table.loc[failed | slower, ["name", "ratio", "verdict"]].itertuples(index=False):
        print(f"gate: regressed: {name}: {verdict}, {ratio:.3f}x ({ratio / factor:.3f}x of the machine factor)")
    return table.loc[failed | slower, "key"].tolist()


def _check_machine_factor(factor: float, thresholds: Thresholds, what: str) -> None:
    print(f"gate: {what}: this run is {factor:.2f}x the baseline's time at the median point")
    if factor > 1 + thresholds.max_regression:
        raise GateFailure(f"{what}: the median point is {factor:.2f}x slower than the baseline: everything "
                          "regressed, or this machine is too loaded to measure (see the table above)")


def _compare(baseline: Path, new: Path, thresholds: Thresholds, keys: list[str] | None = None) -> Comparison:
    base_side, new_side = load_side(baseline, METRIC), load_side(new, METRIC)
    if keys is not None:  # a rerun: judge only the points measured again
        new_side = dataclasses.replace(new_side, points=new_side.points.loc[
            new_side.points.index.intersection(pd.Index(keys))])
    if base_side.hardware != new_side.hardware:
        print(f"gate: note: baseline ran on {base_side.hardware!r}, this run on {new_side.hardware!r}")
    comparison = compare(base_side, new_side, METRIC, threshold=thresholds.max_regression,
                         allow_different_hardware=True)
    print(render(comparison, base_side, new_side))
    return comparison


def _check_sweep_records(run_dir: Path) -> None:
    records = read_records(run_dir / RECORDS_FILE) if (run_dir / RECORDS_FILE).exists() else []
    if not records:
        raise GateFailure(f"sweep: {run_dir} holds no records")
    broken = [f"{r['point_id']}: {r['status']}" for r in records
              if r["status"] != STATUS_OK and not r["status"].startswith("skipped: ")]
    if broken:
        raise GateFailure("sweep: points did not run:\n  " + "\n  ".join(broken))


def _fail_on_missing(comparison: Comparison, what: str) -> None:
    if comparison.baseline_only:
        raise GateFailure(f"{what}: points of the baseline missing from the new run: "
                          + "; ".join(comparison.baseline_only))


def _regressed(baseline: Path, new: Path, thresholds: Thresholds, what: str) -> tuple[list[str], float]:
    """First verdict on ``new`` against ``baseline``: fail on missing points or an implausible machine
    factor, else return the regressed keys and the machine factor their re-measurement is judged by."""
    comparison = _compare(baseline, new, thresholds)
    _fail_on_missing(comparison, what)
    factor = machine_factor(comparison)
    _check_machine_factor(factor, thresholds, what)
    return regressed_keys(comparison, thresholds, factor), factor


def gate_sweep(spec: Path, baseline: Path, work: Path, thresholds: Thresholds,
               run_sweep: SweepRunner = run_sweep_cli) -> None:
    """Run the sweep into ``work/<spec stem>``, compare with ``baseline``, re-measure regressed points once."""
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
    kept = [line for line in (run_dir / RECORDS_FILE).read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line)["point_id"] not in suspects]
    (rerun / RECORDS_FILE).write_text("".join(kept))
    run_sweep(spec, rerun, True)
    _check_sweep_records(rerun)
    again = regressed_keys(_compare(baseline, rerun, thresholds, keys=suspects), thresholds, factor)
    if again:
        raise GateFailure(f"sweep: {len(again)} points regressed twice (the `gate: regressed:` lines above)")


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
    again = regressed_keys(_compare(baseline, rerun, thresholds, keys=suspects), thresholds, factor)
    if again:
        raise GateFailure(f"bench: {len(again)} benchmarks regressed twice (the `gate: regressed:` lines above)")


def refresh(spec: Path, sweep_baseline: Path, bench_baseline: Path, skip_sweep: bool, skip_bench: bool,
            run_sweep: SweepRunner = run_sweep_cli, run_bench: BenchRunner = run_bench_cli) -> int:
    """Replace the baselines by new runs of exactly what the gate measures."""
    try:
        if not skip_sweep:
            if sweep_baseline.exists():
                shutil.rmtree(sweep_baseline)
            run_sweep(spec, sweep_baseline, False)
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
    parser.add_argument("--work", type=Path, default=None, help="where the new runs go (default: a temp dir)")
    parser.add_argument("--skip-sweep", action="store_true", help="do not run the sweep half")
    parser.add_argument("--skip-bench", action="store_true", help="do not run the benchmark half")
    parser.add_argument("--refresh", action="store_true",
                        help="re-record the baselines (replacing them) with the gate's own commands, then exit")
    args = parser.parse_args(argv)
    if args.refresh:
        return refresh(args.spec, args.sweep_baseline, args.bench_baseline, args.skip_sweep, args.skip_bench)
    try:
        thresholds = Thresholds(parse_threshold(args.max_regression), args.min_slowdown_ms)
        if thresholds.min_slowdown_ms < 0:
            raise ValueError(f"--min-slowdown-ms: must be >= 0, got {thresholds.min_slowdown_ms}")
        for flag, path in (("--sweep-baseline", args.sweep_baseline), ("--bench-baseline", args.bench_baseline)):
            if not path.exists():
                raise ValueError(f"{flag}: {path} does not exist")
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dsv4cp-gate-"))
        if work.exists() and any(work.iterdir()):
            raise ValueError(f"--work: {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
        print(f"gate: new runs in {work}; fail beyond {1 + thresholds.max_regression:g}x, outside the noise "
              f"bands and {thresholds.min_slowdown_ms:g} ms slower, twice")
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
