"""Check a CP = 1 calibration against measured CP = 2 per-rank phase times of the flash C layer (64K
tokens), and print the splits the balanced policy chooses with and without it. Reads files only; runs
in seconds on any machine:

    python -m bench.calibration_check --calibration results/baselines/h200/calibration.json \
        --one-document-phases results/2026-12-01-h200x2-cp2-after-fixes/overlap_async.csv \
        --histogram-records results/runs/h200x2-overlap/records.jsonl

1. Calibrated per-rank compute (the CP = 1 fit applied to the CP = 2 model) against the measured
   per-rank phase times of the equal split: one 64K document (a profile's per-phase ``overlap.csv``)
   and histogram packing (the first async C-layer record with phases of a sweep's records). Only the
   phases a class covers are summed on both sides (no ``step`` remainder, no communication).
2. The splits the balanced policy chooses for CP = 2 (and 4, 8) with and without the calibration.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from dsv4cp.config import DSv4Config
from dsv4cp.model import Machine, estimate
from dsv4cp.model.calibration import Calibration, class_times, model_class_times, read_profile
from dsv4cp.model.partition import compare_policies
from dsv4cp.workloads import packing_lengths

TOKENS, RATIO = 65536, 4


def histogram_phases(records: Path) -> pd.DataFrame:
    """Per-phase rows of the first async C-layer record with phases in the sweep's ``records``."""
    for line in records.read_text().splitlines():
        record = json.loads(line)
        if record.get("phases") and record["ratio"] == RATIO and record["overlap"] == "async":
            return pd.DataFrame(record["phases"])
    raise ValueError(f"--histogram-records: no async C-layer record with phases in {records}")


def compare(name: str, measured: pd.DataFrame, lengths: list[int], cal: Calibration, cfg: DSv4Config) -> None:
    est = estimate(cfg, RATIO, lengths, 2, Machine(), total=TOKENS)
    model = cal.class_times(est).merge(model_class_times(est), on=["rank", "phase_class", "direction"],
                                       suffixes=("_scan", ""))
    times = class_times(measured).merge(model.drop(columns="bound_ms_scan"), on=["rank", "phase_class", "direction"])
    per_class = times.pivot_table(index=["phase_class", "direction"], columns="rank",
                                  values=["measured_ms", "calibrated_ms", "bound_ms"])
    totals = times.groupby("rank")[["measured_ms", "calibrated_ms", "bound_ms"]].sum()
    print(f"\n== {name}, cp 2, equal split: per-rank ms (class phases only)")
    print(per_class.round(2).to_string())
    print(totals.round(2).to_string())
    gap = totals.loc[1] - totals.loc[0]
    print(f"rank 1 - rank 0: measured {gap['measured_ms']:.1f} ms, calibrated model {gap['calibrated_ms']:.1f} ms "
          f"({gap['calibrated_ms'] / gap['measured_ms'] - 1:+.0%}), uncalibrated bound {gap['bound_ms']:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibration_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", type=Path, required=True, help="the calibration JSON to check")
    parser.add_argument("--one-document-phases", type=Path, required=True,
                        help="per-phase overlap CSV of a CP = 2 profile of one 64K document, equal split")
    parser.add_argument("--histogram-records", type=Path, required=True,
                        help="records.jsonl of a CP = 2 sweep holding a profiled async histogram C-layer point")
    args = parser.parse_args(argv)
    cal = Calibration.load(args.calibration)
    cfg = DSv4Config.preset("flash")
    one = [TOKENS]
    histogram = packing_lengths("histogram", TOKENS, cp=2, ratio=RATIO, seed=0)
    compare("one 64K document", read_profile(args.one_document_phases).table, one, cal, cfg)
    compare("histogram packing", histogram_phases(args.histogram_records), histogram, cal, cfg)
    print("\n== splits (fwd+bwd, align 8): rows per rank and predicted max/mean compute")
    rows = []
    for packing in ("one", "histogram"):
        for cp in (2, 4, 8):
            lengths = one if packing == "one" else packing_lengths("histogram", TOKENS, cp=cp, ratio=RATIO, seed=0)
            for label, c in (("bound", None), ("calibrated", cal)):
                table = compare_policies(cfg, RATIO, lengths, cp, Machine(), TOKENS, align=8, calibration=c)
                for row in table.itertuples():
                    rows.append({"packing": packing, "cp": cp, "model": label, "policy": row.policy,
                                 "rows_per_rank": "/".join(str(b - a) for a, b in zip(row.split[:-1], row.split[1:])),
                                 "max_ms": round(row.max_compute_s * 1e3, 2),
                                 "max/mean": round(row.compute_imbalance, 3)})
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
