"""Check that CP reproduces CP = 1: output, input gradient, indexer loss, summed parameter gradients.

Spawns ``--cp`` local ranks itself, or runs as one rank when started by torchrun
(``torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --backend nccl ...``).
Exit code 1 when any quantity misses its tolerance (fp64 1e-10, fp32 1e-5 relative; bf16 cosine
similarity > 1 - 1e-3).
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from dsv4cp.cli.layer import parse_lengths
from dsv4cp.config import DTYPES, PRESET_NAMES, DSv4Config
from dsv4cp.cp.check import COSINE_TOLERANCE, REL_TOLERANCE, CheckCase, merge_ranks, run_rank
from dsv4cp.cp.comm import OVERLAP_MODES
from dsv4cp.cp.launch import init_from_env, spawn, under_torchrun
from dsv4cp.cp.layout import split_rows
from dsv4cp.ops.sparse_attention import check_backend_name
from dsv4cp.workloads import PACKINGS, pack_lengths

HELP = "compare a CP run against CP = 1 (output, gradients, indexer loss)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    parser.add_argument("--cp", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="packed rows T (default: the documents' sum)")
    parser.add_argument("--lengths", default=None, help="comma-separated document lengths, e.g. 5,127,0,300")
    parser.add_argument("--packing", choices=PACKINGS, default=None, help="generate lengths instead of --lengths")
    parser.add_argument("--pad-to-multiple", type=int, default=1)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--overlap", choices=OVERLAP_MODES, default="none")
    parser.add_argument("--recompute", action="store_true", help="selective recompute with KV reconstruction")
    parser.add_argument("--loss", choices=("sparse", "dense"), default="sparse", help="indexer loss variant")
    parser.add_argument("--kernel-backend", default="auto", help="sparse-attention backend")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="torch.distributed backend")
    parser.add_argument("--seed", type=int, default=0)


def build_case(args: argparse.Namespace, cp: int) -> CheckCase:
    """Validate everything on the host, before any process or collective starts."""
    if args.lengths is not None and args.packing is not None:
        raise ValueError("--packing: give either --lengths or --packing, not both")
    if args.packing is not None:
        if args.tokens is None:
            raise ValueError("--tokens: --packing needs a token count")
        lengths = pack_lengths(args.tokens, args.packing, seed=args.seed, doc_len=max(1, args.tokens // 8))
    else:
        lengths = parse_lengths(args.lengths, args.tokens or 300)
    case = CheckCase(
        preset=args.preset, ratio=args.ratio, lengths=tuple(lengths), total=args.tokens,
        pad_to_multiple=args.pad_to_multiple, dtype=args.dtype, overlap=args.overlap,
        recompute=args.recompute,
        backend=args.kernel_backend, seed=args.seed, config_overrides={"indexer_loss": args.loss},
    )
    cfg: DSv4Config = case.config()
    cfg.check_ratio(args.ratio)
    packed = case.packed()
    if cp < 1:
        raise ValueError(f"--cp: must be >= 1, got {cp}")
    split_rows(packed.total, cp, cfg, args.ratio, field="--tokens")
    check_backend_name(args.kernel_backend)
    return case


def run(args: argparse.Namespace) -> int:
    if under_torchrun():
        case = build_case(args, int(os.environ["WORLD_SIZE"]))  # before any process group exists
        device = init_from_env(args.backend)
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = run_rank(rank, world, device, case)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        world = args.cp
        case = build_case(args, world)
        gathered = spawn(run_rank, world, case, backend=args.backend)
    results = merge_ranks(gathered)
    tol = f"cosine > 1 - {COSINE_TOLERANCE:g}" if case.dtype == "bf16" else f"rel <= {REL_TOLERANCE[case.dtype]:g}"
    print(f"check-cp preset={case.preset} ratio={case.ratio} cp={world} docs={len(case.lengths)} "
          f"tokens={case.packed().total} dtype={case.dtype} overlap={case.overlap} recompute={case.recompute} "
          f"loss={args.loss} ({tol})")
    print(f"{'quantity':<14}{'max_rel_error':>15}{'cosine':>14}  result")
    for c in results:
        worst = f"  (worst: {c.worst})" if c.worst and c.worst != c.quantity else ""
        print(f"{c.quantity:<14}{c.max_rel_error:>15.3e}{c.cosine:>14.9f}  {'ok' if c.passed else 'FAIL'}{worst}")
    return 0 if all(c.passed for c in results) else 1
