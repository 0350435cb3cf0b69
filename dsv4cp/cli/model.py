"""Analytic cost model of one layer: per-phase FLOPs, HBM bytes, communication and roofline bounds.

Computed in closed form over documents (no tensors), so any CP size and batch size is instant.
Examples:

  dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2
  dsv4cp model --preset flash --ratio 4 --tokens 262144 --cp 64 --machine internode --bandwidth 40
  dsv4cp model --preset flash --ratio 4 --packing histogram --extrapolate --machine internode
  dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 8 --partition balanced --align 8
  dsv4cp model --cp 1 --machine h200x2 --calibrate results/2026-12-01-h200-cp1-after-fixes/trace --indexer-scan prefix \
      --calibration-out cal.json
  dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2 --partition balanced --calibration cal.json
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

from dsv4cp.cli.common import (
    add_machine_options,
    add_renamed_option,
    check_output_file,
    int_list,
    machine_from_args,
    non_negative_int,
    parse_lengths,
    positive_int,
)
from dsv4cp.config import LOSS_VARIANTS, PRESET_NAMES, DSv4Config
from dsv4cp.cp.partition import POLICIES, RowSplit
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.model import BOTH, Machine, estimate, extrapolate
from dsv4cp.model.calibration import (
    Calibration,
    check_profile_point,
    class_times,
    fit,
    model_class_times,
    read_profile,
)
from dsv4cp.model.extrapolate import DEFAULT_CPS, DEFAULT_TOKENS
from dsv4cp.model.machine import GB, no_machine_reason
from dsv4cp.model.memory import peak_bytes_estimate
from dsv4cp.model.partition import compare_policies
from dsv4cp.model.phase_classes import INDEXER_SCANS
from dsv4cp.packing import PackedSeqs
from dsv4cp.workloads import PACKINGS, pack_lengths

HELP = "analytic per-phase FLOPs, bytes, communication and lower bounds of one layer (no GPU needed)"

MiB = float(1 << 20)
POLICY_MAX_ROWS = 1 << 27
"""Above this many rows the split policies are not compared: the balanced split needs per-row cost
arrays (8 bytes x T each), while the equal split's model is closed-form over documents."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # flash by default, unlike the measuring commands (tiny): the model is instant at any size and
    # is meant to show the cost of the real checkpoint
    parser.add_argument("--preset", choices=PRESET_NAMES, default="flash", help="layer dimensions (config preset)")
    parser.add_argument("--ratio", type=non_negative_int, default=4,
                        help="compress ratio: 0 (W: window only), 4 (C: indexer top-k) or another (H)")
    parser.add_argument("--tokens", type=positive_int, default=65536, help="packed rows T of the batch")
    parser.add_argument("--cp", type=positive_int, default=2, help="context-parallel size")
    parser.add_argument("--packing", choices=PACKINGS, default="one", help="how --tokens splits into documents")
    parser.add_argument("--doc-len", type=positive_int, default=4096, help="document length of --packing fixed")
    parser.add_argument("--lengths", type=str, default=None,
                        help="comma-separated document lengths (overrides --packing; total --tokens)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the histogram packings")
    parser.add_argument("--loss", choices=LOSS_VARIANTS, default="sparse", help="indexer loss variant (C layers)")
    add_renamed_option(parser, "--indexer-loss", "--loss")
    add_machine_options(parser)
    parser.add_argument("--partition", choices=POLICIES, default="equal",
                        help="row split over the ranks: equal (T / cp rows each) or balanced (contiguous slices "
                             "sized so every rank's modelled fwd+bwd time is the same, refined on the model's "
                             "per-rank evaluation); both are compared, with the unrefined per-row split")
    parser.add_argument("--align", type=positive_int, default=1,
                        help="balanced split points on multiples of this many rows (e.g. 8 or the ratio)")
    parser.add_argument("--calibration", default=None,
                        help="JSON of measured/bound factors per phase class (from --calibrate): the balanced "
                             "split and the policy table use calibrated (measured-like) phase times")
    parser.add_argument("--calibrate", default=None, metavar="PROFILE",
                        help="fit a calibration from a profile's per-phase times (overlap.csv, records.jsonl or "
                             "their directory) measured at this command's point (--preset ... --cp; a profile "
                             "of another preset, ratio or token count is refused); prints the factors, warns on "
                             "any below 1, and writes them to --calibration-out")
    parser.add_argument("--calibration-out", default=None, help="JSON file that --calibrate writes")
    parser.add_argument("--indexer-scan", choices=INDEXER_SCANS, default="visible",
                        help="entries the profiled indexer top-k scanned per query (--calibrate): visible (its "
                             "document's, the model's count), prefix (the batch's before it: the Triton kernel's "
                             "and torch top-k's static plans) or all (the batch's: the torch top-k without a row "
                             "limit)")
    parser.add_argument("--per-rank", action="store_true", help="print every (rank, phase, direction) record")
    parser.add_argument("--csv", default=None, help="write the records (or the extrapolation) to this CSV")
    parser.add_argument("--extrapolate", action="store_true",
                        help="sweep --cps x --sweep-tokens (or --tokens-per-rank) instead of one point")
    parser.add_argument("--cps", type=int_list, default=list(DEFAULT_CPS), help="CP sizes of --extrapolate")
    parser.add_argument("--sweep-tokens", type=int_list, default=list(DEFAULT_TOKENS),
                        help="total tokens of --extrapolate (strong scaling)")
    parser.add_argument("--tokens-per-rank", type=int_list, default=None,
                        help="tokens per rank of --extrapolate (weak scaling; overrides --sweep-tokens)")
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd", help="direction of --extrapolate")


def run(args: argparse.Namespace) -> int:
    check_output_file(args.csv, "--csv")
    check_output_file(args.calibration_out, "--calibration-out")
    if (args.calibrate is None) != (args.calibration_out is None):
        raise ValueError("--calibrate: needs --calibration-out (and --calibration-out needs --calibrate)")
    cfg = DSv4Config.preset(args.preset, indexer_loss=args.loss)
    cfg.check_ratio(args.ratio)
    calibration = None if args.calibration is None else Calibration.load(args.calibration)
    note = None if calibration is None else calibration.rank_factors_note(args.cp)
    if note is not None:
        print(note)
    machine = machine_from_args(args, calibration)
    if machine is None:  # every figure below is a bound: there is nothing to print without ceilings
        raise ValueError(f"--machine: {no_machine_reason()}")
    if args.extrapolate:
        return _run_extrapolate(args, cfg, machine)

    if args.lengths is not None:
        lengths = parse_lengths(args.lengths)
    else:
        # --doc-len is the fixed packing's; adversarial is built for this --cp and --ratio, as the sweeps build it
        lengths = pack_lengths(args.tokens, args.packing, doc_len=args.doc_len if args.packing == "fixed" else None,
                               seed=args.seed, cp=args.cp, ratio=args.ratio)
    if args.calibrate is not None:
        return _run_calibrate(args, cfg, machine, lengths)
    policies = None
    if args.partition != "equal" or args.tokens <= POLICY_MAX_ROWS:
        if args.tokens > POLICY_MAX_ROWS:
            raise ValueError(f"--partition: balanced needs per-row costs, at most {POLICY_MAX_ROWS} rows, "
                             f"got --tokens {args.tokens}")
        policies = compare_policies(cfg, args.ratio, lengths, args.cp, machine, total=args.tokens, align=args.align,
                                    calibration=calibration, kernel_options=KernelOptions.resolve())
        split = RowSplit(policies.set_index("policy").loc[args.partition]["split"])
    else:  # closed form over documents only: exact at any size
        split = None
    est = estimate(cfg, args.ratio, lengths, args.cp, machine, total=args.tokens, split=split,
                   kernel_options=KernelOptions.resolve())
    c = est.counts
    _print_machine(machine)  # only once the inputs proved valid: an error prints nothing else
    rows = f"rows/rank={c.rows}" if args.partition == "equal" else f"rows/rank={','.join(map(str, c.rank_rows))}"
    print(f"layer: preset={args.preset} ratio={args.ratio} kind={est.kind} tokens={c.total} cp={c.cp} "
          f"{rows} docs={c.n_docs} halo={c.halo} capacity={c.capacity} "
          f"packing={'lengths' if args.lengths else args.packing} partition={args.partition}")
    if args.partition != "equal":
        print(f"split points: {', '.join(map(str, split.bounds))}")
    with pd.option_context("display.width", 200, "display.max_rows", 10_000, "display.max_columns", 50):
        if args.per_rank:
            print(_per_rank(est).to_string(index=False))
        else:
            print(_per_phase(est).to_string(index=False))
        print()
        print(_ranks(est).to_string(index=False))
    print()
    for direction in ("fwd", "bwd", BOTH):
        s = est.summary(direction)
        print(f"{direction:>7}: model {s.model_flops / 1e12:.3f} TFLOP (+{s.halo_flops / 1e9:.2f}"
              f" GFLOP halo), flops imbalance {s.flops_imbalance:.3f}, bound {s.bound_overlap_s * 1e3:.3f} ms "
              f"overlapped / {s.bound_serial_s * 1e3:.3f} ms serial (compute {s.compute_s * 1e3:.3f}, comm "
              f"{s.comm_s * 1e3:.3f}, attention {s.attention_s * 1e3:.3f}), time imbalance {s.time_imbalance:.3f}, "
              f"{s.model_tflops_per_gpu(s.bound_overlap_s) if s.bound_overlap_s > 0 else float('nan'):.0f} "
              f"TFLOP/s/GPU at the bound")
    if policies is not None:
        print()
        if calibration is not None:
            print(f"policies on calibrated phase times ({calibration.label}):")
        print(_policies(policies).to_string(index=False))
    packed = PackedSeqs.from_lengths(lengths, total=args.tokens)
    peaks = {d: peak_bytes_estimate(cfg, args.ratio, packed, args.cp, d, torch.bfloat16) / 2**30 for d in ("fwd", BOTH)}
    print(f" memory: estimated peak per rank in bf16: fwd {peaks['fwd']:.2f} GiB, fwd+bwd {peaks[BOTH]:.2f} GiB "
          f"(see dsv4cp.model.memory)")
    if args.csv:
        est.table().to_csv(args.csv, index=False)
        print(f"records written to {args.csv}")
    return 0


def _run_calibrate(args, cfg, machine, lengths) -> int:
    """Fit, print and save a calibration from the profile at ``--calibrate`` (measured at this point)."""
    if args.partition != "equal":
        raise ValueError("--calibrate: fits profiles of equal splits; drop --partition balanced")
    want = {"preset": args.preset, "ratio": args.ratio, "tokens": args.tokens, "packing": _packing_name(args),
            "loss": args.loss}
    if args.lengths is None and args.packing.startswith("histogram"):  # the seed draws the documents
        want["seed"] = args.seed
    profile = read_profile(args.calibrate, cp=args.cp, want=want)
    check_profile_point(profile, want)
    measured = profile.table
    est = estimate(cfg, args.ratio, lengths, args.cp, machine, total=args.tokens,
                   kernel_options=KernelOptions.resolve())
    source = (f"{args.calibrate} (preset={args.preset} ratio={args.ratio} tokens={args.tokens} cp={args.cp} "
              f"packing={'lengths' if args.lengths else want['packing']} loss={args.loss} "
              f"pass={profile.point.get('pass')} indexer_scan={args.indexer_scan})")
    calibration = fit(measured, est, source=source, indexer_scan=args.indexer_scan)
    _print_machine(machine)
    keys = ["rank", "phase_class", "direction"]
    both = class_times(measured).merge(model_class_times(est, args.indexer_scan), on=keys)
    table = both.groupby(["phase_class", "direction"], as_index=False)[["measured_ms", "bound_ms"]].sum()
    table["factor"] = [calibration.factor(c, d) for c, d in zip(table["phase_class"], table["direction"])]
    with pd.option_context("display.width", 200):
        print(table.round(3).to_string(index=False))
    calibration.save(args.calibration_out)
    print(f"calibration written to {args.calibration_out}")
    below = {key: f for key, f in sorted(calibration.factors.items()) if f < 1}
    if below:  # a lower bound cannot be beaten: the ceilings are not the profiled machine's, or the trace is wrong
        print(f"warning: calibration factor(s) below 1 ({', '.join(f'{k} {f:.3g}' for k, f in below.items())}): the "
              f"profile ran faster than the lower bound of machine {machine.name}; the bound's machine or the "
              "trace is wrong (profiled elsewhere? pass --machine)", file=sys.stderr)
    return 0


def _packing_name(args: argparse.Namespace) -> str:
    """The command's batch as a record's ``packing`` names it (``one``, ``fixed:<len>``, ``lengths:<a,b,...>``)."""
    if args.lengths is not None:
        return "lengths:" + ",".join(str(n) for n in parse_lengths(args.lengths))
    return f"fixed:{args.doc_len}" if args.packing == "fixed" else args.packing


def _print_machine(m: Machine) -> None:
    print(f"bounds for machine {m.name}: {m.peak_flops / 1e12:.3g} TFLOP/s, HBM {m.hbm_bandwidth / 1e12:.3g} TB/s, "
          f"all-gather busbw {m.allgather_busbw / GB:.3g} GB/s, P2P {m.p2p_bandwidth / GB:.3g} GB/s")


def _per_phase(est) -> pd.DataFrame:
    t = est.phase_table()
    return pd.DataFrame({
        "phase": t["phase"], "dir": t["direction"], "res": t["resource"],
        "GFLOP(sum)": (t["flops"] / 1e9).round(2), "halo_GFLOP": (t["redundant_flops"] / 1e9).round(3),
        "GFLOP(max)": (t["max_rank_flops"] / 1e9).round(2), "imbal": t["flops_imbalance"].round(3),
        "HBM_MiB(max)": (t["max_rank_hbm_bytes"] / MiB).round(2),
        "comm_MiB(max)": (t["max_rank_comm_bytes"] / MiB).round(3),
        "bound_us(max)": (t["max_rank_bound_s"] * 1e6).round(1),
    })


def _policies(table: pd.DataFrame) -> pd.DataFrame:
    """Predicted per-rank fwd+bwd compute bound under each split policy (max over ranks and max / mean)."""
    return pd.DataFrame({
        "partition": table["policy"], "min_rows": table["min_rows"], "max_rows": table["max_rows"],
        "max_compute_ms": (table["max_compute_s"] * 1e3).round(3),
        "mean_compute_ms": (table["mean_compute_s"] * 1e3).round(3),
        "max/mean": table["compute_imbalance"].round(3),
        "bound_overlap_ms": (table["max_bound_overlap_s"] * 1e3).round(3),
    })


def _per_rank(est) -> pd.DataFrame:
    t = est.table()
    return pd.DataFrame({
        "rank": t["rank"], "phase": t["phase"], "dir": t["direction"], "GFLOP": (t["flops"] / 1e9).round(3),
        "halo_GFLOP": (t["redundant_flops"] / 1e9).round(3), "HBM_MiB": (t["hbm_bytes"] / MiB).round(2),
        "comm_MiB": (t["comm_bytes"] / MiB).round(3), "bound_us": (t["time_lower_bound_s"] * 1e6).round(1),
        "limiter": t["limiter"],
    })


def _ranks(est) -> pd.DataFrame:
    t = est.rank_table()
    if est.cp > 16:  # summarise: first, last and slowest ranks
        keep = {0, est.cp - 1}
        both = t[t["direction"] == BOTH]
        keep.add(int(both.loc[both["bound_overlap_s"].idxmax(), "rank"]))
        t = t[t["rank"].isin(sorted(keep))]
    return pd.DataFrame({
        "rank": t["rank"], "dir": t["direction"], "TFLOP": (t["flops"] / 1e12).round(3),
        "comm_MiB": (t["comm_bytes"] / MiB).round(2), "compute_ms": (t["compute_s"] * 1e3).round(3),
        "comm_ms": (t["comm_s"] * 1e3).round(3), "bound_overlap_ms": (t["bound_overlap_s"] * 1e3).round(3),
        "bound_serial_ms": (t["bound_serial_s"] * 1e3).round(3),
    })


def _run_extrapolate(args, cfg, machine) -> int:
    table = extrapolate(
        cfg, args.ratio, args.packing, cps=args.cps, tokens=args.sweep_tokens, machine=machine,
        tokens_per_rank=args.tokens_per_rank, doc_len=args.doc_len, seed=args.seed, direction=args.direction,
        kernel_options=KernelOptions.resolve(),
    )
    if table.empty:
        raise ValueError("--extrapolate: no feasible (cp, tokens) point (tokens must divide by cp and "
                         "leave at least the halo per rank)")
    _print_machine(machine)
    shown = pd.DataFrame({
        "cp": table["cp"], "tokens": table["tokens"], "tok/rank": table["tokens_per_rank"], "docs": table["docs"],
        "attn_ms": (table["attention_s"] * 1e3).round(3), "compute_ms": (table["compute_s"] * 1e3).round(3),
        "comm_ms": (table["comm_s"] * 1e3).round(3), "comm_MiB": (table["comm_bytes_per_rank"] / MiB).round(1),
        "comm/attn": table["comm_over_attention"].round(2), "comm/compute": table["comm_over_compute"].round(2),
        "overlap_ms": (table["bound_overlap_s"] * 1e3).round(3), "serial_ms": (table["bound_serial_s"] * 1e3).round(3),
        "imbal": table["time_imbalance"].round(2), "TF/GPU": table["tflops_per_gpu_at_bound"].round(0),
    })
    print(f"extrapolation ({args.direction}): preset={args.preset} ratio={args.ratio} packing={args.packing}")
    with pd.option_context("display.width", 220, "display.max_rows", 10_000, "display.max_columns", 50):
        print(shown.to_string(index=False))
    cross = table[table["comm_exceeds_attention"]]
    if len(cross):
        where = "; ".join(
            f"cp={cp}: " + ",".join(str(v) for v in sorted(group["tokens_per_rank"]))
            for cp, group in cross.groupby("cp")
        )
        print(f"communication exceeds the attention bound at {len(cross)} of {len(table)} points "
              f"(tokens/rank) {where}")
    else:
        print("communication stays below the attention bound at every point")
    if args.csv:
        table.to_csv(args.csv, index=False)
        print(f"extrapolation written to {args.csv}")
    return 0
