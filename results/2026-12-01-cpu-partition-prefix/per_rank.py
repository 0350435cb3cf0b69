"""Per-rank shares (rank time / mean of the ranks) of every split in ``partition-cpu.csv``: measured
against the model calibrated on the torch top-k's ``prefix`` scan, so the shape across ranks can be
compared, not only the max/mean.

    python results/2026-12-01-cpu-partition-prefix/per_rank.py > results/2026-12-01-cpu-partition-prefix/per_rank.txt
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import BOTH, Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.workloads import packing_lengths

HERE = Path(__file__).resolve().parent
TOKENS, RATIO, SEED = 8192, 4, 0  # as run.sh and measure.py's defaults


def main() -> None:
    cfg = DSv4Config.preset("tiny")
    machine = Machine.from_dict(json.loads((HERE / "machine-cpu.json").read_text()), source="--machine-file")
    calibration = Calibration.load(HERE / "calibration-cpu-prefix.json")
    rows = []
    for _, row in pd.read_csv(HERE / "partition-cpu.csv").iterrows():
        counts = [int(n) for n in row["rows_per_rank"].split("/")]
        split = RowSplit(tuple(int(b) for b in np.concatenate(([0], np.cumsum(counts)))))
        lengths = packing_lengths(row["packing"], TOKENS, cp=split.cp, ratio=RATIO, seed=SEED)
        est = estimate(cfg, RATIO, lengths, split.cp, machine, TOKENS, split=split)
        model = np.asarray(calibration.rank_compute_s(est, BOTH))
        measured = np.array([float(v) for v in row["per_rank_ms"].split("/")])
        rows.append({
            "cp": row["cp"], "packing": row["packing"], "policy": row["policy"],
            "measured_share": "/".join(f"{v:.2f}" for v in measured / measured.mean()),
            "model_prefix_share": "/".join(f"{v:.2f}" for v in model / model.mean()),
            "model_prefix_mean_ms": model.mean() * 1e3, "measured_mean_ms": measured.mean(),
        })
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 80):
        print(pd.DataFrame(rows).round(1).to_string(index=False))


if __name__ == "__main__":
    main()
