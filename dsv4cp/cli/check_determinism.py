"""Check bitwise replay: run the same layer step --replays times in this process and once in a fresh one,
at CP = 1 and at --cp, and compare every result bit for bit (output, indexer loss, selected top-k entries,
input gradient, every parameter gradient).

Prints per quantity "identical" or the largest difference and the first differing element. Exit code 1
when the configuration claims bitwise replay (see 'dsv4cp env': on CPU every backend; on CUDA only
--deterministic with a deterministic sparse-attention backward) and a quantity differs, when a quantity
holds NaN or infinity (always: the same NaNs replay bit for bit), or with --ties when the selection breaks
the tie rule or differs between CP degrees. Examples:

  dsv4cp check-determinism --cp 2 --lengths 5,127,0,168
  dsv4cp check-determinism --cp 2 --ties
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-determinism --preset flash --tokens 16384 \\
      --packing histogram --dtype bf16 --kernel-backend triton-deterministic --deterministic

Under torchrun the fresh-process replay runs at CP = 1 only (on rank 0's device, after the CP run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dsv4cp.cli.check_cp import add_arguments as add_check_cp_arguments
from dsv4cp.cli.check_cp import checked_case
from dsv4cp.cli.common import gather_torchrun_ranks, positive_int, resolve_dist_backend, torchrun_world
from dsv4cp.cp.launch import spawn, under_torchrun
from dsv4cp.environment import deterministic_algorithms
from dsv4cp.harness.replay import (
    Difference,
    Replay,
    Snapshot,
    nonfinite_quantities,
    replay_differences,
    replay_rank,
    tie_rule_violations,
    whole_selection,
)
from dsv4cp.ops.determinism import attention_replays_bitwise
from dsv4cp.ops.sparse_attention import resolve_backend

HELP = "replay the same step and compare every output and gradient bit for bit"

DEFAULT_CP = 2
SNAPSHOT_FLAG = "--snapshot-out"
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_cp_arguments(parser)
    parser.add_argument("--replays", type=positive_int, default=3, help="replays in this process, per CP degree")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True)")
    parser.add_argument("--ties", action="store_true",
                        help="zero the indexer keys so every visible entry scores exactly 0, and check that the "
                             "selection follows the tie rule (earliest entries) at every CP degree (--ratio 4)")
    # internal: the fresh-process replay writes its snapshots here instead of reporting
    parser.add_argument(SNAPSHOT_FLAG, type=Path, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    backend = resolve_dist_backend(args, distributed=True)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    if under_torchrun():
        return _run_under_torchrun(args, backend, device)
    world = args.cp or DEFAULT_CP
    case = _replay_case(args, world, device)
    runs = {1: [replay_rank(0, 1, device, case)]}
    if world > 1:
        runs[world] = spawn(replay_rank, world, case, backend=backend)
    if args.snapshot_out is not None:
        torch.save({cp: [snaps[0] for snaps in per_rank] for cp, per_rank in runs.items()}, args.snapshot_out)
        return 0
    fresh = _fresh_process(args, extra=[])
    return _report(args, case, device, runs, fresh)


def _run_under_torchrun(args: argparse.Namespace, backend: str, device: torch.device) -> int:
    world = torchrun_world(args.cp)
    case = _replay_case(args, world, device)

    def measure(rank: int, world: int, device: torch.device) -> tuple:
        # every rank replays CP = 1 too (the ranks stay in step); rank 0's is the one reported
        return replay_rank(0, 1, device, case), replay_rank(rank, world, device, case)

    rank, gathered = gather_torchrun_ranks(args, backend, measure)
    if rank != 0:
        return 0
    runs = {1: [gathered[0][0]], world: [mine for _, mine in gathered]}
    fresh = _fresh_process(args, extra=["--cp", "1"])
    return _report(args, case, device, runs, fresh)


def _replay_case(args: argparse.Namespace, world: int, device: torch.device) -> Replay:
    """Validated on the host before any process starts (``--ties`` on a layer without an indexer fails here)."""
    case = checked_case(args, world, device)
    try:
        return Replay(case, args.replays, args.ties)
    except ValueError as err:
        raise ValueError(f"--{err}") from None


def _fresh_process(args: argparse.Namespace, extra: list[str]) -> dict[int, list[Snapshot]]:
    """One replay per CP degree from a new process running this command with :data:`SNAPSHOT_FLAG`."""
    argv = list(getattr(args, "_argv", None) or sys.argv[1:])
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="dsv4cp-replay-") as tmp:
        path = Path(tmp) / "snapshots.pt"
        command = [sys.executable, "-m", "dsv4cp.cli.main", *argv, *extra, "--replays", "1", SNAPSHOT_FLAG, str(path)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the fresh-process replay failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        return torch.load(path, weights_only=False)


def _report(args: argparse.Namespace, case: Replay, device: torch.device, runs: dict[int, list[list[Snapshot]]],
            fresh: dict[int, list[Snapshot]]) -> int:
    check = case.case
    with deterministic_algorithms(check.deterministic):
        chosen = resolve_backend(check.backend, device, head_dim=check.cfg.head_dim).name
    claims = attention_replays_bitwise(chosen, device, check.deterministic)
    print(f"check-determinism preset={check.cfg.name} ratio={check.ratio} cp={max(runs)} docs={len(check.lengths)} "
          f"tokens={check.rows()} dtype={check.dtype} backend={chosen} deterministic_mode={check.deterministic} "
          f"recompute={check.recompute} overlap={check.overlap} ties={case.ties} replays={case.replays} "
          f"+ 1 fresh process (cp {', '.join(map(str, sorted(fresh)))})")
    why = "every path is deterministic on CPU" if device.type != "cuda" else (
        "deterministic mode with a deterministic sparse-attention backward" if claims else
        "needs --deterministic and a sparse-attention backward that is deterministic in that mode")
    print(f"claims bitwise replay: {'yes' if claims else 'no'} ({why})")
    per_cp: dict[int, dict[str, Difference]] = {
        cp: replay_differences(per_rank, fresh.get(cp)) for cp, per_rank in runs.items()
    }
    names = list(per_cp[1])
    for cp in runs:
        names += [n for n in per_cp[cp] if n not in names]
    width = max(len(n) for n in names) + 2
    for name in names:
        cells = "  ".join(f"cp={cp}: {per_cp[cp][name].describe() if name in per_cp[cp] else 'absent'}"
                          for cp in runs)
        print(f"{name:<{width}}{cells}")
    differing = sorted({n for results in per_cp.values() for n, d in results.items() if not d.identical})
    failed = claims and bool(differing)
    if differing:
        print(f"{len(differing)} of {len(names)} quantities differ between runs"
              + (": FAIL (the configuration claims bitwise replay)" if claims else " (expected: not claimed)"))
    else:
        print(f"all {len(names)} quantities identical in every run")
    for cp, per_rank in runs.items():
        broken = nonfinite_quantities(per_rank)
        if broken:  # identical NaNs replay bit for bit: the check would pass on a broken step
            failed = True
            print(f"FAIL: non-finite (NaN or infinity) at cp={cp}: {', '.join(broken)}; a replay of a broken "
                  "step proves nothing")
    if case.ties:
        failed |= not _report_ties(runs, check)
    return 1 if failed else 0


def _report_ties(runs: dict[int, list[list[Snapshot]]], check) -> bool:
    """The selection at every CP degree: the tie rule's, and the same as at CP = 1; True when both hold."""
    reference = whole_selection([snaps[0] for snaps in runs[1]])
    ok = True
    for cp, per_rank in runs.items():
        selection = whole_selection([snaps[0] for snaps in per_rank])
        broken = tie_rule_violations(selection, check)
        same = torch.equal(selection, reference)
        ok &= broken == 0 and same
        print(f"ties cp={cp}: {broken} of {selection.shape[0]} rows break the earliest-entry rule; "
              f"{'same selection as' if same else 'DIFFERENT selection from'} cp=1")
    return ok
