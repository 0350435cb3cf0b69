"""Is a case's time a property of the process that runs it? Three gate workers of this tree (A, B, C) time
the 30 smoke cases for ``ROUNDS`` rounds in the rotation the gate uses (no worker twice in a row). Per case
and worker pair: the mean log ratio and its standard error over the rounds; printed: the spread of those
per-case means against what the rounds' noise alone gives (their standard errors), and the cases whose
process bias exceeds 5%. Writes the step times to ``process_bias.npy`` beside this file.

    python results/2026-12-03-cpu-gate-ab/process_bias.py [ROUNDS]
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
smoke = ROOT / "sweeps" / "smoke.yaml"
labels = ["A", "B", "C"]
workers = {label: gate.Worker(label, ROOT, smoke) for label in labels}
cases = [worker.ready()["cases"] for worker in workers.values()][0]
times = np.zeros((len(labels), rounds, len(cases)))
for round_ in range(rounds):
    for index in range(len(cases)):
        for label in gate.rotated(labels, round_, index):
            times[labels.index(label), round_, index] = workers[label].time(index)
for worker in workers.values():
    worker.close()
np.save(HERE / "process_bias.npy", times)
print(f"load average {os.getloadavg()[0]:.1f}; {rounds} rounds x {len(cases)} cases")
for first, second in ((0, 1), (0, 2), (1, 2)):
    logs = np.log(times[second] / times[first])
    means, errors = logs.mean(axis=0), logs.std(axis=0, ddof=1) / np.sqrt(rounds)
    chi2 = float(np.sum((means / errors) ** 2))
    big = [f"{cases[i]['name']} {np.exp(means[i]):.3f}" for i in range(len(cases)) if abs(means[i]) > np.log(1.05)]
    print(f"{labels[second]}/{labels[first]}: per-case mean log ratio sd {means.std():.3f}, median standard error "
          f"{np.median(errors):.3f}, chi2 {chi2:.0f} on {len(cases)} df; beyond 5%: {'; '.join(big) or 'none'}")
