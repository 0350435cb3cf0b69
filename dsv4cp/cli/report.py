"""Write the report of one or more runs: ``summary.md``, tables (CSV + markdown) and PNG plots.

    dsv4cp report runs/smoke                      # -> runs/smoke/report/summary.md
    dsv4cp report runs/base runs/new --out cmp/   # two runs side by side

RUN_DIR is a sweep's run directory (``records.jsonl`` + ``meta.json``) or a bare ``.jsonl`` of records.
With exactly two runs (A, then B) the report adds ``tables/comparison.{csv,md}``: each matched point's
median step time in A and B, B / A and ``dsv4cp compare``'s verdict, then the points only one run
holds with how the nearest point of the other differs, and the runs' own differences (machine, commit)
in ``summary.md``. Every record is checked as it is read: a line that is not a valid record is named
(``file:line: reason``) on stderr, left out of the report and counted (a line repeating an earlier
record counts once); a record's value that no measurement can hold (a NaN throughput, an imbalance below
1, a negative peak) is blanked, named in the headline and never judged against a target. The report is
still written, and the exit status is 1 only with ``--strict``. The same run given twice (``runs/X
./runs/X``, or a copy of it) is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsv4cp.cli.common import check_output_dir

HELP = "summary.md, tables and plots of one or more sweep runs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories or .jsonl files")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: RUN_DIR/report for one run directory; required otherwise)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when any line of the records was skipped as invalid or a record holds an "
                             "impossible value (the report is still written)")


def print_skipped(problems: list, strict: bool) -> None:
    """Name every skipped line on stderr, then count them (what ``--strict`` turns into exit 1)."""
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} invalid record line(s) skipped" + ("; --strict: exit 1" if strict else ""),
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from dsv4cp.report import load_runs, write_report

    problems: list = []
    runs = load_runs(args.runs, problems)  # validates every input before anything is written
    out = args.out
    if out is None:
        if len(args.runs) != 1 or not args.runs[0].is_dir():
            given = [str(r) for r in args.runs]
            raise ValueError(f"--out: required with several runs or a .jsonl file, got runs={given}")
        out = args.runs[0] / "report"
    print(write_report(runs, check_output_dir(out, "--out")))
    print_skipped(problems, args.strict)
    impossible = int(runs["invalid"].notna().sum())
    if impossible:
        print(f"{impossible} record(s) hold values no measurement can (blank in the report, named in its headline)"
              + ("; --strict: exit 1" if args.strict else ""), file=sys.stderr)
    return 1 if (problems or impossible) and args.strict else 0
