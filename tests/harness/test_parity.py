"""The parity pass (:mod:`dsv4cp.harness.parity`): the layer against the fp64 reference layer.

The verdict can fail in every regime it judges; the pass passes on the tiny layer under the torch and the
Triton-interpreter kernels and fails when one weight of the reference is perturbed (a layer that computes
something else, or selects other entries); ``check-cp --cp 1`` compares against fp64, never against a
copy of itself; on a GPU the bf16 layer with every default kernel passes at the flash preset's full size.
"""

from __future__ import annotations

import pytest
import torch

from conftest import seed_of
from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.harness import parity
from dsv4cp.harness.case import Case
from dsv4cp.harness.parity import (
    TOLERANCES,
    ZERO_ABS_TOLERANCE,
    compare,
    merge_ranks,
    run_rank,
    tolerance_summary,
)
from dsv4cp.kernels import triton_available
from dsv4cp.workloads import pack_lengths

DTYPES = ("bf16", "fp32", "fp64")
CPU = torch.device("cpu")
LENGTHS = (37, 0, 70, 21)  # an empty document and documents of several groups


def _verdicts(case: Case, device: torch.device = CPU) -> dict:
    return {c.quantity: c for c in merge_ranks([run_rank(0, 1, device, case)])}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tensor_within_its_tolerance_passes_and_one_twice_as_far_fails(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    want = torch.randn(256, generator=g, dtype=torch.float64)
    noise = torch.randn(256, generator=g, dtype=torch.float64)
    noise = noise / noise.norm() * want.norm()  # relative norm error 1 before scaling
    for quantity, tolerance in TOLERANCES[dtype].items():
        assert compare("t", quantity, want + 0.5 * tolerance * noise, want, dtype).passed, quantity
        verdict = compare("t", quantity, want + 2 * tolerance * noise, want, dtype)
        assert not verdict.passed and verdict.rel_error == pytest.approx(2 * tolerance), quantity


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_scalar_far_off_or_of_the_wrong_sign_fails(dtype, seed):
    want = 0.5 + torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert not compare("indexer_loss", "indexer_loss", want * 1000, want, dtype).passed
    assert not compare("indexer_loss", "indexer_loss", -want, want, dtype).passed


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_all_zero_reference_is_judged_by_the_result_norm(dtype, seed):
    zeros = torch.zeros(10, dtype=torch.float64)
    assert not compare("g", "param_grads", torch.ones(10), zeros, dtype).passed
    noise = torch.randn(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    small = noise / noise.norm() * ZERO_ABS_TOLERANCE[dtype] * 0.5
    assert compare("g", "param_grads", small, zeros, dtype).passed
    assert not compare("g", "param_grads", small * 4, zeros, dtype).passed


def test_a_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="out"):
        compare("out", "out", torch.ones(3), torch.ones(4), "fp32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_summary_states_every_tolerance(dtype):
    summary = tolerance_summary(dtype)
    for quantity, tolerance in TOLERANCES[dtype].items():
        assert f"{quantity} {tolerance:g}" in summary
    assert f"zero references |result| <= {ZERO_ABS_TOLERANCE[dtype]:g}" in summary


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_the_tiny_layer_passes_against_fp64(ratio, dtype, seed):
    verdicts = _verdicts(Case(ratio=ratio, lengths=LENGTHS, dtype=dtype, backend="torch", seed=seed))
    indexer = {"selection", "indexer_loss", "indexer_grads"} if ratio == 4 else set()
    assert set(verdicts) == {"out", "x_grad", "param_grads"} | indexer
    failed = {q: (v.rel_error, v.tolerance) for q, v in verdicts.items() if not v.passed}
    assert not failed, failed


@pytest.mark.skipif(not triton_available("cpu"), reason="needs triton (its interpreter on CPU)")
def test_the_triton_kernels_pass_against_fp64_under_the_interpreter(seed):
    verdicts = _verdicts(Case(ratio=4, lengths=LENGTHS, dtype="fp32", backend="triton", seed=seed))
    failed = {q: (v.rel_error, v.tolerance) for q, v in verdicts.items() if not v.passed}
    assert not failed, failed


@pytest.mark.parametrize(("dtype", "weight", "scale", "caught"), [
    ("fp32", "wo_b.weight", 1e-4, {"out", "x_grad", "param_grads"}),  # past fp32's 1e-5: the output moves
    ("bf16", "wo_b.weight", 0.1, {"out", "param_grads"}),
    ("fp32", "indexer.wq_b.weight", 1e-3, {"indexer_loss", "indexer_grads"}),  # the loss alone sees the indexer
    ("fp32", "indexer.wq_b.weight", 1.0, {"selection"}),  # other scores: the reference chooses other entries
])
def test_a_perturbed_reference_weight_fails_the_check(dtype, weight, scale, caught, seed, monkeypatch):
    """A reference whose weight differs from the checked layer's by ``scale`` (relative, random signs) is a
    layer computing something else: the quantities it feeds must fail."""
    built = parity.reference_layer

    def perturbed(layer):
        reference = built(layer)
        param = dict(reference.named_parameters())[weight]
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed), dtype=param.dtype)
        with torch.no_grad():
            param.add_(scale * param.abs().mean() * noise.to(param.device))
        return reference

    case = Case(ratio=4, lengths=LENGTHS, dtype=dtype, backend="torch", seed=seed)
    assert all(v.passed for v in _verdicts(case).values())  # unperturbed: passes
    monkeypatch.setattr(parity, "reference_layer", perturbed)
    failed = {q for q, v in _verdicts(case).items() if not v.passed}
    assert caught <= failed, f"{weight} x {scale}: only {sorted(failed)} failed"


def test_check_cp_at_one_rank_compares_against_fp64(capsys):
    assert main(["check-cp", "--cp", "1", "--lengths", "5,60,0,31"]) == 0
    out = capsys.readouterr().out
    assert "cp=1" in out and "reference: the same weights and inputs in fp64" in out
    assert "FAIL" not in out and "selection" in out


def test_check_cp_refuses_fp64_at_one_rank(capsys):
    assert main(["check-cp", "--cp", "1", "--dtype", "fp64", "--lengths", "5,60"]) == 2
    assert "--dtype: fp64 at --cp 1 is the fp64 reference itself" in capsys.readouterr().err


FULL_SIZE_TOKENS = 16384


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packing", ["one", "histogram", "adversarial"])
def test_the_bf16_flash_layer_with_the_default_kernels_passes_against_fp64_at_full_size(packing):
    """The flash preset's C layer at 16K tokens, bf16, every default kernel (``auto``), against fp64."""
    seed = seed_of("full-size parity", packing) % 1000
    lengths = pack_lengths(FULL_SIZE_TOKENS, packing, seed=seed, cp=1, ratio=4)
    case = Case(cfg=DSv4Config.preset("flash"), ratio=4, lengths=tuple(lengths), seed=seed, dtype="bf16",
                device="cuda")
    verdicts = _verdicts(case, torch.device("cuda", 0))
    assert set(verdicts) == {"out", "selection", "indexer_loss", "x_grad", "param_grads", "indexer_grads"}
    failed = {q: (v.rel_error, v.tolerance, v.worst) for q, v in verdicts.items() if not v.passed}
    assert not failed, f"{packing} ({len(lengths)} documents): {failed}"


@pytest.mark.parametrize("cp", [1, 2])
def test_a_checked_sweep_point_checks_the_case_it_timed(cp, monkeypatch):
    """``sweep --check``: the parity pass runs on the very Case the timed step was built from (same weights,
    inputs, kernels and split), and its verdict lands in the record's metrics."""
    from dsv4cp.cp.launch import spawn

    results = spawn(_checked_point_cases, cp, backend="gloo") if cp > 1 else [_checked_point_cases(0, 1, CPU)]
    for timed, checked, verdicts in results:
        assert timed == checked
        assert verdicts and all(v["passed"] for v in verdicts), verdicts


def _checked_point_cases(rank: int, world: int, device: torch.device) -> tuple:
    import torch.distributed as dist

    from dsv4cp.harness import time
    from dsv4cp.sweeps import measure
    from dsv4cp.sweeps.spec import RunOptions, make_point

    seen: dict[str, Case] = {}
    built, checked = time.build_step, time.run_rank

    def spy_build(case, **kwargs):
        seen["timed"] = case
        return built(case, **kwargs)

    def spy_check(rank, world, device, case, group=None):
        seen["checked"] = case
        return checked(rank, world, device, case, group)

    time.build_step, time.run_rank = spy_build, spy_check
    try:
        point = make_point({"tokens": 64, "ratio": 4, "cp": world, "packing": "histogram", "kernel_backend": "torch"})
        group = dist.group.WORLD if world > 1 else None
        result = measure.measure_point(point, group, device, RunOptions(warmup=0, reps=1), check=True)
    finally:
        time.build_step, time.run_rank = built, checked
    return seen["timed"], seen["checked"], result.metrics["parity"]
