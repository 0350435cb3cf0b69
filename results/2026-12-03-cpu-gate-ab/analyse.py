"""The gate's rule replayed offline on one run's step times (``.ci/gate.py --samples FILE``): for each
point threshold and alpha, the self-comparisons with a (confirmed) false alarm and the injected levels'
detections, from the same samples, so the rule's settings are compared on one machine state.
Also: each self-comparison block's suite ratio (how far two processes of one tree drift apart).

    python results/2026-12-03-cpu-gate-ab/analyse.py SAMPLES.json
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ci_gate", ROOT / ".ci" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gate
spec.loader.exec_module(gate)


def load(path: Path) -> tuple[list[str], gate.Samples, int]:
    data = json.loads(path.read_text())
    samples = gate.Samples()
    blocks = 0
    for key, ms in data["times"].items():
        side, block, case = key.split("/")
        samples.times[(side, int(block), int(case))] = ms
        blocks = max(blocks, int(block) + 1)
    for key, ms in data["confirmations"].items():
        kind, block, level, case, side = key.split("/")
        first, second = {"gate": ("base", "head"), "self": ("head", "head2"), "inject": ("head", "inject")}[kind]
        comparison = gate.Comparison(kind, int(block), first, second, None if level == "None" else float(level))
        samples.confirmations[(comparison, int(case), side)] = ms
    return data["cases"], samples, blocks


def replay(cases: list[str], samples: gate.Samples, blocks: int, threshold: float, alpha: float) -> str:
    rounds = len(samples.get("head", 0, 0))
    injections = sum(1 for b in range(blocks) if ("inject", b, 0) in samples.times) // len(gate.LEVELS)
    plan = gate.Plan(rounds, blocks, injections, threshold, 0.05, alpha)
    n = len(cases)
    alarmed = unconfirmable = 0
    detected: dict[float, int] = {}
    for comparison in gate.comparisons(plan):
        if comparison.kind == "gate":
            continue
        first = gate.first_verdicts(samples, comparison, n, plan)
        needed = [i for i, (v, _) in enumerate(first) if v in (gate.SLOWER, gate.FASTER)]
        if any((comparison, i, comparison.first) not in samples.confirmations for i in needed):
            # the run confirmed only what its own settings alarmed on: an alarm it never confirmed
            # counts as confirmed here (the replay can only overstate the false alarms)
            unconfirmable += sum((comparison, i, comparison.first) not in samples.confirmations for i in needed)
            verdicts = [v for v, _ in first]
            for i in needed:
                if (comparison, i, comparison.first) in samples.confirmations:
                    again = gate.ratio_interval(samples.confirmations[(comparison, i, comparison.first)],
                                                samples.confirmations[(comparison, i, comparison.second)],
                                                1 - alpha / n)
                    if gate.ab_verdict(again, threshold) != verdicts[i]:
                        verdicts[i] = gate.AB_UNDECIDED
        else:
            verdicts = [p["verdict"] for p in gate.final_verdicts(samples, comparison, first, plan)]
        if comparison.kind == "self":
            alarmed += any(v in (gate.SLOWER, gate.FASTER) for v in verdicts)
        else:
            detected[comparison.level] = sum(v == gate.SLOWER for v in verdicts)
    found = ", ".join(f"+{100 * level:g}% {count}/{n}" for level, count in sorted(detected.items()))
    return (f"threshold {100 * threshold:4.0f}%  alpha {alpha:<5g}  self-comparisons alarmed {alarmed:2d}/{blocks}  "
            f"detected {found}" + (f"  ({unconfirmable} alarms unconfirmed in the run)" if unconfirmable else ""))


def main() -> None:
    cases, samples, blocks = load(Path(sys.argv[1]))
    n = len(cases)
    plan = gate.Plan(len(samples.get("head", 0, 0)), blocks, 0, 0.05, 0.05, 0.1)
    selfs = [gate.Comparison("self", b, "head", "head2") for b in range(blocks)]
    ratios = [gate.suite_verdict(samples, c, n, plan)[1].ratio for c in selfs]
    print(f"{n} cases, {blocks} blocks; paired log-sd {gate.paired_noise(samples, selfs, n):.3f}")
    print("self-comparison suite ratios (head2 / head) by block: " + " ".join(f"{r:.3f}" for r in ratios))
    for threshold in (0.05, 0.08, 0.10):
        for alpha in (0.01, 0.05, 0.1):
            print(replay(cases, samples, blocks, threshold, alpha))


if __name__ == "__main__":
    main()
