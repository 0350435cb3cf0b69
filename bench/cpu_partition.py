"""Per-rank CPU time of a C layer under the equal and the balanced (calibrated) split, gloo ranks.

Each rank runs the suite's training step (:mod:`dsv4cp.harness.build`, fwd+bwd) on one thread and times
it with ``time.thread_time`` (the CPU time of the calling thread: its compute, not the waits in gloo's
collectives), so the per-rank work shows even when all ranks share two cores; this clock, not the
suite's wall-clock timer, because the ranks' waits are what it must leave out. Printed and written
(CSV) beside the model's predicted max/mean imbalance of the same splits, with and without the
calibration. The balanced split is computed once per calibration given (one per indexer scan, see
:mod:`dsv4cp.model.calibration`).

``--phases-out`` instead runs CP = 1 and writes the CPU time of every phase range (innermost range
charged, told by a phase listener of :mod:`dsv4cp.profiling.nvtx`: no profiler, whose per-operator
overhead would dwarf the tiny layer's phases) as a per-phase table for ``dsv4cp model --calibrate``.

    python -m bench.cpu_partition --phases-out P.csv
    python -m bench.cpu_partition --calibration CAL.json --machine-file M.json --out T.csv

The runs recorded in results/2026-12-01-cpu-balanced-partition*/ (their run.sh) used it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import defaultdict

import numpy as np
import pandas as pd
import torch

from dsv4cp.cli.common import HelpFormatter
from dsv4cp.config import DSv4Config
from dsv4cp.cp.launch import spawn
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.build import build_step
from dsv4cp.harness.case import Case
from dsv4cp.model import BOTH, Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.partition import policy_split
from dsv4cp.profiling.nvtx import full_name, set_phase_listener
from dsv4cp.workloads import packing_lengths


class PhaseCpuClock:
    """Thread CPU milliseconds per phase range, each interval charged to the innermost open range."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._local = threading.local()

    def _charge(self) -> list[str]:
        local, now = self._local, time.thread_time()
        stack = local.__dict__.setdefault("stack", [])
        if stack:
            self.ms[stack[-1]] += (now - local.last) * 1e3
        local.last = now
        return stack

    def enter(self, phase: str) -> None:
        self._charge().append(phase)

    def exit(self, phase: str) -> None:
        stack = self._charge()
        if stack and stack[-1] == phase:
            stack.pop()


def rank_cpu_ms(cfg, ratio, lengths, tokens, split, warmup, reps, seed, clock=None) -> float:
    """Median CPU milliseconds of this rank's fwd+bwd steps (one process: no group; ``clock``: a phase
    listener told of the timed steps' ranges)."""
    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    case = Case(cfg=cfg, ratio=ratio, lengths=tuple(lengths), total=tokens, seed=seed,
                split=split.bounds if split is not None else None)
    step = build_step(case, cp_group=group)
    times = []
    for index in range(warmup + reps):
        if group is not None:
            torch.distributed.barrier()
        if index == warmup and clock is not None:
            set_phase_listener(clock)
        start = time.thread_time()
        step()
        if index >= warmup:
            times.append((time.thread_time() - start) * 1e3)
    set_phase_listener(None)
    return float(np.median(times))


def write_phases(path: str, tokens: int, warmup: int, reps: int, seed: int) -> None:
    """CP = 1 CPU time per phase (mean over ``reps`` steps, one thread) as ``rank,phase,compute_ms``."""
    torch.set_num_threads(1)  # as every gloo rank runs
    cfg, ratio = DSv4Config.preset("tiny"), 4
    clock = PhaseCpuClock()
    step_ms = rank_cpu_ms(cfg, ratio, [tokens], tokens, RowSplit.equal(tokens, 1), warmup, reps, seed, clock)
    rows = [{"rank": 0, "phase": full_name(phase), "compute_ms": ms / reps} for phase, ms in clock.ms.items()]
    rows.append({"rank": 0, "phase": "total", "compute_ms": step_ms})
    pd.DataFrame(rows).to_csv(path, index=False)
    print(pd.DataFrame(rows).round(3).to_string(index=False))


def worker(rank, world, device, cases, cfg, ratio, tokens, warmup, reps, seed):
    return [rank_cpu_ms(cfg, ratio, lengths, tokens, split, warmup, reps, seed) for lengths, split in cases]


def model_columns(cfg, ratio, lengths, split, tokens, machine, calibrations) -> dict:
    """The model's predicted max/mean per-rank compute of ``split``: bounds, then each calibration's."""
    est = estimate(cfg, ratio, lengths, split.cp, machine, tokens, split=split)
    bound = np.asarray(est.summary(BOTH).rank_compute_s)
    columns = {"model_bound_max_over_mean": bound.max() / bound.mean()}
    for scan, cal in calibrations.items():
        calibrated = cal.rank_compute_s(est, BOTH)
        columns[f"model_{scan}_max_over_mean"] = calibrated.max() / calibrated.mean()
    return columns


def remodel(path: str, calibrations, machine, tokens: int, seed: int) -> pd.DataFrame:
    """The measured table at ``path`` with its model columns recomputed (the splits are in the table)."""
    cfg, ratio = DSv4Config.preset("tiny"), 4
    table = pd.read_csv(path)
    for index, row in table.iterrows():
        rows = [int(n) for n in row["rows_per_rank"].split("/")]
        split = RowSplit(tuple(int(b) for b in np.concatenate(([0], np.cumsum(rows)))))
        lengths = packing_lengths(row["packing"], tokens, cp=split.cp, ratio=ratio, seed=seed)
        for name, value in model_columns(cfg, ratio, lengths, split, tokens, machine, calibrations).items():
            table.loc[index, name] = value
    table.to_csv(path, index=False)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_partition", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--phases-out", default=None, help="run CP = 1 and write its per-phase CPU times here")
    parser.add_argument("--calibration", action="append", default=[],
                        help="CPU calibration JSON (dsv4cp model --calibrate); repeat for several indexer scans")
    parser.add_argument("--machine-file", help="the machine JSON the calibration was fitted with")
    parser.add_argument("--tokens", type=int, default=16384, help="packed rows of the batch")
    parser.add_argument("--cps", default="4,8", help="comma-separated CP sizes (one gloo rank each)")
    parser.add_argument("--packings", default="one,histogram", help="comma-separated packings")
    parser.add_argument("--policies", default="equal,balanced",
                        help="equal, balanced (the per-row split) and refined (refined on the model's "
                             "per-rank evaluation); balanced and refined once per calibration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps")
    parser.add_argument("--reps", type=int, default=3, help="timed steps (median per rank)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and packings")
    parser.add_argument("--out", help="CSV of the table")
    parser.add_argument("--remodel", action="store_true",
                        help="recompute the model columns of the table at --out instead of measuring")
    args = parser.parse_args(argv)
    if args.phases_out:
        write_phases(args.phases_out, args.tokens, args.warmup, args.reps, args.seed)
        return
    if not (args.calibration and args.machine_file and args.out):
        parser.error("--calibration, --machine-file and --out are needed without --phases-out")

    cfg, ratio = DSv4Config.preset("tiny"), 4
    calibrations = {Calibration.load(path).indexer_scan: Calibration.load(path) for path in args.calibration}
    machine = Machine.from_dict(json.loads(open(args.machine_file).read()), source="--machine-file")
    if args.remodel:
        table = remodel(args.out, calibrations, machine, args.tokens, args.seed)
        with pd.option_context("display.width", 250, "display.max_columns", 20):
            print(table.round(3).to_string(index=False))
        return
    # equal, then balanced (per-row, or refined) on each calibration (named by the indexer scan it was fitted on)
    policies = []
    for name in args.policies.split(","):
        if name not in ("equal", "balanced", "refined"):
            parser.error(f"--policies: unknown policy {name!r} (equal, balanced, refined)")
        if name == "equal":
            policies.append(("equal", None))
        else:
            suffix = {"balanced": "", "refined": "-refined"}[name]
            policies += [(f"balanced:{scan}{suffix}", cal) for scan, cal in calibrations.items()]
    rows = []
    for cp in (int(c) for c in args.cps.split(",")):
        cases, keys = [], []
        for packing in args.packings.split(","):
            lengths = packing_lengths(packing, args.tokens, cp=cp, ratio=ratio, seed=args.seed)
            for label, cal in policies:
                split = policy_split(cfg, ratio, lengths, cp, label.split(":")[0], machine, total=args.tokens,
                                     calibration=cal, refine=label.endswith("-refined"))
                cases.append((lengths, split))
                keys.append((packing, label, lengths))
        measured = spawn(worker, cp, cases, cfg, ratio, args.tokens, args.warmup, args.reps, args.seed)
        for index, (packing, label, lengths) in enumerate(keys):
            per_rank = np.array([measured[r][index] for r in range(cp)])
            row = {
                "cp": cp, "packing": packing, "policy": label,
                "rows_per_rank": "/".join(map(str, cases[index][1].rank_rows)),
                "measured_max_ms": per_rank.max(), "measured_mean_ms": per_rank.mean(),
                "measured_max_over_mean": per_rank.max() / per_rank.mean(),
                **model_columns(cfg, ratio, lengths, cases[index][1], args.tokens, machine, calibrations),
                "per_rank_ms": "/".join(f"{v:.0f}" for v in per_rank),
            }
            rows.append(row)
        table = pd.DataFrame(rows)
        table.to_csv(args.out, index=False)  # after every cp: a partial run keeps what it measured
        with pd.option_context("display.width", 250, "display.max_columns", 20):
            print(table[table["cp"] == cp].round(3).to_string(index=False), flush=True)


if __name__ == "__main__":
    main()
