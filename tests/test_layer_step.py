"""The one timed training step (dsv4cp.harness.build): its gradients are those of ``sum(out * upstream) +
indexer_loss``, and ``layer`` and ``profile`` at CP = 1 build the same step from the same flags."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4cp.cli.common import layer_inputs, resolve_dtype
from dsv4cp.cli.layer import step_from_args
from dsv4cp.cli.main import build_parser
from dsv4cp.cli.profile import point_from_args
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.harness.build import build_step
from dsv4cp.harness.case import Case
from dsv4cp.packing import PackedSeqs
from dsv4cp.sweeps.measure import point_case, point_inputs, point_split

CPU = torch.device("cpu")


def _grads(step) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in step.layer.named_parameters() if p.grad is not None}
    return grads if step.x.grad is None else {"x": step.x.grad, **grads}


@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_step_seeds_the_gradients_of_the_weighted_output_plus_the_indexer_loss(ratio, seed):
    cfg = DSv4Config.preset("tiny")
    packed = PackedSeqs.from_lengths([40, 24])
    step = build_step(Case(cfg=cfg, ratio=ratio, lengths=(40, 24), seed=seed, dtype="fp64", backend="torch"))
    reference_layer = copy.deepcopy(step.layer)
    x = step.x.detach().clone().requires_grad_(True)

    result = step()
    want = reference_layer(x, packed)
    loss = (want.out * step.upstream).sum()
    if want.indexer_loss is not None:
        loss = loss + want.indexer_loss
    loss.backward()

    assert (result.indexer_loss is None) == (ratio != 4)
    torch.testing.assert_close(result.out, want.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step.x.grad, x.grad, rtol=1e-10, atol=1e-12)
    wanted = {name: p.grad for name, p in reference_layer.named_parameters() if p.grad is not None}
    got = {name: p.grad for name, p in step.layer.named_parameters() if p.grad is not None}
    assert got.keys() == wanted.keys() and len(got) > 0
    for name in got:
        torch.testing.assert_close(got[name], wanted[name], rtol=1e-10, atol=1e-12, msg=name)
    assert float(step.upstream.abs().min()) > 0 and float(step.x.detach().abs().sum()) > 0  # random, not zeros


def test_forward_only_step_leaves_no_gradient(seed):
    step = build_step(Case(ratio=4, lengths=(64,), seed=seed, direction="fwd", backend="torch"))
    result = step()
    assert not step.x.requires_grad and step.x.grad is None
    assert all(p.grad is None for p in step.layer.parameters())
    assert result.out.requires_grad  # a training forward: the graph is recorded, only not back-propagated


def test_ranks_draw_different_rows_and_a_bad_rank_is_named(seed):
    cfg = DSv4Config.preset("tiny")
    case = Case(cfg=cfg, ratio=0, lengths=(64,), seed=seed, split=RowSplit.equal(64, 2).bounds, backend="torch")
    first, second = build_step(case, rank=0), build_step(case, rank=1)
    assert first.x.shape == second.x.shape == (32, cfg.hidden)
    assert not torch.equal(first.x, second.x) and not torch.equal(first.upstream, second.upstream)
    for a, b in zip(first.layer.parameters(), second.layer.parameters()):
        assert torch.equal(a, b)  # the weights depend on the seed only
    with pytest.raises(ValueError, match="rank"):
        build_step(case, rank=2)


@pytest.mark.parametrize("ratio", [0, 4, 8])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_layer_and_profile_build_the_same_step(ratio, backward, seed):
    flags = ["--preset", "tiny", "--ratio", str(ratio), "--tokens", "64", "--packing", "histogram",
             "--kernel-backend", "torch", "--seed", str(seed % 1000)] + (["--backward"] if backward else [])
    parser = build_parser()
    layer_args, profile_args = parser.parse_args(["layer", *flags]), parser.parse_args(["profile", *flags])

    layer_step = step_from_args(layer_args, layer_inputs(layer_args), CPU, resolve_dtype(layer_args, CPU))
    point = point_from_args(profile_args, 1, CPU)
    cfg, lengths = point_inputs(point)
    profile_step = build_step(point_case(point, cfg, lengths, point_split(point, cfg, lengths), CPU))

    assert torch.equal(layer_step.packed.cu_seqlens, profile_step.packed.cu_seqlens)
    assert torch.equal(layer_step.x, profile_step.x) and torch.equal(layer_step.upstream, profile_step.upstream)
    got, want = layer_step(), profile_step()
    assert torch.equal(got.out, want.out)
    assert (got.indexer_loss is None) == (want.indexer_loss is None)
    if got.indexer_loss is not None:
        assert torch.equal(got.indexer_loss, want.indexer_loss)
    layer_grads, profile_grads = _grads(layer_step), _grads(profile_step)
    assert layer_grads.keys() == profile_grads.keys()
    assert (len(layer_grads) > 1) == backward and ("x" in layer_grads) == backward
    for name in layer_grads:
        assert torch.equal(layer_grads[name], profile_grads[name]), name
