"""Compare a NEW run against a BASELINE: fail on a regression that is both significant and large, or on
a value that cannot be a measurement.

    dsv4cp compare results/baselines/h200/cp_scaling runs/cp_scaling --max-regression 5%
    dsv4cp compare runs/topk-radix runs/topk-packed --ignore-option topk_impl
    dsv4cp compare base_bench.json new_bench.json --json bench_action.json

BASELINE and NEW are run directories (``records.jsonl`` + ``meta.json``), ``.jsonl`` record files, or
pytest-benchmark JSON files. A point regresses when it is slower than the baseline by more than
``--max-regression`` AND the one-sided Mann-Whitney U test on both sides' repetition times
(``time_ms_samples``) is significant at ``--alpha`` divided by the number of points; records without
samples fall back to "outside both p20..p80 bands", and the output says which points did.
Exit status: 0 no regression; 1 a point regressed, failed in NEW, holds an invalid value (non-finite,
negative, outside its own band or samples, recorded twice) on either side, is missing from NEW with
``--fail-on-missing``, or a line was skipped with ``--strict``; 2 unusable input (no comparable point:
no match, only configuration differences, different hardware without ``--allow-different-hardware``,
a missing metric).
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
                        help="minimum slowdown that counts as a regression (with a significant test): 5%% or 0.05")
    parser.add_argument("--alpha", default="0.01", metavar="P",
                        help="false-alarm level of the rank test over all points (Bonferroni; default 0.01)")
    parser.add_argument("--ignore-option", action="append", default=[], metavar="KEY",
                        help="compare points whose configuration differs in KEY (an option such as "
                             "topk_impl, kernel_options.topk_impl, backends.sparse_attention.fwd, a whole "
                             "column kernel_options / backends, or fresh_batches); repeatable")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write NEW's values in github-action-benchmark's custom JSON format")
    parser.add_argument("--allow-different-hardware", action="store_true",
                        help="compare runs whose machine labels differ")
    parser.add_argument("--fail-on-missing", action="store_true",
                        help="also exit 1 when a point of BASELINE is missing from NEW (e.g. a sweep cut short)")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 when a line of either side was skipped as no valid record")


def parse_alpha(text: str) -> float:
    """``--alpha`` as a number in (0, 1); ``ValueError`` naming the flag otherwise."""
    try:
        alpha = float(text)
    except ValueError:
        raise ValueError(f"--alpha: expected a number in (0, 1) like 0.01, got {text!r}") from None
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha: must lie in (0, 1), got {text!r}")
    return alpha


def run(args: argparse.Namespace) -> int:
    from dsv4cp.report.compare import benchmark_action_json, compare, load_side, parse_threshold, render

    threshold, alpha = parse_threshold(args.max_regression), parse_alpha(args.alpha)
    check_output_file(args.json, "--json")
    baseline, new = load_side(args.baseline, args.metric), load_side(args.new, args.metric)
    comparison = compare(baseline, new, args.metric, threshold=threshold, alpha=alpha,
                         ignore_options=args.ignore_option, allow_different_hardware=args.allow_different_hardware)
    print(render(comparison, baseline, new))
    if args.json is not None:
        args.json.write_text(json.dumps(benchmark_action_json(comparison), indent=2) + "\n")
    missing = args.fail_on_missing and comparison.missing
    if missing:
        print(f"MISSING: {len(comparison.missing)} point(s) of BASELINE without a value in NEW (--fail-on-missing)")
    skipped = args.strict and comparison.skipped
    if skipped:
        print(f"SKIPPED: {len(comparison.skipped)} invalid line(s) (--strict)")
    return 1 if len(comparison.regressions) or len(comparison.errors) or missing or skipped else 0
