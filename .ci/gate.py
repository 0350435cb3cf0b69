"""CI performance gate: the head measured against a base commit INTERLEAVED in one job (A/B), exact
counters beside the times, and the gate's own false-alarm rate and power measured on every run.

    python .ci/gate.py                                  # what .ci/run calls, from the repository root
    python .ci/gate.py --refresh --reason "why"         # name HEAD as the base of later runs

Steps (a step's failure fails the gate; the log says which):

1. pipeline: ``dsv4cp sweep`` of ``sweeps/smoke.yaml`` (its own repetitions) exits 0 and records every
   point ``ok`` (a broken sweep, trace or report path fails here);
2. base: the commit ``results/baselines/cpu-ci/gate.json`` names (written by ``--refresh``), else the
   merge base with origin/main, else HEAD~1 (the log says which), checked out with ``git worktree add``
   into a temporary directory and imported from there (PYTHONPATH: the same dependencies);
3. workers (``.ci/gate_worker.py``): one long-lived process for the base and three for the head (head,
   head2 and inject) build every case of the spec once (a CP = 2 point as its emulated rank 0: compute
   only) and time single steps in process CPU time on request; the coordinator alternates the processes
   step by step, case by case, so the machine's speed and load cancel, and never lets one process time
   two steps in a row (the second would find its caches warm: an injected side once run in head2's
   process right after head2's own step came out 6-13% FASTER than the head it was slowed against).
   All four run on one core (``--no-pin``: any): on an idle machine a process otherwise keeps a core of
   its own, and two processes of one tree drifted 6% apart (a pair's spread 0.198; pinned: 1% and 0.102);
4. counters, exactly: per case the aten ops dispatched per step (kernel launches), host syncs per step,
   collectives and their bytes per step, and the cost model's FLOPs, HBM bytes and communication bytes;
   base and head must agree, or an entry of ``results/baselines/cpu-ci/accepted.yaml`` (point, counter,
   old, new, reason) accepts the change; and the peak bytes a step holds allocated beyond its start
   (the CPU allocator's events in a profiled step: the same program allocates the same sizes in the same
   order, so this does not drift as the process's RSS does);
5. times: ``--blocks`` blocks of ``--rounds`` rounds; a comparison is one block's samples of two sides
   (``--rounds`` steps each). Block 0 compares base with head: the GATE's verdict. Every block compares
   head with head2: the SELF-COMPARISONS (a false alarm is any point, or the suite, called SLOWER or
   FASTER). The first ``len(levels) x --injections`` blocks also compare head with the inject process
   slowed on purpose (``inject_slowdown``): level L makes the step L slower by a busy loop in its
   sparse_attn phase (its fraction is L / the share of the step that fraction 1 adds, which the inject
   worker measures on itself as it starts), and a DETECTION is that point (or the suite) called SLOWER;
6. confirmation: every point that a comparison's first samples call SLOWER or FASTER is measured again,
   ``--rounds`` fresh pairs after all blocks; the verdict stands only when the confirmation agrees (else
   UNDECIDED). The same rule holds for the gate, the self-comparisons and the injections, so the false
   alarms and detections printed are those of the rule that decides.

Verdict per point (:func:`dsv4cp.report.compare_stats.ab_verdict`): the head/base ratio of the
block's step pairs (the two sides' steps of one round, taken next to each other) is the
Hodges-Lehmann estimate with its signed-rank interval at confidence 1 - ``--alpha`` / cases
(Bonferroni over the cases); SLOWER / FASTER when the interval excludes 1 and the ratio is beyond
``--threshold`` (default 10%); UNDECIDED when beyond it but the interval holds 1 (reported, not failed);
SAME otherwise. The SUITE verdict pools every case's pairs of the comparison into one interval at
confidence 99% (threshold ``--suite-threshold``, default 5%): a slowdown that every point shares (one
phase slower everywhere) is resolved well below what one point resolves. The gate fails on a SLOWER
point, a SLOWER suite, an unaccepted counter change or a broken pipeline.
Exit status: 0 pass, 1 fail, 2 unusable input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dsv4cp.records import RECORDS_FILE, STATUS_OK, read_records
from dsv4cp.report.compare import parse_threshold
from dsv4cp.report.compare_stats import AB_SAME, AB_UNDECIDED, FASTER, SLOWER, ab_verdict, ratio_interval

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "results" / "baselines" / "cpu-ci"
GATE_FILE = BASELINES / "gate.json"
ACCEPTED_FILE = BASELINES / "accepted.yaml"
WORKER = Path(__file__).resolve().parent / "gate_worker.py"
LEVELS = (0.05, 0.10, 0.20, 0.50)
"""Injected slowdowns of the step, put into its sparse_attn phase."""
VERDICTS = (SLOWER, FASTER, AB_UNDECIDED, AB_SAME)
DEFAULT_ROUNDS = 24
"""Step pairs per comparison (the cost: 20 self-comparisons of 30 cases, two sides each)."""
DEFAULT_ALPHA = 0.1
"""Family-wise error of one pass's point intervals (Bonferroni over the cases). A SLOWER or FASTER
point needs two passes to agree, so a false alarm needs two independent ones: (0.1 / 30)^2 per point.
With 24 pairs at a paired log-sd of 0.15 a 20% slowdown is still caught ~99% of the time (both passes;
0.01 would catch 84%): tests/test_ci_gate.py simulates it."""
SUITE_CONFIDENCE = 0.99
"""The pooled suite's interval: one test, not confirmed."""
DEFAULT_THRESHOLD = "10%"
"""A point's verdict names changes beyond this. Two processes of one tree drift apart by up to 4% over a
gate's minutes (a self-comparison's suite ratio reached 1.040 in one measured run, where 15 of its 20
self-comparisons alarmed at 5%); replayed on another run's samples, 10% detected the +20% injection as
often as 5% did (28/30): results/2026-12-03-cpu-gate-ab."""
DEFAULT_SUITE_THRESHOLD = "5%"


class GateFailure(Exception):
    """The gate fails (exit 1)."""


class UnusableInput(ValueError):
    """The gate cannot run (exit 2)."""


def one_thread_env(**extra: str) -> dict[str, str]:
    """ONE intra-op thread: on a loaded 2-core machine two OpenMP threads wait on each other."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **extra}


def git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise UnusableInput(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def base_commit(gate_file: Path) -> tuple[str, str]:
    """The commit to compare against and where it came from."""
    if gate_file.exists():
        recorded = json.loads(gate_file.read_text())["commit"]
        return git("rev-parse", "--verify", f"{recorded}^{{commit}}"), f"named by {gate_file.relative_to(ROOT)}"
    head = git("rev-parse", "HEAD")
    for ref, why in (("origin/main", "merge base with origin/main"), ("HEAD~1", "HEAD~1")):
        try:
            found = git("merge-base", ref, "HEAD") if ref == "origin/main" else git("rev-parse", ref)
        except UnusableInput:
            continue
        if found != head:  # on main itself the merge base is the head: compare with its parent
            return found, why
    raise UnusableInput("base: no gate.json, no origin/main and no HEAD~1 to compare against")


@contextmanager
def checked_out(commit: str):
    """``commit`` in a temporary worktree (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix="dsv4cp-gate-base-"))
    git("worktree", "add", "--detach", "--force", str(folder / "tree"), commit)
    try:
        yield folder / "tree"
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder / "tree")], cwd=ROOT, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


class Worker:
    """A ``gate_worker.py`` process importing ``tree``'s dsv4cp."""

    def __init__(self, label: str, tree: Path, spec: Path, calibrate_injection: bool = False,
                 core: int | None = None) -> None:
        self.label = label
        command = [sys.executable, str(WORKER), "--spec", str(spec), "--tree", str(tree)]
        self.process = subprocess.Popen(
            command + (["--calibrate-injection"] if calibrate_injection else []), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=one_thread_env(PYTHONPATH=str(tree)), cwd=tree)
        if core is not None:
            os.sched_setaffinity(self.process.pid, {core})

    def ready(self) -> dict:
        hello = self._read()
        if "error" in hello:
            raise UnusableInput(f"{self.label}: {hello['error']}")
        return hello

    def time(self, case: int, inject: float | None = None) -> float:
        self.process.stdin.write(json.dumps({"time": case, "inject": inject}) + "\n")
        self.process.stdin.flush()
        (ms,) = self._read()["ms"]  # one step asked, one time back
        return float(ms)

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise GateFailure(f"{self.label} worker ended (exit {self.process.wait()}): its stderr above says why")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write('{"quit": true}\n')
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


@dataclass
class Plan:
    rounds: int
    blocks: int
    injections: int
    threshold: float
    suite_threshold: float
    alpha: float
    pin: bool = True


@dataclass(frozen=True)
class Comparison:
    """Two sides compared on every case in one block: the gate's (base, head), a self-comparison
    (head, head2) or an injection (head, inject at ``level``)."""

    kind: str
    block: int
    first: str
    second: str
    level: float | None = None


@dataclass
class Samples:
    """CPU ms of each step, by (side, block, case); the confirmation steps by (comparison, case, side)."""

    times: dict = field(default_factory=dict)
    confirmations: dict = field(default_factory=dict)

    def add(self, side: str, block: int, case: int, ms: float) -> None:
        self.times.setdefault((side, block, case), []).append(ms)

    def get(self, side: str, block: int, case: int) -> list[float]:
        return self.times[(side, block, case)]


def injected_level(block: int, plan: Plan) -> float | None:
    """The injected level of ``block`` (None: no injection in it)."""
    return LEVELS[block % len(LEVELS)] if block < len(LEVELS) * plan.injections else None


def comparisons(plan: Plan) -> list[Comparison]:
    """Block 0's gate comparison, every block's self-comparison, the injection blocks' comparisons."""
    found = [Comparison("gate", 0, "base", "head")]
    for block in range(plan.blocks):
        found.append(Comparison("self", block, "head", "head2"))
        level = injected_level(block, plan)
        if level is not None:
            found.append(Comparison("inject", block, "head", "inject", level))
    return found


def rotated(sides: list[str], round_: int, case: int) -> list[str]:
    """The order of the sides' steps for one case in one round. No process runs two steps in a row (the
    second would find its caches warm): with three or more sides the order shifts by round and case, which
    never puts one case's last side first in the next; two sides alternate by round alone."""
    shift = (round_ + (case if len(sides) > 2 else 0)) % len(sides)
    return sides[shift:] + sides[:shift]


def _time_side(workers: dict, side: str, case: int, level: float | None, cases: list[dict]) -> float:
    if side == "inject":  # the fraction that makes the step `level` slower (the inject worker's own share)
        return workers["inject"].time(case, level / cases[case]["injected_share"])
    return workers[side].time(case)


def measure(workers: dict, cases: list[dict], plan: Plan) -> Samples:
    """Every block's rounds, sides rotated step by step (module docstring, step 5)."""
    samples = Samples()
    for block in range(plan.blocks):
        level = injected_level(block, plan)
        sides = (["base"] if block == 0 else []) + ["head", "head2"] + (["inject"] if level is not None else [])
        for round_ in range(plan.rounds):
            for index in range(len(cases)):
                for side in rotated(sides, round_, index):
                    samples.add(side, block, index, _time_side(workers, side, index, level, cases))
    return samples


def pairs(samples: Samples, comparison: Comparison, case: int) -> tuple[list[float], list[float]]:
    return (samples.get(comparison.first, comparison.block, case),
            samples.get(comparison.second, comparison.block, case))


def first_verdicts(samples: Samples, comparison: Comparison, n: int, plan: Plan) -> list[tuple[str, object]]:
    confidence = 1 - plan.alpha / n
    out = []
    for case in range(n):
        interval = ratio_interval(*pairs(samples, comparison, case), confidence)
        out.append((ab_verdict(interval, plan.threshold), interval))
    return out


def confirm(workers: dict, cases: list[dict], plan: Plan, samples: Samples,
            to_confirm: list[tuple[Comparison, int]]) -> None:
    """Fresh ``--rounds`` pairs for each (comparison, case) whose first verdict was SLOWER or FASTER,
    taken after every block, the comparisons of one pair of sides together (so no process runs twice
    in a row)."""
    by_sides: dict[tuple[str, str], list[tuple[Comparison, int]]] = {}
    for comparison, case in to_confirm:
        by_sides.setdefault((comparison.first, comparison.second), []).append((comparison, case))
    for (first, second), items in by_sides.items():
        for round_ in range(plan.rounds):
            for comparison, case in items:
                for side in rotated([first, second], round_, case):
                    ms = _time_side(workers, side, case, comparison.level, cases)
                    samples.confirmations.setdefault((comparison, case, side), []).append(ms)


def final_verdicts(samples: Samples, comparison: Comparison, first: list[tuple[str, object]],
                   plan: Plan) -> list[dict]:
    """Per case: the verdict (SLOWER / FASTER only when the confirmation agrees; one it contradicts
    is UNDECIDED), the first interval and the confirmation's."""
    confidence = 1 - plan.alpha / len(first)
    out = []
    for case, (verdict, interval) in enumerate(first):
        entry = {"verdict": verdict, "interval": interval, "confirmation": None}
        if verdict in (SLOWER, FASTER):
            again = ratio_interval(samples.confirmations[(comparison, case, comparison.first)],
                                   samples.confirmations[(comparison, case, comparison.second)], confidence)
            entry["confirmation"] = again
            if ab_verdict(again, plan.threshold) != verdict:
                entry["verdict"] = AB_UNDECIDED
        out.append(entry)
    return out


def suite_verdict(samples: Samples, comparison: Comparison, n: int, plan: Plan) -> tuple[str, object]:
    """Every case's pairs of the comparison pooled: a slowdown shared by the cases (one phase slower
    everywhere) is resolved far below what one case resolves. One test, at :data:`SUITE_CONFIDENCE`."""
    first, second = [], []
    for case in range(n):
        a, b = pairs(samples, comparison, case)
        first += a
        second += b
    interval = ratio_interval(first, second, SUITE_CONFIDENCE)
    return ab_verdict(interval, plan.suite_threshold), interval


def load_accepted(path: Path) -> list[dict]:
    if not path.exists():
        return []
    entries = yaml.safe_load(path.read_text()) or []
    for number, entry in enumerate(entries):
        missing = {"point", "counter", "old", "new", "reason"} - set(entry or {})
        if missing:
            raise UnusableInput(f"{path}: entry {number + 1} lacks {', '.join(sorted(missing))}")
    return entries


def counter_changes(base: dict[str, dict], head: dict[str, dict], head2: dict[str, dict],
                    accepted: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(unaccepted changes, accepted changes, counters that differ between the two head processes)."""
    failing, passed, unsteady = [], [], []
    for name, counters in head.items():
        if name not in base:
            continue
        for counter, new in counters.items():
            if head2[name].get(counter) != new:
                unsteady.append(f"{name}: {counter} {new} vs {head2[name].get(counter)} in two head processes")
                continue
            old = base[name].get(counter)
            if old == new:
                continue
            line = f"{name}: {counter} {old} -> {new}"
            match = [e for e in accepted if e["point"] == name and e["counter"] == counter
                     and e["old"] == old and e["new"] == new]
            (passed if match else failing).append(line + (f" (accepted: {match[0]['reason']})" if match else ""))
    return failing, passed, unsteady


def run_sweep(spec: Path, out: Path) -> None:
    command = [sys.executable, "-m", "dsv4cp", "sweep", str(spec), "--out", str(out), "--progress", "off"]
    done = subprocess.run(command, cwd=ROOT, env=one_thread_env(), capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        raise GateFailure(f"pipeline: `{' '.join(command)}` exited with {done.returncode}")
    problems: list = []
    records = read_records(out / RECORDS_FILE, problems)
    broken = [f"{r['point_id']}: {r['status']}" for r in records if r["status"] != STATUS_OK]
    if problems or broken or not records:
        raise GateFailure(f"pipeline: {len(problems)} invalid record lines, points not ok: {broken}")
    print(f"gate: pipeline: the sweep recorded {len(records)} points, all ok")


def ab(spec: Path, commit: str, plan: Plan, accepted: list[dict], head: Path = ROOT) -> dict:
    """Steps 2-6 with ``head``'s dsv4cp as the head; returns the figures."""
    started = time.monotonic()
    with checked_out(commit) as tree:
        core = max(os.sched_getaffinity(0)) if plan.pin else None
        workers = {"base": Worker("base", tree, spec, core=core), "head": Worker("head", head, spec, core=core),
                   "head2": Worker("head2", head, spec, core=core)}
        if plan.injections:
            workers["inject"] = Worker("inject", head, spec, calibrate_injection=True, core=core)
        try:
            hello = {label: worker.ready() for label, worker in workers.items()}
            print(f"gate: workers ready in {time.monotonic() - started:.0f} s")
            named = {label: {c["name"]: c for c in h["cases"]} for label, h in hello.items()}
            cases = hello["inject" if plan.injections else "head"]["cases"]
            missing = [c["name"] for c in cases if c["name"] not in named["base"]]
            if missing:
                raise UnusableInput(f"base: its spec lacks the cases {missing}")
            # the base worker indexes its own cases: time through a view that maps head's order onto it
            order = [list(named["base"]).index(c["name"]) for c in cases]
            workers["base"] = _Reindexed(workers["base"], order)
            samples = measure(workers, cases, plan)
            n = len(cases)
            first = {c: first_verdicts(samples, c, n, plan) for c in comparisons(plan)}
            confirm(workers, cases, plan, samples, [(c, i) for c, found in first.items()
                                                    for i, (v, _) in enumerate(found) if v in (SLOWER, FASTER)])
        finally:
            for worker in workers.values():
                worker.close()
    defaults = _default_changes(hello["base"]["defaults"], hello["head"]["defaults"])
    counters = counter_changes(*({n: c["counters"] for n, c in named[s].items()} for s in ("base", "head", "head2")),
                               accepted)
    results = [{"comparison": c, "points": final_verdicts(samples, c, found, plan),
                "suite": suite_verdict(samples, c, n, plan)} for c, found in first.items()]
    return {"cases": cases, "results": results, "counters": counters, "defaults": defaults,
            "noise": paired_noise(samples, [c for c in first if c.kind == "self"], n),
            "samples": samples, "seconds": time.monotonic() - started}


def paired_noise(samples: Samples, selfs: list[Comparison], n: int) -> float:
    """The machine's noise as the verdicts see it: the median over self-comparisons and cases of the
    standard deviation of log(second / first) of a case's pairs."""
    spreads = [statistics.stdev(math.log(b / a) for a, b in zip(*pairs(samples, c, case)))
               for c in selfs for case in range(n)]
    return statistics.median(spreads)


class _Reindexed:
    def __init__(self, worker: Worker, order: list[int]) -> None:
        self.worker, self.order = worker, order

    def time(self, case: int, inject: float | None = None) -> float:
        return self.worker.time(self.order[case], inject)

    def close(self) -> None:
        self.worker.close()


def _default_changes(base: dict, head: dict) -> list[str]:
    return [f"{name} {base.get(name, 'absent')} -> {head.get(name, 'absent')}"
            for name in sorted(set(base) | set(head)) if base.get(name) != head.get(name)]


def _alarms(result: dict) -> int:
    return sum(p["verdict"] in (SLOWER, FASTER) for p in result["points"])


def _interval_text(interval) -> str:
    return f"{interval.ratio:6.3f} {interval.low:6.3f}..{interval.high:<6.3f}"


def report(figures: dict, plan: Plan, commit: str, why: str) -> tuple[list[str], dict]:
    """The printed lines and the JSON summary of one A/B run."""
    cases = figures["cases"]
    by_kind: dict[str, list[dict]] = {}
    for result in figures["results"]:
        by_kind.setdefault(result["comparison"].kind, []).append(result)
    (gate,) = by_kind["gate"]
    confidence = 1 - plan.alpha / len(cases)
    lines = [f"gate: base {commit[:12]} ({why}) vs head; {plan.rounds} step pairs per comparison, "
             f"interval {100 * confidence:.4g}% per point (alpha {plan.alpha:g} / {len(cases)} cases), "
             f"{100 * SUITE_CONFIDENCE:.4g}% for the suite (every case's pairs pooled), threshold "
             f"{100 * plan.threshold:g}% per point, {100 * plan.suite_threshold:g}% for the suite; a SLOWER or "
             f"FASTER point is confirmed by {plan.rounds} fresh pairs; times are process CPU ms of one step"]
    if figures["defaults"]:
        lines.append("gate: kernel option defaults differ (the A/B ratios below are old vs new default): "
                     + "; ".join(figures["defaults"]))
    lines.append(f"  {'point':<52} {'step ms':>8} {'head/base':>9} {'interval':>14}  verdict")
    for case, point in zip(cases, gate["points"]):
        again = point["confirmation"]
        lines.append(f"  {case['name']:<52} {case['step_ms']:8.2f}  {_interval_text(point['interval'])}  "
                     f"{point['verdict']}" + (f" (confirmation {_interval_text(again)})" if again else ""))
    suite_v, suite_i = gate["suite"]
    lines.append(f"  {'suite (every point pooled)':<52} {'':8}  {_interval_text(suite_i)}  {suite_v}")
    failing, accepted, unsteady = figures["counters"]
    for title, entries in (("COUNTER CHANGED", failing), ("counter change accepted", accepted),
                           ("counter not deterministic (not gated)", unsteady)):
        lines += [f"gate: {title}: {entry}" for entry in entries]
    selfs = by_kind["self"]
    alarmed = [_alarms(r) for r in selfs]
    unconfirmed = sum(p["confirmation"] is not None and p["verdict"] == AB_UNDECIDED
                      for r in selfs for p in r["points"])
    suite_ratios = sorted(r["suite"][1].ratio for r in selfs)
    suite_alarms = sum(r["suite"][0] in (SLOWER, FASTER) for r in selfs)
    lines.append(f"gate: noise: a pair's log-ratio spreads by {figures['noise']:.3f} (sd, median over the "
                 "self-comparisons' points); the detection figures below hold at this noise")
    lines.append(f"gate: self-comparisons (head vs head2, {plan.rounds} pairs a side, every case): "
                 f"{sum(a > 0 for a in alarmed)}/{len(selfs)} with a false alarm ({sum(alarmed)}/"
                 f"{len(selfs) * len(cases)} point comparisons; {unconfirmed} first alarms not confirmed); suite "
                 f"ratio {suite_ratios[0]:.3f}..{suite_ratios[-1]:.3f}, {suite_alarms}/{len(selfs)} suite alarms")
    detection = {}
    for result in by_kind.get("inject", []):
        level = result["comparison"].level
        entry = detection.setdefault(f"{level:g}", {"detected": 0, "injections": 0, "suite_detected": 0,
                                                    "suite_injections": 0, "ratios": [], "points_detected": []})
        for case, point in zip(cases, result["points"]):
            entry["injections"] += 1
            entry["ratios"].append(point["interval"].ratio)
            if point["verdict"] == SLOWER:
                entry["detected"] += 1
                entry["points_detected"].append(case["name"])
        entry["suite_injections"] += 1
        entry["suite_detected"] += result["suite"][0] == SLOWER
        entry["suite_ratio"] = result["suite"][1].ratio
    for level, entry in detection.items():
        ratios = sorted(entry.pop("ratios"))
        entry["median_measured_ratio"] = ratios[len(ratios) // 2]
        share = 100 * entry["detected"] / entry["injections"]
        lines.append(f"gate: injected +{100 * float(level):g}% (in sparse_attn): points detected "
                     f"{entry['detected']}/{entry['injections']} ({share:.0f}%), "
                     f"measured ratio median {entry['median_measured_ratio']:.3f}; suite detected "
                     f"{entry['suite_detected']}/{entry['suite_injections']} (ratio {entry['suite_ratio']:.3f})")
        if float(level) <= 0.10 and entry["points_detected"]:
            step = {c["name"]: c["step_ms"] for c in cases}
            lines.append(f"gate:   +{100 * float(level):g}% resolved on: " + "; ".join(
                f"{name} ({step[name]:.1f} ms)" for name in entry["points_detected"]))
    counts = {v: sum(p["verdict"] == v for p in gate["points"]) for v in VERDICTS}
    summary = {"base": commit, "base_from": why, "rounds": plan.rounds, "blocks": plan.blocks,
               "threshold": plan.threshold, "suite_threshold": plan.suite_threshold, "alpha": plan.alpha,
               "verdicts": counts,
               "suite": {"verdict": suite_v, "ratio": suite_i.ratio, "low": suite_i.low, "high": suite_i.high},
               "points": [{"point": c["name"], "step_ms": c["step_ms"], "ratio": p["interval"].ratio,
                           "low": p["interval"].low, "high": p["interval"].high, "verdict": p["verdict"],
                           "confirmation_ratio": p["confirmation"].ratio if p["confirmation"] else None}
                          for c, p in zip(cases, gate["points"])],
               "self_comparisons": len(selfs), "self_comparisons_alarmed": sum(a > 0 for a in alarmed),
               "point_self_comparisons": len(selfs) * len(cases), "point_false_alarms": sum(alarmed),
               "first_alarms_not_confirmed": unconfirmed, "self_suite_ratios": suite_ratios,
               "self_suite_alarms": suite_alarms, "paired_log_sd": figures["noise"], "detection": detection,
               "counter_changes": failing, "counter_changes_accepted": accepted, "ab_seconds": figures["seconds"]}
    return lines, summary


def write_samples(path: Path, figures: dict) -> None:
    """Every step time of the run: ``times["side/block/case"]`` and ``confirmations["kind/block/level/
    case/side"]`` (a case is its index in ``cases``)."""
    samples = figures["samples"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "cases": [c["name"] for c in figures["cases"]],
        "times": {f"{side}/{block}/{case}": ms for (side, block, case), ms in samples.times.items()},
        "confirmations": {f"{c.kind}/{c.block}/{c.level}/{case}/{side}": ms
                          for (c, case, side), ms in samples.confirmations.items()}}) + "\n")


def summary_line(summary: dict, seconds: float) -> str:
    counts = ", ".join(f"{count} {name}" for name, count in summary["verdicts"].items())
    found = ", ".join(f"+{100 * float(level):g}% {d['detected']}/{d['injections']} (suite "
                      f"{d['suite_detected']}/{d['suite_injections']})" for level, d in summary["detection"].items()) \
        or "nothing (no injections)"
    return (f"gate summary: {counts}, suite {summary['suite']['verdict']} ({summary['suite']['ratio']:.3f}); "
            f"false alarms {summary['self_comparisons_alarmed']}/{summary['self_comparisons']} self-comparisons, "
            f"{summary['self_suite_alarms']} suite; detected {found}; "
            f"{len(summary['counter_changes'])} counter changes unaccepted; {seconds:.0f} s")


def refresh(args: argparse.Namespace, plan: Plan) -> int:
    """Name HEAD as the base after showing its A/B against the current base."""
    if not args.reason or not args.reason.strip():
        raise UnusableInput("--reason: a refresh needs a reason (it is recorded)")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise UnusableInput(f"refresh: the tree is dirty; commit first:\n{dirty}")
    head = git("rev-parse", "HEAD")
    commit, why = base_commit(args.gate_file)
    figures = ab(args.spec, commit, plan, load_accepted(args.accepted))
    lines, summary = report(figures, plan, commit, why)
    print("\n".join(lines))
    if figures["defaults"]:
        print("gate: refresh: the ratios above are the old defaults (base) against the new (head)")
    record = {"commit": head, "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
              "load_average": list(os.getloadavg()), "reason": args.reason.strip(),
              "time_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "previous_base": commit, "ab_against_previous": summary}
    args.gate_file.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gate: {args.gate_file} names {head[:12]}; commit it")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, default=ROOT / "sweeps" / "smoke.yaml", help="the cases to gate")
    parser.add_argument("--base", default=None, help="commit to compare against (default: what gate.json names)")
    parser.add_argument("--gate-file", type=Path, default=GATE_FILE, help="the base's record (--refresh writes it)")
    parser.add_argument("--accepted", type=Path, default=ACCEPTED_FILE, help="accepted counter changes (YAML)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"paired steps per comparison (default {DEFAULT_ROUNDS}; 13 is the fewest whose "
                        "interval can exclude 1 at 0.01 / 30 cases)")
    parser.add_argument("--blocks", type=int, default=20, help="self-comparisons, block 0 also the gate's (20)")
    parser.add_argument("--injections", type=int, default=1, help="blocks per injected level (default 1)")
    parser.add_argument("--threshold", default=DEFAULT_THRESHOLD,
                        help=f"smallest change a point's verdict names (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--suite-threshold", default=DEFAULT_SUITE_THRESHOLD,
                        help=f"smallest change the suite's verdict names (default {DEFAULT_SUITE_THRESHOLD})")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the workers run on any core (default: all on one, so no side keeps a core of "
                        "its own)")
    parser.add_argument("--samples", type=Path, default=None,
                        help="write every step time here (JSON), to study the gate's rule offline")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help=f"family-wise error of one pass's point intervals (default {DEFAULT_ALPHA:g})")
    parser.add_argument("--skip-sweep", action="store_true", help="skip the pipeline check")
    parser.add_argument("--head-tree", type=Path, default=ROOT,
                        help="the tree whose dsv4cp is the head (default: this repository; a scratch copy "
                        "with a change to try)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--refresh", action="store_true", help="name HEAD as the base (clean tree, --reason)")
    parser.add_argument("--reason", default=None, help="why the base moves (recorded by --refresh)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.rounds < 3 or args.blocks < 1 or args.injections < 0 or args.injections * len(LEVELS) > args.blocks:
            raise UnusableInput(f"--rounds >= 3, --blocks >= 1, 0 <= --injections <= blocks / {len(LEVELS)}: got "
                                f"{args.rounds}, {args.blocks}, {args.injections}")
        if not 0 < args.alpha < 1:
            raise UnusableInput(f"--alpha: must lie in (0, 1), got {args.alpha}")
        try:
            plan = Plan(args.rounds, args.blocks, args.injections, parse_threshold(args.threshold),
                        parse_threshold(args.suite_threshold), args.alpha, pin=not args.no_pin)
        except ValueError as err:
            raise UnusableInput(str(err).replace("--max-regression", "--threshold")) from None
        if args.refresh:
            return refresh(args, plan)
        accepted = load_accepted(args.accepted)
        if not args.skip_sweep:
            with tempfile.TemporaryDirectory(prefix="dsv4cp-gate-") as work:
                run_sweep(args.spec, Path(work) / "smoke")
        commit, why = (git("rev-parse", "--verify", f"{args.base}^{{commit}}"), "--base") if args.base \
            else base_commit(args.gate_file)
        figures = ab(args.spec, commit, plan, accepted, args.head_tree)
        lines, summary = report(figures, plan, commit, why)
        print("\n".join(lines))
        if args.samples:
            write_samples(args.samples, figures)
        seconds = time.monotonic() - started
        summary["gate_seconds"] = seconds
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=1) + "\n")
        print(summary_line(summary, seconds))
        slower = [p["point"] for p in summary["points"] if p["verdict"] == SLOWER]
        suite_slower = summary["suite"]["verdict"] == SLOWER
        if slower or suite_slower or summary["counter_changes"]:
            raise GateFailure(f"{len(slower)} points SLOWER than the base ({'; '.join(slower)}), the suite "
                              f"{summary['suite']['verdict']} ({summary['suite']['ratio']:.3f}), "
                              f"{len(summary['counter_changes'])} counter changes not accepted")
    except GateFailure as failure:
        print(f"gate: FAILED: {failure}", file=sys.stderr)
        return 1
    except UnusableInput as err:
        print(f"gate: unusable input: {err}", file=sys.stderr)
        return 2
    print("gate: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
