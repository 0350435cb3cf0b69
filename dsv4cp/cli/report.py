"""Write the report of one or more runs: ``summary.md``, tables (CSV + markdown) and PNG plots.

    dsv4cp report runs/smoke                      # -> runs/smoke/report/summary.md
    dsv4cp report runs/base runs/new --out cmp/   # two runs side by side

RUN_DIR is a sweep's run directory (``records.jsonl`` + ``meta.json``) or a bare ``.jsonl`` of records.
With exactly two runs (A, then B) the report adds ``tables/comparison.{csv,md}``: each matched point's
median step time in A and B, B / A and ``dsv4cp compare``'s verdict, then the points only one run
holds with how the nearest point of the other differs, and the runs' own differences (machine, commit)
in ``summary.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4cp.cli.common import check_output_dir

HELP = "summary.md, tables and plots of one or more sweep runs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories or .jsonl files")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: RUN_DIR/report for one run directory; required otherwise)")


def run(args: argparse.Namespace) -> int:
    from dsv4cp.report import load_runs, write_report

    runs = load_runs(args.runs)  # validates every input before anything is written
    out = args.out
    if out is None:
        if len(args.runs) != 1 or not args.runs[0].is_dir():
            given = [str(r) for r in args.runs]
            raise ValueError(f"--out: required with several runs or a .jsonl file, got runs={given}")
        out = args.runs[0] / "report"
    print(write_report(runs, check_output_dir(out, "--out")))
    return 0
