"""A tiny layer step under ``torch.compile`` (AOTAutograd: traces forward and backward; Inductor's C++
codegen is too slow for CI on CPU) equals the eager step, and the graph breaks are named with a place."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4cp.cli.main import main
from dsv4cp.cp.check import CheckCase, build_case
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
    layer, packed, x, weight = build_case(CheckCase(lengths=(5, 60, 0, 31), total=96, ratio=ratio, seed=seed),
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


def test_graph_breaks_are_named_with_their_place(seed):
    layer, packed, x, _ = build_case(CheckCase(lengths=(9, 23), ratio=0, seed=seed), torch.device("cpu"))
    torch._dynamo.reset()
    explained = explain_breaks(layer, x, packed)
    assert explained.graphs >= 1 and explained.breaks >= 0
    lines = explained.lines()
    assert lines[0].startswith(f"torch.compile: {explained.graphs} graph(s)")
    assert explained.breaks == 0 or explained.reasons
    for reason in explained.reasons:
        assert reason.reason and (".py:" in reason.where or reason.where == UNPLACED) and reason.count >= 1


def test_check_cp_rejects_an_unknown_compile_backend(capsys):
    assert main(["check-cp", "--cp", "1", "--lengths", "9,23", "--compile", "tvm"]) == 2
    assert capsys.readouterr().err.startswith("dsv4cp check-cp: error: --compile:")


def test_check_cp_compiled_cp2_matches_eager_cp1(capsys):
    assert main(["check-cp", "--cp", "2", "--ratio", "0", "--lengths", "9,0,55", "--compile", "aot_eager"]) == 0
    out = capsys.readouterr().out
    verdicts = {line.split()[0]: line.split()[3] for line in out.splitlines()
                if line.split() and line.split()[0] in ("out", "x_grad", "param_grads")}
    assert verdicts == {"out": "ok", "x_grad": "ok", "param_grads": "ok"}, out
    assert "compiled with aot_eager" in out and "torch.compile:" in out
