"""Compare a NEW run against a BASELINE and fail on a regression beyond the threshold and the noise.

    dsv4cp compare results/baselines/h200/cp_scaling runs/cp_scaling --max-regression 5%
    dsv4cp compare base_bench.json new_bench.json --json bench_action.json

BASELINE and NEW are run directories (``records.jsonl`` + ``meta.json``), ``.jsonl`` record files, or
pytest-benchmark JSON files. Exit status: 0 no regression, 1 a matched point regressed beyond
``--max-regression`` and outside both noise bands (or failed in NEW; with ``--fail-on-missing``, or is
absent from NEW), 2 unusable input (no matched point, different hardware without
``--allow-different-hardware``, a missing metric).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv4cp.cli.common import check_output_file

HELP = "compare a new run (or pytest-benchmark JSON) against a baseline; exit 1 on a regression"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", type=Path, metavar="BASELINE", help="the reference run")
    parser.add_argument("new", type=Path, metavar="NEW", help="the run compared against BASELINE")
    parser.add_argument("--metric", default="time_ms_median",
                        help="record metric to compare (pytest-benchmark JSON: time_ms_median, _mean or _min)")
    parser.add_argument("--max-regression", default="5%", metavar="PCT",
                        help="allowed slowdown before a point counts as a regression: 5%% or 0.05")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write NEW's values in github-action-benchmark's custom JSON format")
    parser.add_argument("--allow-different-hardware", action="store_true",
                        help="compare runs whose machine labels differ")
    parser.add_argument("--fail-on-missing", action="store_true",
                        help="also exit 1 when a point of BASELINE is missing from NEW (e.g. a sweep cut short)")


def run(args: argparse.Namespace) -> int:
    from dsv4cp.report.compare import benchmark_action_json, compare, load_side, parse_threshold, render

    threshold = parse_threshold(args.max_regression)
    check_output_file(args.json, "--json")
    baseline, new = load_side(args.baseline, args.metric), load_side(args.new, args.metric)
    comparison = compare(baseline, new, args.metric, threshold=threshold,
                         allow_different_hardware=args.allow_different_hardware)
    print(render(comparison, baseline, new))
    if args.json is not None:
        args.json.write_text(json.dumps(benchmark_action_json(comparison), indent=2) + "\n")
    missing = args.fail_on_missing and comparison.baseline_only
    if missing:
        print(f"MISSING: {len(comparison.baseline_only)} point(s) of BASELINE not in NEW (--fail-on-missing)")
    return 1 if len(comparison.regressions) or missing else 0
