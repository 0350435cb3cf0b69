"""Predict CP step times from each rank's measured compute plus the modelled communication, beside the
measured step where there is one.

Reads run directories (records.jsonl): real CP runs profiled with a trace (their per-rank compute from
the trace's per-step totals) and all-ranks emulations (``profile --cp N --emulate-rank all``: every rank's
compute measured on one device). The communication is the cost model's (all-gather / reduce-scatter sizes
at the bandwidths of the machine the records were measured on: their bound's machine, else the preset of
the GPU their machine label names; --machine overrides; the halo at its P2P bandwidth), hidden by the
compute the layer schedules while each collective flies (docs/design.md). Examples:

  dsv4cp predict results/runs/h200x2-overlap
  dsv4cp predict runs/emulated --machine internode --bandwidth 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from dsv4cp.cli.common import add_machine_options, check_output_file, machine_from_args
from dsv4cp.model.machine import Machine, record_preset
from dsv4cp.sweeps.prediction import prediction_frame, worst_error_pct

HELP = "predict CP step times from per-rank compute (traced or emulated) plus modelled communication"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or records.jsonl files)")
    add_machine_options(parser)
    parser.add_argument("--csv", default=None, help="also write the table to this CSV file")


def run(args: argparse.Namespace) -> int:
    from dsv4cp.report.load import read_runs

    csv = check_output_file(args.csv, "--csv")
    problems: list = []
    records = [record for run in read_runs(args.runs, problems) for record in run.records]
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    given = args.machine is not None or args.machine_file is not None
    groups = {"": records} if given else _by_record_machine(records)
    frames = []
    for preset, group in groups.items():
        machine = machine_from_args(args) if given else Machine.preset(preset, _bandwidth(args))
        frame = prediction_frame(group, machine)
        if frame.empty:
            continue
        whose = "as --machine says" if given else (
            f"the machine the records were measured on ({group[0].get('machine')}; --machine overrides)")
        print(f"communication modelled for machine {machine.name}, {whose}: all-gather bus "
              f"{machine.allgather_busbw / 1e9:.0f} GB/s, P2P {machine.p2p_bandwidth / 1e9:.0f} GB/s")
        frames.append(frame.assign(machine=machine.name))
    if not frames:
        print("no record with per-rank compute: profile CP runs with --trace-dir, or emulate every rank with "
              "'dsv4cp profile --cp N --emulate-rank all'")
        return 0
    frame = pd.concat(frames, ignore_index=True)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    worst = worst_error_pct(frame)
    if worst == worst:  # not nan: some rows were measured
        print(f"worst |predicted - measured| / measured: {worst:.1f}%")
    if csv is not None:
        frame.to_csv(csv, index=False)
    return 0


def _bandwidth(args: argparse.Namespace) -> float | None:
    return None if args.bandwidth is None else args.bandwidth * 1e9


def _by_record_machine(records: list[dict]) -> dict[str, list[dict]]:
    """The records by the preset of the machine they were measured on (:func:`record_preset`), so a
    committed H200 run is modelled at the H200's ceilings wherever this runs; ``ValueError`` naming a
    record's machine that has none, before anything is predicted."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        preset = record_preset(record.get("bound_machine"), record.get("machine"))
        if preset is None:
            raise ValueError(f"--machine: record {record.get('point_id')} ran on {record.get('machine')!r}, a "
                             "machine without a preset of ceilings: pass --machine or --machine-file")
        groups.setdefault(preset, []).append(record)
    return groups
