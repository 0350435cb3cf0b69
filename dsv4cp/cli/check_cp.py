"""Check that CP reproduces CP = 1: output, input gradient, indexer loss, summed parameter gradients.

Spawns --cp local ranks itself, or runs as one rank per process under torchrun. Exit code 1 when any
quantity misses its tolerance (fp64 1e-10, fp32 1e-5 relative; bf16 cosine similarity > 1 - 1e-3).
Examples:

  dsv4cp check-cp --cp 2 --lengths 5,127,0,300
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --dist-backend nccl --preset flash --ratio 4 \\
      --tokens 16384 --packing histogram --dtype bf16

Every rank also runs the CP = 1 reference on the whole batch, so memory grows with --tokens, not
--tokens / cp. --tokens defaults to 300 (the tiny preset checks in seconds on a CPU).
"""

from __future__ import annotations

import argparse

import torch

from dsv4cp import kernel_options
from dsv4cp.cli.common import (
    add_dist_backend_option,
    add_layer_options,
    add_memory_options,
    check_memory,
    gather_torchrun_ranks,
    kernel_option_values,
    kernels_line,
    layer_inputs,
    positive_int,
    resolve_dist_backend,
    torchrun_world,
)
from dsv4cp.config import DTYPES
from dsv4cp.cp.check import CheckCase, merge_ranks, run_rank, tolerance_summary
from dsv4cp.cp.check import build_case as build_layer_inputs
from dsv4cp.cp.launch import spawn, under_torchrun
from dsv4cp.cp.layout import split_rows
from dsv4cp.cp.partition import POLICIES
from dsv4cp.model.partition import partition
from dsv4cp.profiling.compilation import COMPILE_BACKENDS, Explanation, check_compile_backend, explain_breaks

HELP = "compare a CP run against CP = 1 (output, gradients, indexer loss)"

DEFAULT_CP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=positive_int, default=None,
                        help=f"local ranks to spawn (default: {DEFAULT_CP}); under torchrun the world size is used")
    # fp32 on every device: CP must reproduce CP = 1 to 1e-5 there; bf16 is judged by cosine only
    add_layer_options(parser, tokens=300, dtype="fp32")
    parser.add_argument("--partition", choices=POLICIES, default="equal",
                        help="row split over the ranks: equal (T / cp rows each) or balanced (contiguous "
                             "slices sized so every rank's modelled fwd+bwd time is the same)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help=f"run the CP layer under torch.compile (BACKEND one of {', '.join(COMPILE_BACKENDS)}; "
                             "default inductor) against the eager CP = 1 layer, and list the graph breaks")
    add_dist_backend_option(parser)
    add_memory_options(parser)


def build_case(args: argparse.Namespace, cp: int, device: torch.device) -> CheckCase:
    """Validate everything on the host, before any process or collective starts."""
    inputs = layer_inputs(args, cp)
    if args.compile is not None:
        check_compile_backend(args.compile, "--compile")
    if args.partition == "equal":
        split_rows(inputs.packed.total, cp, inputs.cfg, args.ratio, field="--tokens")
    check_memory(inputs, args.ratio, 1, backward=True, dtype=DTYPES[args.dtype], recompute=args.recompute,
                 device=device, force=args.force)  # each rank also runs the whole-batch reference
    case = CheckCase(
        preset=args.preset, ratio=args.ratio, lengths=tuple(inputs.lengths), total=inputs.packed.total,
        pad_to_multiple=args.pad_to_multiple, dtype=args.dtype, overlap=args.overlap, recompute=args.recompute,
        backend=args.kernel_backend, seed=args.seed, config_overrides={"indexer_loss": args.loss},
        partition=args.partition, compile=args.compile,
        split=partition(inputs.packed, cp, inputs.cfg, args.ratio, policy=args.partition).bounds,
    )
    case.row_split(cp)  # a balanced split that cannot give every rank its halo fails here, not in the ranks
    return case


def checked_rank(rank: int, world: int, device: torch.device, case: CheckCase, options: dict[str, str]):
    """``(run_rank's result, what ran)`` with the kernel options ``options`` in force: a spawned rank
    starts without its parent's ``--kernel-option`` values."""
    with kernel_options.overrides(options):
        kernel_options.reset_backends_ran()
        return run_rank(rank, world, device, case), kernel_options.backends_ran()


def run(args: argparse.Namespace) -> int:
    options = kernel_option_values(args)
    backend = resolve_dist_backend(args, distributed=True)  # before any process group exists
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    if under_torchrun():
        world = torchrun_world(args.cp)
        case = build_case(args, world, device)
        rank, gathered = gather_torchrun_ranks(
            args, backend, lambda rank, world, device: checked_rank(rank, world, device, case, options))
        if rank != 0:
            return 0
    else:
        world = args.cp or DEFAULT_CP
        case = build_case(args, world, device)
        gathered = spawn(checked_rank, world, case, options, backend=backend)
    results = merge_ranks([result for result, _ in gathered])
    tol = tolerance_summary(case.dtype)
    print(f"check-cp preset={case.preset} ratio={case.ratio} cp={world} docs={len(case.lengths)} "
          f"tokens={case.total} dtype={case.dtype} overlap={case.overlap} recompute={case.recompute} "
          f"loss={args.loss} partition={case.partition} split={case.row_split(world).bounds} ({tol})")
    print(f"{kernels_line(gathered[0][1])} (rank 0)")
    print(f"{'quantity':<14}{'max_rel_error':>15}{'cosine':>14}  result")
    for c in results:
        worst = f"  (worst: {c.worst})" if c.worst and c.worst != c.quantity else ""
        print(f"{c.quantity:<14}{c.max_rel_error:>15.3e}{c.cosine:>14.9f}  {'ok' if c.passed else 'FAIL'}{worst}")
    if case.compile is not None:
        print(f"compiled with {case.compile}; graph breaks of the CP = 1 forward:")
        print("\n".join(_breaks_at_one_rank(case, device).lines()))
    return 0 if all(c.passed for c in results) else 1


def _breaks_at_one_rank(case: CheckCase, device: torch.device) -> Explanation:
    """Where Dynamo breaks the graph of the layer's forward (one rank: no process group needed)."""
    layer, packed, x, _ = build_layer_inputs(case, device)
    return explain_breaks(layer, x, packed)
