"""Measured per-phase compute (a profile's overlap.csv, rank 0) beside the cost model's per-phase bound
(flash C layer, 64K tokens, one document, CP = 1, h200x2 ceilings): which phases hold the time above 2x.

    python -m bench.phase_vs_bound results/2026-12-01-h200-speed4/trace-auto/overlap.csv
"""

from __future__ import annotations

import sys

import pandas as pd

from dsv4cp.config import DSv4Config
from dsv4cp.model import Machine, estimate
from dsv4cp.model.costs import range_to_phase


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(__doc__)
    overlap_csv = argv[0]
    measured = pd.read_csv(overlap_csv)
    measured = measured[(measured["rank"] == 0) & measured["phase"].str.startswith("dsv4cp.")]
    # the H200's bounds wherever this runs (the measured phases are an H200's)
    bounds = estimate(DSv4Config.preset("flash"), 4, [65536], 1, Machine.preset("h200x2")).phase_table()
    bound_ms = {(r.phase, r.direction): r.max_rank_bound_s * 1e3 for r in bounds.itertuples()}
    rows: dict[str, list[float]] = {}
    for r in measured.itertuples():
        name = r.phase.removeprefix("dsv4cp.")
        phase = range_to_phase(name)
        if name == "indexer.topk.fwd":  # the selection's own scoring runs inside it (see model.calibration)
            label, bound = name, bound_ms[("indexer.score", "fwd")] + bound_ms[("indexer.topk", "fwd")]
        elif name.startswith(("indexer.score.", "indexer.loss.")):  # the loss's scores are part of the loss
            direction = name.rsplit(".", 1)[1]
            label = f"indexer.loss.{direction} (+ indexer.score.{direction})"
            bound = bound_ms[("indexer.loss", direction)]
        else:
            label, bound = name, bound_ms.get(phase, float("nan")) if phase is not None else float("nan")
        entry = rows.setdefault(label, [0.0, bound])
        entry[0] += r.compute_ms
    table = pd.DataFrame([(k, *v) for k, v in rows.items()], columns=["phase", "measured_ms", "bound_ms"])
    table["ratio"] = table["measured_ms"] / table["bound_ms"]
    table["above_2x_ms"] = (table["measured_ms"] - 2 * table["bound_ms"]).clip(lower=0)
    print(table.sort_values("measured_ms", ascending=False).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"sum measured {table['measured_ms'].sum():.1f} ms, sum of bounds {table['bound_ms'].sum():.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
