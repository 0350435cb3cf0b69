"""dsv4cp.ops.grouped_linear against ``torch.einsum("lgi,goi->lgo")`` (and ``head_group_projection`` against
``apply_rope(inverse=True)`` followed by the einsum): values and both gradients, on strided views like the
layer's, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.grouped_linear import grouped_linear, head_group_projection
from dsv4cp.ops.norm_rope import apply_rope


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


def _heads_case(seed: int, dtype: torch.dtype, rows: int = 19, heads: int = 6, dim: int = 16, groups: int = 3,
                out: int = 5, pairs: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(groups, out, heads // groups * dim, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(rows, groups, out, generator=g, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 70000, (rows,), generator=g)
    freqs = 10000.0 ** (-torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs))
    return x, w, grad, positions, freqs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_head_group_projection_matches_rope_then_einsum(seed, dtype):
    """The fused op (rotation back, grouping, map; the input gradient's tail turned in place) against the
    composition of the reference rotation and the einsum, values and both gradients."""
    x, w, grad, positions, freqs = _heads_case(seed, dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.double().requires_grad_(), w.double().requires_grad_()
    y = head_group_projection(x1, w1, positions, freqs)
    rotated = apply_rope(x2, positions, freqs, inverse=True).reshape(x.shape[0], w.shape[0], -1)
    ref = torch.einsum("lgi,goi->lgo", rotated, w2)
    y.backward(grad)
    ref.backward(grad.double())
    for name, got, want in (("y", y, ref), ("dheads", x1.grad, x2.grad), ("dw", w1.grad, w2.grad)):
        err = (got.double() - want).norm() / want.norm()
        assert err < tol, f"{name}: relative error {err:.3g} > {tol} (seed {seed})"
    # the rotation must matter here: without it the answer is far off (the test can fail)
    plain = torch.einsum("lgi,goi->lgo", x.double().reshape(x.shape[0], w.shape[0], -1), w.double())
    assert (plain - ref).norm() / ref.norm() > 1e-2


def test_head_group_projection_gradcheck(seed):
    x, w, _, positions, freqs = _heads_case(seed, torch.float64, rows=4, heads=4, dim=8, groups=2, out=3, pairs=2)
    assert torch.autograd.gradcheck(lambda a, b: head_group_projection(a, b, positions, freqs),
                                     (x.requires_grad_(), w.requires_grad_()))


@pytest.mark.parametrize(
    ("w_shape", "positions", "pairs", "match"),
    [
        ((4, 5, 32), 19, 4, r"weight: must be \[G, O, H / G \* D\] with G dividing H=6"),
        ((3, 5, 24), 19, 4, r"weight: must be \[G, O, H / G \* D\]"),
        ((3, 5, 32), 18, 4, r"positions: must be a \[L=19\] tensor"),
        ((3, 5, 32), 19, 9, r"freqs: must be a \[P/2\] tensor with 2 <= P <= D=16"),
    ],
)
def test_head_group_projection_rejects_bad_arguments(w_shape, positions, pairs, match):
    heads = torch.ones(19, 6, 16, dtype=torch.float64)
    freqs = torch.ones(pairs, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        head_group_projection(heads, torch.ones(w_shape, dtype=torch.float64), torch.zeros(positions, dtype=torch.long),
                              freqs)


def test_zero_rows(seed):
    """A rank may hold no rows: an empty result and empty gradients, not a reshape error."""
    x, w, _, positions, freqs = _heads_case(seed, torch.float64)
    heads = x[:0].clone().requires_grad_()
    weight = w.clone().requires_grad_()
    y = head_group_projection(heads, weight, positions[:0], freqs)
    assert y.shape == (0, w.shape[0], w.shape[1])
    y.sum().backward()
    assert heads.grad.shape == heads.shape and torch.equal(weight.grad, torch.zeros_like(w))
    assert grouped_linear(x[:0].reshape(0, w.shape[0], w.shape[2]), w).shape == (0, 3, 5)
