"""The check-cp verdict (:func:`dsv4cp.cp.check._compare`) can fail in every regime it judges.

Cosine similarity, the bf16 criterion for tensors, is vacuous for a scalar (1 whenever the signs
agree) and for an all-zero reference (no direction): those are judged by relative error and by the
norm of the result.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.cp.check import (
    COSINE_TOLERANCE,
    SCALAR_REL_TOLERANCE,
    ZERO_ABS_TOLERANCE,
    _compare,
    tolerance_summary,
)

DTYPES = ("bf16", "fp32", "fp64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_far_off_fails(dtype):
    verdict = _compare("indexer_loss", torch.tensor(1000.0), torch.tensor(1.0), dtype)
    assert not verdict.passed, verdict
    assert verdict.max_rel_error == pytest.approx(999.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_within_tolerance_passes_and_just_outside_fails(dtype, seed):
    want = 0.5 + torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    tol = SCALAR_REL_TOLERANCE[dtype]
    assert _compare("indexer_loss", want * (1 + 0.5 * tol), want, dtype).passed
    assert not _compare("indexer_loss", want * (1 + 2 * tol), want, dtype).passed
    assert not _compare("indexer_loss", -want, want, dtype).passed


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_reference_judged_by_the_result_norm(dtype, seed):
    zeros = torch.zeros(10)
    assert not _compare("param_grads", torch.ones(10), zeros, dtype).passed
    noise = torch.randn(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    small = noise / noise.norm() * ZERO_ABS_TOLERANCE[dtype] * 0.5
    assert _compare("param_grads", small, zeros, dtype).passed
    assert not _compare("param_grads", small * 4, zeros, dtype).passed
    exact = _compare("param_grads", torch.zeros(10), zeros, dtype)
    assert exact.passed and exact.cosine == 1.0 and exact.max_rel_error == 0.0


def test_bf16_tensor_keeps_the_cosine_criterion(seed):
    g = torch.Generator().manual_seed(seed)
    want = torch.randn(256, generator=g, dtype=torch.float64)
    # Rounding-sized noise (about 1% of each element) keeps the cosine well above 1 - tolerance...
    close = want + 0.01 * want.abs() * torch.randn(256, generator=g, dtype=torch.float64)
    assert _compare("out", close, want, "bf16").passed
    # ...an unrelated tensor of the same size does not.
    unrelated = torch.randn(256, generator=g, dtype=torch.float64)
    verdict = _compare("out", unrelated, want, "bf16")
    assert not verdict.passed and verdict.cosine < 1 - COSINE_TOLERANCE


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="out"):
        _compare("out", torch.ones(3), torch.ones(4), "fp32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_summary_states_every_criterion(dtype):
    summary = tolerance_summary(dtype)
    assert f"scalars rel <= {SCALAR_REL_TOLERANCE[dtype]:g}" in summary
    assert f"zero references |result| <= {ZERO_ABS_TOLERANCE[dtype]:g}" in summary
    assert ("cosine" in summary) == (dtype == "bf16")
