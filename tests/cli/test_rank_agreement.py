"""Ranks given different inputs fail together with one clear error instead of returning garbage.

The silent wrong output this guards against: under ``torchrun --nproc-per-node 2`` with rank 0 given
lengths ``[100, 156]`` and rank 1 ``[200, 56]``, every rank used to run and exit 0. Two gloo ranks, one process each.
"""

from __future__ import annotations

import contextlib
import io

import torch

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.cp.agreement import check_ranks_agree, fingerprint
from dsv4cp.cp.launch import spawn
from dsv4cp.layer import DSv4Attention
from dsv4cp.packing import PackedSeqs

LENGTHS = {0: [100, 156], 1: [200, 56]}


def _scenarios(rank: int, world: int, device: torch.device) -> dict[str, object]:
    """Every scenario on one pair of ranks (spawning costs seconds): the API with different offsets,
    the API with equal fields, then ``dsv4cp check-cp`` as a torchrun rank (it ends the group)."""
    import torch.distributed as dist

    def message(fields: dict) -> str:
        try:
            check_ranks_agree(fields, dist.group.WORLD)
        except ValueError as err:
            return str(err)
        return ""

    same = {"packed": PackedSeqs.from_lengths([5, 7]), "weights": torch.arange(6.0).view(2, 3), "cp": 2}
    results = {
        "different": message({"tokens": 256, "packed": PackedSeqs.from_lengths(LENGTHS[rank])}),
        "same": message(same),
    }
    # The layer's per-step check (DSv4Attention(check_ranks=True)): both ranks raise before any collective.
    layer = DSv4Attention(DSv4Config.preset("tiny"), 0, check_ranks=True)
    x = torch.randn(128, layer.cfg.hidden, generator=torch.Generator().manual_seed(rank))
    try:
        layer(x, PackedSeqs.from_lengths(LENGTHS[rank]), cp_group=dist.group.WORLD)
        results["layer"] = ""
    except ValueError as err:
        results["layer"] = str(err)
    results["layer-same"] = layer(x, PackedSeqs.from_lengths(LENGTHS[0]), cp_group=dist.group.WORLD).out.shape
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["check-cp", "--lengths", ",".join(map(str, LENGTHS[rank])), "--ratio", "0",
                     "--dist-backend", "gloo"])
    results["check-cp"] = (code, err.getvalue())
    return results


def test_ranks_given_different_inputs_fail_together():
    ranks = spawn(_scenarios, 2)
    # API: the same verdict on every rank (none hangs), naming the field and each rank's value
    assert ranks[0]["different"] == ranks[1]["different"] == (
        "packed: ranks disagree (rank 0: lengths [100, 156] total 256; rank 1: lengths [200, 56] total 256); "
        "every rank must be given the same value")
    assert ranks[0]["same"] == ranks[1]["same"] == ""
    assert ranks[0]["layer"] == ranks[1]["layer"] != ""
    assert ranks[0]["layer"].startswith("packed: ranks disagree"), ranks[0]["layer"]
    assert ranks[0]["layer-same"] == ranks[1]["layer-same"] == (128, 64)
    # CLI: exit code 2 and one line naming the flag the user typed, on every rank
    for rank, (code, err) in enumerate(r["check-cp"] for r in ranks):
        assert code == 2
        assert err.startswith(f"dsv4cp check-cp: error: [rank {rank}] --lengths: ranks disagree (rank 0: "
                              "'100,156'; rank 1: '200,56')"), err


def test_fingerprints_compare_tensors_by_shape_and_bits():
    weights = torch.arange(6.0)
    assert fingerprint(weights.view(2, 3)) == fingerprint(weights.clone().view(2, 3))
    assert fingerprint(weights.view(2, 3)) != fingerprint(weights.view(3, 2))
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))  # bitwise, not ==
    assert fingerprint(PackedSeqs.from_lengths([3, 4])) != fingerprint(PackedSeqs.from_lengths([4, 3]))


def test_one_rank_checks_nothing():
    check_ranks_agree({"packed": PackedSeqs.from_lengths([3])}, None)
