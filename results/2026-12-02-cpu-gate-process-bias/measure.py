"""Three gate workers of ONE tree (the same code), the smoke cases timed in rotation: per round and case,
each process runs REPEAT steps back to back. Writes steps.npy (process, case, round, repeat: CPU ms) and
cases.json. Usage, from the repository root: python results/<this folder>/measure.py PROCESSES ROUNDS REPEAT"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)

processes, rounds, repeat = (int(arg) for arg in sys.argv[1:4])
workers = [gate.Worker(f"w{i}", ROOT, ROOT / "sweeps" / "smoke.yaml") for i in range(processes)]
cases = [worker.ready() for worker in workers][0]["cases"]
steps = np.zeros((processes, len(cases), rounds, repeat))
for round_ in range(rounds):
    for case in range(len(cases)):
        shift = (round_ + case) % processes  # the order rotates, as the gate's does
        for p in list(range(processes))[shift:] + list(range(processes))[:shift]:
            workers[p].process.stdin.write(json.dumps({"time": case, "repeat": repeat}) + "\n")
            workers[p].process.stdin.flush()
            steps[p, case, round_] = workers[p]._read()["ms"]
for worker in workers:
    worker.close()
np.save(HERE / "steps.npy", steps)
(HERE / "cases.json").write_text(json.dumps([c["name"] for c in cases]) + "\n")
