"""Does the gate's injection make a step the slowdown it names? Six fwd+bwd smoke cases in two head
processes, 12 rounds of: head, head2, head2 with the +20% injection (its fraction from the case's own
calibration, as `.ci/gate.py` computes it), head again; prints the medians of the paired ratios.
Usage, from the repository root: python results/<this folder>/injection.py"""

import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)

LEVEL = 0.20
workers = [gate.Worker(f"head{i}", ROOT, ROOT / "sweeps" / "smoke.yaml") for i in range(2)]
cases = [worker.ready() for worker in workers][1]["cases"]
picked = [2, 7, 12, 17, 22, 27]
for i in picked:
    print(f"{cases[i]['name']}: step {cases[i]['step_ms']:.2f} ms, sparse_attn {cases[i]['phase_ms']:.2f} ms, "
          f"fraction 1 adds {cases[i]['injected_ms']:.2f} ms")
steps = {i: [] for i in picked}
for _ in range(12):
    for i in picked:
        fraction = LEVEL * cases[i]["step_ms"] / cases[i]["injected_ms"]
        steps[i].append((workers[0].time(i), workers[1].time(i), workers[1].time(i, fraction), workers[0].time(i)))
for worker in workers:
    worker.close()
for i in picked:
    x = np.log(np.array(steps[i]))
    ratios = [np.exp(np.median(x[:, a] - x[:, b])) for a, b in ((1, 0), (2, 1), (2, 0))]
    print(f"{cases[i]['name'][:44]:<44} head2/head {ratios[0]:.3f}  injected/head2 {ratios[1]:.3f}  "
          f"injected/head {ratios[2]:.3f}")
