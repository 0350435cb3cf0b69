"""Compute/communication breakdown and overlap per rank and phase, from a profiled run (docs/design.md §5).

PATH is either a directory of Kineto (torch.profiler) Chrome-trace files, one per rank
(``rank{R}.json``, as written by ``dsv4cp.profiling.trace.capture_trace``), or an Nsight Systems
SQLite export (``nsys export --type sqlite``), or a directory of per-rank exports. Prints one row
per (rank, phase) and a ``total`` row per rank, then one line per rank with the step's time in no
phase and with no kernel running, against the targets (at most 5% of the step unattributed, at most
3% idle). Times are milliseconds PER STEP: each rank's sums are divided by the steps its trace holds
(its instances of the ``dsv4cp.step`` range; a trace without them counts as one step), so the table
is the one 'dsv4cp profile' printed for the same trace. Example:

  dsv4cp overlap traces/ --csv overlap.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4cp.cli.common import check_output_file
from dsv4cp.profiling.nvtx import full_name
from dsv4cp.profiling.overlap import (
    COLUMNS,
    KernelRecord,
    RangeRecord,
    attribution_lines,
    attribution_table,
    overlap_table,
)

HELP = "compute/comm overlap per rank and phase from Kineto traces or an nsys SQLite export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="directory of per-rank Kineto JSON traces, or an nsys .sqlite file")
    parser.add_argument("--csv", type=Path, metavar="OUT",
                        help="also write the per-step table to this CSV file (default: print only)")


def load_records(path: Path) -> tuple[list[KernelRecord], list[RangeRecord]]:
    """The kernels and ranges of PATH, choosing the reader by what PATH holds."""
    from dsv4cp.profiling.nsys import load_nsys_files
    from dsv4cp.profiling.trace import TRACE_SUFFIXES, load_kineto_dir

    if not path.exists():
        raise ValueError(f"PATH: {path} does not exist")
    if path.is_file():
        if path.suffix != ".sqlite":
            raise ValueError(
                f"PATH: {path} is a file but not an nsys .sqlite export (give a directory of Kineto traces)"
            )
        return load_nsys_files(path)
    names = [p.name for p in path.iterdir() if p.is_file()]
    if any(name.endswith(TRACE_SUFFIXES) for name in names):
        return load_kineto_dir(path)
    if any(name.endswith(".sqlite") for name in names):
        return load_nsys_files(path)
    raise ValueError(f"PATH: {path} holds neither Kineto traces (*.json, *.json.gz) nor nsys exports (*.sqlite)")


PER_STEP_COLUMNS = tuple(column for column in COLUMNS if column.endswith("_ms"))
"""The overlap table's times, summed over a trace's steps by ``overlap_table``; ratios are per-step already."""


def traced_steps(ranges: list[RangeRecord], step_range: str) -> dict[int, int]:
    """Rank -> how many instances of ``step_range`` its trace holds (at least 1: a trace without the
    range is one step)."""
    counts: dict[int, int] = {}
    for r in ranges:
        counts.setdefault(r.rank, 0)
        counts[r.rank] += r.name == step_range
    return {rank: max(1, count) for rank, count in counts.items()}


def per_step_table(kernels: list[KernelRecord], ranges: list[RangeRecord], step_range: str):
    """The overlap table of the trace with every time divided by its rank's step count."""
    table = overlap_table(kernels, ranges)
    steps = table["rank"].map(traced_steps(ranges, step_range)).fillna(1)
    for column in PER_STEP_COLUMNS:
        table[column] = table[column] / steps
    return table


def run(args: argparse.Namespace) -> int:
    check_output_file(args.csv, "--csv")  # before reading: a bad --csv must not cost the table
    kernels, ranges = load_records(args.path)
    table = per_step_table(kernels, ranges, full_name("step"))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))  # as 'dsv4cp profile' prints it
    print("\n".join(attribution_lines(attribution_table(kernels, ranges, full_name("step")))))
    if args.csv is not None:
        table.to_csv(args.csv, index=False)
    return 0
