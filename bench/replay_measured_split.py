"""Replay the rounds of a ``--partition measured`` run offline (no device): the refit on them, with and without
per-rank factors, the split the next round would measure and the model's prediction for it.

    python -m bench.replay_measured_split SPLIT_FILE --packing one --calibration PRIOR.json
        [--preset flash --ratio 4 --dtype bf16 --machine h200x2]

``SPLIT_FILE``: the ``--save-split`` file of the run (every round's split and measured rank times); its cp and
token count come from it, the rest of the point from the flags, which must match the run's. ``--calibration``:
the prior the run started from. Prints: whether the class-only refit reproduces every split the run measured
(the replay is faithful), each round predicted from the rounds before it (relative errors), and the next split.
Every "predicted" figure is the cost model's, NOT a measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv4cp.model import Machine
from dsv4cp.model.calibration import Calibration
from dsv4cp.sweeps.measured_split import load_rounds
from dsv4cp.sweeps.spec import make_point
from dsv4cp.sweeps.split_replay import hindcast, next_round

_KINDS = {False: "class factors only", True: "class + per-rank factors"}


def _ms(values) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("split_file")
    parser.add_argument("--packing", required=True)
    parser.add_argument("--calibration", default=None, help="the prior calibration the run started from")
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--machine", default="h200x2")
    args = parser.parse_args(argv)
    header = json.loads(Path(args.split_file).read_text())
    cp, tokens = header.get("cp"), header.get("tokens")
    rounds = load_rounds(args.split_file, cp, tokens)
    point = make_point({"preset": args.preset, "ratio": args.ratio, "cp": cp, "tokens": tokens,
                        "packing": args.packing, "partition": "measured", "dtype": args.dtype})
    machine = Machine.preset(args.machine)
    prior = None if args.calibration is None else Calibration.load(args.calibration)
    print(f"replay of {args.split_file} ({header.get('point')}): {len(rounds)} measured rounds")
    for index, measured in enumerate(rounds):
        print(f"  {measured.line(index)}")
    for index in range(1, len(rounds)):
        again = next_round(point, rounds[:index], machine, calibration=prior, per_rank=False).split.bounds
        same = "reproduced" if again == rounds[index].split else f"NOT reproduced (replay gives {list(again)})"
        print(f"round {index}'s split from the class-only refit of rounds 0..{index - 1}: {same}")
    for per_rank in (False, True):
        errors = "; ".join(f"round {h.index} rms {h.rms:.4f} worst {h.worst:.4f}"
                           for h in hindcast(point, rounds, machine, calibration=prior, per_rank=per_rank))
        print(f"each round predicted from the rounds before it, {_KINDS[per_rank]}: {errors}")
    for per_rank in (False, True):
        following = next_round(point, rounds, machine, calibration=prior, per_rank=per_rank)
        print(f"next split, {_KINDS[per_rank]}: {list(following.split.bounds)}"
              f"{' (already measured: the rounds would stop)' if following.measured_before else ''}")
        if per_rank:
            print(f"  per-rank factors {[round(f, 4) for f in following.calibration.rank_factors]}")
        print(f"  PREDICTED (model, not measured) rank ms {_ms(following.predicted_ms)}; max/mean "
              f"{following.predicted_imbalance:.3f}; slowest {max(following.predicted_ms):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
