"""Does pinning the gate's workers to one core make a pair of steps agree more closely? Four gate workers
of this tree: A and B free to run on any core, C and D pinned to the last core; per case and round they
time one step each in the rotation A C B D (no worker twice in a row). Prints the spread (sd of the log
ratio) of the pairs B/A and D/C over the 30 smoke cases and ``ROUNDS`` rounds, and the machine's load.

    python results/2026-12-03-cpu-gate-ab/pinning.py [ROUNDS]
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
smoke = ROOT / "sweeps" / "smoke.yaml"
workers = {label: gate.Worker(label, ROOT, smoke) for label in "ABCD"}
last_core = max(os.sched_getaffinity(0))
for label in "CD":
    os.sched_setaffinity(workers[label].process.pid, {last_core})
cases = [worker.ready()["cases"] for worker in workers.values()][0]
times = {label: np.zeros((rounds, len(cases))) for label in workers}
for round_ in range(rounds):
    for index in range(len(cases)):
        for label in "ACBD":
            times[label][round_, index] = workers[label].time(index)
for worker in workers.values():
    worker.close()
free, pinned = np.log(times["B"] / times["A"]), np.log(times["D"] / times["C"])
print(f"load average {os.getloadavg()[0]:.1f}; {rounds} rounds x {len(cases)} cases")
print(f"free   B/A: sd of log ratio {free.std():.3f}, per-case median sd {np.median(free.std(axis=0)):.3f}")
print(f"pinned D/C: sd of log ratio {pinned.std():.3f}, per-case median sd {np.median(pinned.std(axis=0)):.3f}")
