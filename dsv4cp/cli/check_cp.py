"""Check the layer (any kernels, any CP degree) against the fp64 reference layer: output, top-k selection,
indexer loss, input gradient, summed parameter gradients.

The reference is the same layer with the same weights and inputs in fp64 on the torch reference kernels,
at CP = 1 on the whole batch, made to select the checked layer's top-k entries (the selection is judged
apart). --cp 1 runs in this process; --cp N spawns N local ranks, or runs as one rank per process under
torchrun. Exit code 1 when any quantity misses its tolerance (relative norm error, per quantity and
dtype: docs/design.md). Examples:

  dsv4cp check-cp --cp 2 --lengths 5,127,0,300
  dsv4cp check-cp --cp 1 --preset flash --tokens 16384 --packing histogram --dtype bf16 --dist-backend nccl
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --dist-backend nccl --preset flash --ratio 4 \\
      --tokens 16384 --packing histogram --dtype bf16

Every rank also runs the fp64 reference on the whole batch, after its own step, so memory grows with
--tokens, not --tokens / cp. --tokens defaults to 300 (the tiny preset checks in seconds on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dsv4cp import kernel_options
from dsv4cp.cli.common import (
    add_dist_backend_option,
    add_layer_options,
    add_memory_options,
    case_from_args,
    check_memory,
    gather_torchrun_ranks,
    kernels_line,
    layer_inputs,
    positive_int,
    resolve_dist_backend,
    torchrun_world,
)
from dsv4cp.config import DTYPES
from dsv4cp.cp.launch import spawn, under_torchrun
from dsv4cp.cp.layout import split_rows
from dsv4cp.cp.partition import POLICIES
from dsv4cp.harness.build import build_case
from dsv4cp.harness.case import Case
from dsv4cp.harness.parity import merge_ranks, run_rank, tolerance_summary
from dsv4cp.model.partition import partition
from dsv4cp.profiling.compilation import COMPILE_BACKENDS, Explanation, check_compile_backend, explain_breaks

HELP = "compare the layer (any kernels, any CP degree) against the fp64 reference layer"

DEFAULT_CP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=positive_int, default=None,
                        help=f"local ranks to spawn (default: {DEFAULT_CP}); under torchrun the world size is used")
    # fp32 by default on every device (judged to ~1e-5 against fp64); --dtype bf16 for what a GPU trains in
    add_layer_options(parser, tokens=300, dtype="fp32")
    parser.add_argument("--partition", choices=POLICIES, default="equal",
                        help="row split over the ranks: equal (T / cp rows each) or balanced (contiguous "
                             "slices sized so every rank's modelled fwd+bwd time is the same)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help=f"run the CP layer under torch.compile (BACKEND one of {', '.join(COMPILE_BACKENDS)}; "
                             "default inductor) against the eager CP = 1 layer, and list the graph breaks")
    add_dist_backend_option(parser)
    add_memory_options(parser)


def checked_case(args: argparse.Namespace, cp: int, device: torch.device) -> Case:
    """Validate everything on the host, before any process or collective starts."""
    inputs = layer_inputs(args, cp)
    if args.compile is not None:
        check_compile_backend(args.compile, "--compile")
    if args.partition == "equal":
        split_rows(inputs.packed.total, cp, inputs.cfg, args.ratio, field="--tokens")
    check_memory(inputs, args.ratio, 1, backward=True, dtype=DTYPES["fp64"], recompute=False, device=device,
                 force=args.force)  # each rank runs the fp64 reference on the whole batch after its own step
    split = partition(inputs.packed, cp, inputs.cfg, args.ratio, policy=args.partition).bounds
    case = case_from_args(args, inputs, device=device, dtype=args.dtype, backward=True, split=split,
                          compile=args.compile)
    case.row_split(cp)  # a balanced split that cannot give every rank its halo fails here, not in the ranks
    return case


def checked_rank(rank: int, world: int, device: torch.device, case: Case):
    """``(run_rank's result, what ran)`` on one rank (the Case's kernel options are in force in the pass)."""
    kernel_options.reset_backends_ran()
    return run_rank(rank, world, device, case), kernel_options.backends_ran()


def run(args: argparse.Namespace) -> int:
    backend = resolve_dist_backend(args, distributed=True)  # before any process group exists
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    if under_torchrun():
        world = torchrun_world(args.cp)
        case = checked_case(args, _checked_world(args, world), device)
        rank, gathered = gather_torchrun_ranks(
            args, backend, lambda rank, world, device: checked_rank(rank, world, device, case))
        if rank != 0:
            return 0
    else:
        world = args.cp or DEFAULT_CP
        case = checked_case(args, _checked_world(args, world), device)
        if world == 1:  # one rank: no process group, in this process
            gathered = [checked_rank(0, 1, torch.device("cuda", 0) if device.type == "cuda" else device, case)]
        else:
            gathered = spawn(checked_rank, world, case, backend=backend)
    results = merge_ranks([result for result, _ in gathered])
    print(f"check-cp preset={case.cfg.name} ratio={case.ratio} cp={world} docs={len(case.lengths)} "
          f"tokens={case.rows()} dtype={case.dtype} overlap={case.overlap} recompute={case.recompute} "
          f"loss={case.cfg.indexer_loss} partition={args.partition} split={case.row_split(world).bounds}")
    print(f"reference: the same weights and inputs in fp64, torch kernels, cp=1, the checked selection "
          f"({tolerance_summary(case.dtype)})")
    print(f"{kernels_line(gathered[0][1])} (rank 0)")
    print(f"{'quantity':<14}{'rel_error':>12}{'tolerance':>11}{'max_rel_error':>15}{'cosine':>14}  result")
    for c in results:
        worst = f"  (worst: {c.worst})" if c.worst and c.worst != c.quantity else ""
        print(f"{c.quantity:<14}{c.rel_error:>12.3e}{c.tolerance:>11.1e}{c.max_rel_error:>15.3e}{c.cosine:>14.9f}  "
              f"{'ok' if c.passed else 'FAIL'}{worst}")
    if case.compile is not None:
        print(f"compiled with {case.compile}; graph breaks of the one-rank forward:")
        print("\n".join(_breaks_at_one_rank(case, device).lines()))
    return 0 if all(c.passed for c in results) else 1


def _checked_world(args: argparse.Namespace, world: int) -> int:
    """``world``, unless the check would compare the fp64 reference with itself (fp64 at one rank)."""
    if world == 1 and args.dtype == "fp64":
        raise ValueError("--dtype: fp64 at --cp 1 is the fp64 reference itself; check bf16 or fp32, or --cp 2 or more")
    return world


def _breaks_at_one_rank(case: Case, device: torch.device) -> Explanation:
    """Where Dynamo breaks the graph of the layer's forward (one rank: no process group needed)."""
    layer, packed, x, _ = build_case(dataclasses.replace(case, split=None), device)
    return explain_breaks(layer, x, packed)
