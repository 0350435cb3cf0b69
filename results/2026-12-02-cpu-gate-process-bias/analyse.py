"""What steps.npy says about the gate's noise: spread of one step, of a paired difference between two
processes, with and without a median / min over the back-to-back repeats, and each process's paired bias
against process 0 per case, with its standard error."""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
steps = np.load(HERE / "steps.npy")
names = json.loads((HERE / "cases.json").read_text())
samples = {"one step": steps[..., 0], "median of the repeats": np.median(steps, axis=3),
           "min of the repeats": steps.min(axis=3)}
print(f"{steps.shape[0]} processes, {steps.shape[1]} cases, {steps.shape[2]} rounds, {steps.shape[3]} repeats")
print(f"{'sample':<24} {'log-sd over rounds':>18} {'paired log-sd':>14} {'|bias| p50/p90/max of proc 1 vs 0':>36}")
for label, x in samples.items():
    spread = np.median(np.std(np.log(x), axis=-1))
    paired = np.log(x[1]) - np.log(x[0])
    bias = np.percentile(np.abs(np.median(paired, axis=-1)), [50, 90, 100])
    print(f"{label:<24} {spread:18.3f} {np.median(np.std(paired, axis=-1)):14.3f} "
          f"{'  '.join(f'{100 * b:.1f}%' for b in bias):>36}")
one = samples["one step"]
print("per case: median step ms; paired bias of process 1 and 2 against 0 (median of log ratios over the rounds)"
      " +- its standard error (1.25 x sd / sqrt(rounds))")
for case, name in enumerate(names):
    cells = []
    for p in range(1, one.shape[0]):
        paired = np.log(one[p, case]) - np.log(one[0, case])
        error = 1.25 * np.std(paired) / np.sqrt(len(paired))
        cells.append(f"{100 * np.median(paired):+5.1f}% +- {100 * error:.1f}%")
    print(f"  {name:<52} {np.median(one[0, case]):7.2f} ms  " + "   ".join(cells))
