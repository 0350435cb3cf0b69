"""Does a step that follows the same process's step of the same case run faster than one that follows
another process's step? Two gate workers of this tree, A and B; per case and round: A, B, then B again
(the third step finds B's caches warm). Prints the median ratios over 8 rounds of the 30 smoke cases.

    python results/2026-12-03-cpu-gate-ab/warm_cache.py
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)

smoke = ROOT / "sweeps" / "smoke.yaml"
first, second = gate.Worker("A", ROOT, smoke), gate.Worker("B", ROOT, smoke)
cases = first.ready()["cases"]
second.ready()
cold, warm = [], []
for _ in range(8):
    for index in range(len(cases)):
        a, b, b_again = first.time(index), second.time(index), second.time(index)
        cold.append(b / a)
        warm.append(b_again / b)
first.close()
second.close()
print(f"B after A (cold) / A: {statistics.median(cold):.3f}")
print(f"B after B same case (warm) / B cold: {statistics.median(warm):.3f}")
