"""Predict CP step times from each rank's measured compute plus the modelled communication, beside the
measured step where there is one.

Reads run directories (records.jsonl): real CP runs profiled with a trace (their per-rank compute from
the trace's per-step totals) and all-ranks emulations (``profile --cp N --emulate-rank all``: every rank's
compute measured on one device). The communication is the cost model's (all-gather / reduce-scatter sizes
at --machine's bandwidths, the halo at its P2P bandwidth), hidden by the compute the layer schedules while
each collective flies (docs/design.md). Examples:

  dsv4cp predict results/runs/h200x2-overlap
  dsv4cp predict runs/emulated --machine internode --bandwidth 40
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4cp.cli.common import add_machine_options, check_output_file, machine_from_args
from dsv4cp.records import read_records
from dsv4cp.sweeps.prediction import prediction_frame, worst_error_pct

HELP = "predict CP step times from per-rank compute (traced or emulated) plus modelled communication"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or records.jsonl files)")
    add_machine_options(parser)
    parser.add_argument("--csv", default=None, help="also write the table to this CSV file")


def run(args: argparse.Namespace) -> int:
    machine = machine_from_args(args)
    csv = check_output_file(args.csv, "--csv")
    for path in args.runs:
        if not path.exists():
            raise ValueError(f"runs: no such run directory or file {str(path)!r}")
    records = [record for path in args.runs for record in read_records(path)]
    frame = prediction_frame(records, machine)
    if frame.empty:
        print("no record with per-rank compute: profile CP runs with --trace-dir, or emulate every rank with "
              "'dsv4cp profile --cp N --emulate-rank all'")
        return 0
    print(f"communication modelled for machine {machine.name} (all-gather bus {machine.allgather_busbw / 1e9:.0f} "
          f"GB/s, P2P {machine.p2p_bandwidth / 1e9:.0f} GB/s)")
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    worst = worst_error_pct(frame)
    if worst == worst:  # not nan: some rows were measured
        print(f"worst |predicted - measured| / measured: {worst:.1f}%")
    if csv is not None:
        frame.to_csv(csv, index=False)
    return 0
