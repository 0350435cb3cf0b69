"""A tiny layer step under ``torch.compile`` (AOTAutograd: traces forward and backward; Inductor's C++
codegen of the whole layer takes minutes on CPU) equals the eager step, with no graph break, also on the
Triton paths (the kernels' custom ops, on Triton's CPU interpreter) and with what ran noted as in eager;
the breaks left (selective recompute) are named with a place."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4cp import kernel_options
from dsv4cp.cli.main import main
from dsv4cp.harness.build import build_case
from dsv4cp.harness.case import Case
from dsv4cp.profiling.compilation import UNPLACED, explain_breaks


def _step(layer, packed, x, weight, compile_backend=None):
    x = x.clone().requires_grad_()
    step = layer if compile_backend is None else torch.compile(layer, backend=compile_backend)
    result = step(x, packed)
    objective = (result.out * weight).sum()
    if result.indexer_loss is not None:
        objective = objective + result.indexer_loss
    objective.backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return result, x.grad, grads


@pytest.mark.parametrize("ratio", [0, 4])
def test_compiled_step_matches_eager(ratio, seed):
    layer, packed, x, weight = build_case(Case(lengths=(5, 60, 0, 31), total=96, ratio=ratio, seed=seed),
                                          torch.device("cpu"))
    eager = copy.deepcopy(layer)
    torch._dynamo.reset()
    got, got_dx, got_grads = _step(layer, packed, x, weight, "aot_eager")
    want, want_dx, want_grads = _step(eager, packed, x, weight)
    pairs = [("out", got.out, want.out), ("x_grad", got_dx, want_dx)]
    if ratio:
        pairs.append(("indexer_loss", got.indexer_loss, want.indexer_loss))
    pairs += [(f"grad/{n}", got_grads[n], g) for n, g in want_grads.items()]
    assert set(got_grads) == set(want_grads)
    for name, a, b in pairs:
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("ratio", [0, 4])
def test_the_compiled_layer_is_one_graph(ratio, seed):
    layer, packed, x, _ = build_case(Case(lengths=(9, 23), ratio=ratio, seed=seed), torch.device("cpu"))
    torch._dynamo.reset()
    explained = explain_breaks(layer, x.requires_grad_(), packed)
    assert (explained.graphs, explained.breaks) == (1, 0), explained.lines()


def test_graph_breaks_are_named_with_their_place(seed):
    """Selective recompute's autograd function (a closure over the query path, and a backward that calls
    autograd) is the one part Dynamo cannot trace: a bounded number of breaks, each with a reason."""
    layer, packed, x, _ = build_case(Case(lengths=(9, 23), ratio=4, seed=seed, recompute=True),
                                     torch.device("cpu"))
    torch._dynamo.reset()
    explained = explain_breaks(layer, x.requires_grad_(), packed)
    assert 1 <= explained.breaks <= 3 and explained.graphs == explained.breaks + 1, explained.lines()
    lines = explained.lines()
    assert lines[0] == f"torch.compile: {explained.graphs} graph(s), {explained.breaks} graph break(s)"
    assert explained.reasons and len(lines) == 1 + len(explained.reasons)
    for reason in explained.reasons:
        assert reason.reason and (".py:" in reason.where or reason.where == UNPLACED) and reason.count >= 1


def test_compiled_step_on_the_kernels_custom_ops_matches_eager(triton_paths, seed):
    """Every kernel of the layer as an opaque custom op: one graph, the eager step's numbers and notes, and
    the layer's kernel options reaching the kernels of both directions (a compiled graph runs outside the
    layer's option scope: the ops are handed the options)."""
    layer, packed, x, weight = build_case(
        Case(lengths=(9, 0, 23), total=32, ratio=4, seed=seed, backend="triton"), torch.device("cpu"))
    layer.kernel_options = kernel_options.KernelOptions.resolve({"topk_keys": "scores", "triton_dq_in_dkv": "0",
                                                                  "triton_bwd_dq_pass": "0"})
    eager = copy.deepcopy(layer)
    kernel_options.reset_backends_ran()
    want, want_dx, want_grads = _step(eager, packed, x, weight)
    want_ran = kernel_options.backends_ran()
    assert all(want_ran[k].startswith("triton") for k in ("compress_pool", "indexer_scores.bwd", "norm_rope",
                                                          "sparse_attention.fwd")), want_ran
    assert want_ran["indexer_topk"] == "triton/chunked/torch/scores", want_ran
    assert not any("dq_in_dkv" in key for key in want_ran), want_ran  # the backward without the fused dq
    torch._dynamo.reset()
    counters.clear()
    kernel_options.reset_backends_ran()
    got, got_dx, got_grads = _step(layer, packed, x, weight, "aot_eager")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert kernel_options.backends_ran() == want_ran
    assert set(got_grads) == set(want_grads)
    pairs = [("out", got.out, want.out), ("x_grad", got_dx, want_dx), ("indexer_loss", got.indexer_loss,
                                                                          want.indexer_loss)]
    for name, a, b in pairs + [(f"grad/{n}", got_grads[n], g) for n, g in want_grads.items()]:
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= 1e-5 * scale, name


def test_check_cp_rejects_an_unknown_compile_backend(capsys):
    assert main(["check-cp", "--cp", "1", "--lengths", "9,23", "--compile", "tvm"]) == 2
    assert capsys.readouterr().err.startswith("dsv4cp check-cp: error: --compile:")


def test_check_cp_compiled_cp2_matches_eager_cp1(capsys):
    assert main(["check-cp", "--cp", "2", "--ratio", "0", "--lengths", "9,0,55", "--compile", "aot_eager"]) == 0
    out = capsys.readouterr().out
    verdicts = {line.split()[0]: line.split()[5] for line in out.splitlines()
                if line.split() and line.split()[0] in ("out", "x_grad", "param_grads")}
    assert verdicts == {"out": "ok", "x_grad": "ok", "param_grads": "ok"}, out
    assert "compiled with aot_eager" in out and "torch.compile:" in out
