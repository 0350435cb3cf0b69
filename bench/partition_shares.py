"""Per-rank shares (rank time / mean of the ranks) of every split in a ``bench.cpu_partition`` table:
measured against the calibrated model, so the shape across ranks can be compared, not only the max/mean.

    python -m bench.partition_shares --table partition-cpu.csv --machine-file machine-cpu.json \
        --calibration calibration-cpu-prefix.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from dsv4cp.cli.common import HelpFormatter
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import BOTH, Machine, estimate
from dsv4cp.model.calibration import Calibration
from dsv4cp.workloads import packing_lengths

RATIO = 4  # the tiny C layer bench.cpu_partition measures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.partition_shares", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--table", type=Path, required=True, help="the CSV bench.cpu_partition wrote (--out)")
    parser.add_argument("--machine-file", type=Path, required=True, help="the machine JSON of the calibration")
    parser.add_argument("--calibration", type=Path, required=True, help="the calibration JSON of the model column")
    parser.add_argument("--tokens", type=int, default=8192, help="the table's --tokens")
    parser.add_argument("--seed", type=int, default=0, help="the table's --seed (its packings)")
    parser.add_argument("--indexer-loss-scores", choices=("selection", "recompute"), default="selection",
                        help="what the sparse loss ran on when the table was measured: the selection's scores "
                             "(today's default) or scores computed again (recompute; every table measured "
                             "before the kernel option indexer_loss_scores existed)")
    args = parser.parse_args(argv)
    cfg = DSv4Config.preset("tiny")
    machine = Machine.from_dict(json.loads(args.machine_file.read_text()), source="--machine-file")
    calibration = Calibration.load(args.calibration)
    rows = []
    for _, row in pd.read_csv(args.table).iterrows():
        counts = [int(n) for n in row["rows_per_rank"].split("/")]
        split = RowSplit(tuple(int(b) for b in np.concatenate(([0], np.cumsum(counts)))))
        lengths = packing_lengths(row["packing"], args.tokens, cp=split.cp, ratio=RATIO, seed=args.seed)
        est = estimate(cfg, RATIO, lengths, split.cp, machine, args.tokens, split=split,
                       selection_scores=args.indexer_loss_scores == "selection")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
