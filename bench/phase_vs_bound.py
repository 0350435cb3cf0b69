"""Measured per-phase compute beside the cost model's per-phase bound, for each profiled point of a run:
which phases hold the time above 2x their bound.

    python -m bench.phase_vs_bound RUN_DIR_OR_RECORDS_JSONL [--phases OVERLAP_CSV]

The bound of every phase is the one of the record's own configuration (preset, ratio, tokens, packing,
cp, split, loss; :func:`dsv4cp.report.tables.point_estimate`) on the H200 ceilings (``h200x2``): the
measured phases are an H200's. The measured compute per phase is the record's ``phases`` (rank 0, per
step), or the ``overlap.csv`` of its trace when ``--phases`` is given (one profiled point only).
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from dsv4cp.model import Machine
from dsv4cp.model.costs import measured_phase, phase_measured_in
from dsv4cp.report.load import load_runs
from dsv4cp.report.tables import point_estimate

H200 = Machine.preset("h200x2")


def phase_table(point: pd.Series, measured: pd.DataFrame) -> pd.DataFrame:
    """Rows ``phase, measured_ms, bound_ms, ratio, above_2x_ms`` of rank 0's compute phases, largest
    first. A range's time faces the bounds of the model phases whose work it times
    (:func:`dsv4cp.model.costs.measured_phase`, :func:`~dsv4cp.model.costs.phase_measured_in`): the top-k's
    own scoring is priced inside ``indexer.topk.fwd`` (it runs there), and the loss's differentiable scores
    with the loss (``indexer.loss.DIR (+ indexer.score.DIR)``)."""
    bounds = point_estimate(point, H200).phase_table()
    bound_ms: dict[tuple[str, str], float] = {}
    for r in bounds.itertuples():
        key = phase_measured_in(r.phase, r.direction)
        bound_ms[key] = bound_ms.get(key, 0.0) + r.max_rank_bound_s * 1e3
    measured = measured[(measured["rank"] == 0) & measured["phase"].str.startswith("dsv4cp.")]
    rows: dict[str, list[float]] = {}
    for r in measured.itertuples():
        name = r.phase.removeprefix("dsv4cp.")
        phase = measured_phase(name)
        label = name
        if phase is not None and phase[0] == "indexer.loss":
            label = f"indexer.loss.{phase[1]} (+ indexer.score.{phase[1]})"
        bound = bound_ms.get(phase, float("nan")) if phase is not None else float("nan")
        entry = rows.setdefault(label, [0.0, bound])
        entry[0] += r.compute_ms
    table = pd.DataFrame([(k, *v) for k, v in rows.items()], columns=["phase", "measured_ms", "bound_ms"])
    table["ratio"] = table["measured_ms"] / table["bound_ms"]
    table["above_2x_ms"] = (table["measured_ms"] - 2 * table["bound_ms"]).clip(lower=0)
    return table.sort_values("measured_ms", ascending=False)


def _title(point: pd.Series) -> str:
    return (f"{point['preset']} r{point['ratio']} cp{point['cp']} {point['tokens']} tokens {point['packing']} "
            f"{point['pass']} {point['dtype']} {point['kernel_backend']} (point {point['point_id']}): "
            f"step {point['time_ms_median']:.1f} ms, bound {point['bound_measured_ms']:.1f} ms")  # the
    # phases' bounds here are at the measured ceilings (h200x2) too; the physical bound is the report's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.phase_vs_bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a profile's --out directory or its records.jsonl")
    parser.add_argument("--phases", help="an overlap.csv to read the measured phases from (one point only)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    points = load_runs(args.run)
    points = points[(points["status"] == "ok") & points["phases"].map(lambda p: isinstance(p, list)).astype(bool)]
    if args.phases is not None and len(points) != 1:
        parser.error(f"--phases: the run must hold one profiled point, it holds {len(points)}")
    for _, point in points.iterrows():
        measured = pd.read_csv(args.phases) if args.phases else pd.DataFrame(point["phases"])
        table = phase_table(point, measured)
        print(_title(point))
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print(f"sum measured {table['measured_ms'].sum():.1f} ms, sum of bounds {table['bound_ms'].sum():.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
