"""dsv4cp.ops.grouped_linear against ``torch.einsum("lgi,goi->lgo")``: values and both gradients, on strided
views like the layer's (heads' outputs reshaped into groups), and its argument checks."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.grouped_linear import grouped_linear


def _inputs(seed: int, dtype: torch.dtype, rows: int = 23, groups: int = 3, width: int = 10, out: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, width, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(groups, out, width, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(rows, groups, out, generator=g, dtype=torch.float64).to(dtype)
    return x, w, grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_einsum_forward_and_backward(seed, dtype):
    x, w, grad = _inputs(seed, dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.double().requires_grad_(), w.double().requires_grad_()
    y = grouped_linear(x1, w1)
    ref = torch.einsum("lgi,goi->lgo", x2, w2)
    assert y.shape == ref.shape and y.dtype == dtype and y.is_contiguous()
    y.backward(grad)
    ref.backward(grad.double())
    for name, got, want in (("y", y, ref), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad)):
        err = (got.double() - want).norm() / want.norm()
        assert err < tol, f"{name}: relative error {err:.3g} > {tol} (seed {seed})"


def test_reads_the_layer_strided_view(seed):
    """The layer passes ``[L, H, D]`` reshaped to ``[L, G, H/G * D]``; a group slice of a wider tensor (rows
    farther apart than ``G * I``) and a non-contiguous last dim must give the same answer."""
    x, w, grad = _inputs(seed, torch.float64)
    wide = torch.randn(x.shape[0], x.shape[1], x.shape[2] + 5, dtype=torch.float64)
    wide[..., : x.shape[2]] = x
    strided = wide[..., : x.shape[2]]
    transposed_last = x.transpose(0, 2).contiguous().transpose(0, 2)  # last dim stride != 1
    want = torch.einsum("lgi,goi->lgo", x, w)
    for view in (strided, transposed_last):
        view = view.detach().requires_grad_()
        got = grouped_linear(view, w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got.backward(grad)
        torch.testing.assert_close(view.grad, torch.einsum("lgo,goi->lgi", grad, w), rtol=1e-12, atol=1e-12)


def test_gradcheck(seed):
    x, w, _ = _inputs(seed, torch.float64, rows=5, groups=2, width=4, out=3)
    assert torch.autograd.gradcheck(grouped_linear, (x.requires_grad_(), w.requires_grad_()))


def test_only_the_needed_gradient(seed):
    x, w, grad = _inputs(seed, torch.float64)
    w.requires_grad_()
    grouped_linear(x, w).backward(grad)
    torch.testing.assert_close(w.grad, torch.einsum("lgo,lgi->goi", grad, x), rtol=1e-12, atol=1e-12)
    assert x.grad is None


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "dtype", "match"),
    [
        ((4, 2, 3), (2, 5), torch.float64, r"x, weight: must be \[L, G, I\]"),
        ((4, 2, 3), (3, 5, 3), torch.float64, r"weight: must be \[G=2, O, I=3\]"),
        ((4, 2, 3), (2, 5, 4), torch.float64, r"weight: must be \[G=2, O, I=3\]"),
        ((4, 2, 3), (2, 5, 3), torch.float32, r"weight: must match x's dtype"),
    ],
)
def test_rejects_bad_arguments(x_shape, w_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        grouped_linear(torch.ones(x_shape, dtype=torch.float64), torch.ones(w_shape, dtype=dtype))
