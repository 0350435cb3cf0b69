"""Fused query RMS norm + RoPE and tail-only RoPE kernels against the torch layer code (DESIGN 1.3).

CPU (Triton's interpreter, fp32, tiny sizes: rows <= 16, H in {1, 3, 4}, D in {16, 32} (and 48: a padded
tile), P in {4, 8} (and P = D = 16)):
:func:`head_norm_rope` against ``apply_rope(rms_norm(x, eps), positions, freqs)`` and :func:`rope_tail`
against ``apply_rope(x, positions, freqs, inverse)``, forward and backward (autograd gradients of a random
upstream gradient), relative error 1e-5; positions include 0 and 100000 (and 2^20); strided inputs and
gradients, bf16 / fp16 through the interpreter, what autograd saves, input validation and the dispatch.

GPU (marked ``gpu``): rows = 4096, H = 64, D = 512, P = 64 in bf16 against the torch composition in fp32
(relative error < 1e-2), with the flash preset's frequencies and positions up to 2^20.

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it), never zeros.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels.norm_rope_triton import (
    head_norm_rope,
    rope_table,
    rope_tail,
    rotate_tail_,
    use_fused,
)
from dsv4cp.layer.norm import rms_norm
from dsv4cp.layer.rope import apply_rope
from triton_marks import HAS_CUDA, needs_cuda, skip_module_without_triton

skip_module_without_triton()

EPS = 1e-6


def make_case(seed: int, rows: int, h: int, d: int, p: int, *, max_pos: int = 100000, device="cpu",
              dtype=torch.float32):
    """x ``[rows, H, D]`` (randn times a per-(row, head) scale in [0.1, 10]: the norm matters), positions
    ``[rows]`` int64 with 0 and ``max_pos`` among random ones, fp64 frequencies ``base^(-2i/P)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, d, generator=g) * torch.exp(torch.empty(rows, h, 1).uniform_(-2.3, 2.3, generator=g))
    positions = torch.randint(0, max_pos + 1, (rows,), generator=g)
    positions[0] = 0
    if rows > 1:
        positions[-1] = max_pos
    freqs = 10000.0 ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)
    return x.to(device=device, dtype=dtype), positions.to(device), freqs


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def fwd_bwd(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(leaf)
    (dx,) = torch.autograd.grad(out, leaf, grad)
    return out.detach(), dx


def reference_norm_rope(x, positions, freqs, eps=EPS):
    return apply_rope(rms_norm(x, eps), positions, freqs)


# ------------------------------------------------------------------------------------------ CPU: fp32
CPU_SHAPES = [(16, 1, 16, 4), (5, 3, 32, 8), (16, 4, 32, 4), (7, 4, 16, 8), (1, 3, 32, 8), (9, 3, 16, 16),
              (3, 3, 48, 8)]  # (9, 3, 16, 16): P = D, nothing unrotated; D = 48: a padded tile (BLOCK_D 64)


@pytest.mark.parametrize("rows,h,d,p", CPU_SHAPES, ids=lambda v: str(v))
def test_head_norm_rope_matches_torch(rows, h, d, p, seed):
    msg = f"seed={seed} rows={rows} H={h} D={d} P={p}"
    x, positions, freqs = make_case(seed, rows, h, d, p)
    grad = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(seed + 1))
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, EPS), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs), x, grad)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous(), msg
    assert dx.shape == x.shape and dx.dtype == x.dtype, msg
    assert rel_fro(out, ref) < 1e-5, f"{msg}: forward rel err {rel_fro(out, ref):.2e}"
    assert rel_fro(dx, dx_ref) < 1e-5, f"{msg}: dx rel err {rel_fro(dx, dx_ref):.2e}"
    # The first D - P dims are the plain norm; the rotation keeps the per-pair norms.
    nope = d - p
    assert rel_fro(out[..., :nope], rms_norm(x, EPS)[..., :nope]) < 1e-6, msg


@pytest.mark.parametrize("rows,h,d,p", CPU_SHAPES[:4] + CPU_SHAPES[-1:], ids=lambda v: str(v))
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_matches_torch(rows, h, d, p, inverse, seed):
    msg = f"seed={seed} rows={rows} H={h} D={d} P={p} inverse={inverse}"
    x, positions, freqs = make_case(seed, rows, h, d, p)
    grad = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(seed + 1))
    out, dx = fwd_bwd(lambda t: rope_tail(t, positions, freqs, inverse=inverse), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: apply_rope(t, positions, freqs, inverse=inverse), x, grad)
    assert out.shape == x.shape and out.dtype == x.dtype, msg
    assert rel_fro(out, ref) < 1e-5, f"{msg}: forward rel err {rel_fro(out, ref):.2e}"
    assert rel_fro(dx, dx_ref) < 1e-5, f"{msg}: dx rel err {rel_fro(dx, dx_ref):.2e}"
    assert torch.equal(out[..., : d - p], x[..., : d - p]), f"{msg}: the first D - P dims are not copied"


@pytest.mark.parametrize("rows,h,d,p", CPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_tail_in_place_matches_torch(rows, h, d, p, inverse, seed):
    """In place on the tail only: equal to apply_rope, the first D - P dims bitwise untouched, also on a view
    whose rows are farther apart than H * D (the tail's rows then are too)."""
    msg = f"seed={seed} rows={rows} H={h} D={d} P={p} inverse={inverse}"
    x, positions, freqs = make_case(seed, rows, h, d, p)
    ref = apply_rope(x, positions, freqs, inverse=inverse)
    wide = torch.randn(rows, h + 1, d, generator=torch.Generator().manual_seed(seed + 2))
    for target in (x.clone(), wide[:, 1:]):
        target.copy_(x)
        before = target.clone()
        assert rotate_tail_(target, positions, freqs, inverse=inverse) is target, msg
        assert rel_fro(target, ref) < 1e-5, f"{msg}: rel err {rel_fro(target, ref):.2e}"
        assert torch.equal(target[..., : d - p], before[..., : d - p]), f"{msg}: the first D - P dims changed"
    assert torch.equal(wide[:, 0], torch.randn(rows, h + 1, d, generator=torch.Generator().manual_seed(seed + 2))[:, 0])


def test_rotate_tail_rejects_a_strided_last_dim(seed):
    x, positions, freqs = make_case(seed, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="x: the last dim must be contiguous"):
        rotate_tail_(x.transpose(1, 2).contiguous().transpose(1, 2), positions, freqs)


def test_rope_tail_inverse_undoes_forward(seed):
    x, positions, freqs = make_case(seed, 11, 3, 32, 8, max_pos=2**20)
    there = rope_tail(x, positions, freqs)
    back = rope_tail(there, positions, freqs, inverse=True)
    assert rel_fro(back, x) < 1e-6, f"seed={seed}: rel err {rel_fro(back, x):.2e}"
    assert rel_fro(there, x) > 1e-3, f"seed={seed}: the forward rotated nothing"
    # The query rotation followed by the output's inverse rotation leaves the normalised x.
    back = rope_tail(head_norm_rope(x, positions, freqs, EPS), positions, freqs, inverse=True)
    assert rel_fro(back, rms_norm(x, EPS)) < 1e-6, f"seed={seed}"


def test_large_positions_and_yarn_frequencies(seed):
    """Positions up to 2^20 and fp32 frequencies (the table forms the angle in fp64 like apply_rope)."""
    x, positions, _ = make_case(seed, 12, 3, 32, 8, max_pos=2**20)
    freqs = torch.tensor([1.0, 0.137, 3.1e-3, 5.7e-7], dtype=torch.float32)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, EPS), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs), x, grad)
    assert rel_fro(out, ref) < 1e-5 and rel_fro(dx, dx_ref) < 1e-5, f"seed={seed}"
    cos, sin = rope_table(positions, freqs)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (12, 4)
    assert torch.allclose(cos * cos + sin * sin, torch.ones(()), atol=1e-6)


def test_strided_inputs_and_gradients(seed):
    big, positions, freqs = make_case(seed, 6, 8, 48, 8)
    x = big[:, 1::2, 8:40]  # head stride 96, row stride 384, last dim contiguous: D = 32
    assert not x.is_contiguous() and x.stride(2) == 1
    g = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(6, 4, 1, generator=g).expand(6, 4, 32)  # stride 0 along D: copied once
    leaf = big.detach().clone().requires_grad_(True)
    out = head_norm_rope(leaf[:, 1::2, 8:40], positions, freqs, EPS)
    (dx,) = torch.autograd.grad(out, leaf, grad)
    leaf_ref = big.detach().clone().requires_grad_(True)
    ref = reference_norm_rope(leaf_ref[:, 1::2, 8:40], positions, freqs)
    (dx_ref,) = torch.autograd.grad(ref, leaf_ref, grad)
    assert rel_fro(out, ref) < 1e-5 and rel_fro(dx, dx_ref) < 1e-5, f"seed={seed}"
    tail = rope_tail(x, positions, freqs, inverse=True)
    assert rel_fro(tail, apply_rope(x, positions, freqs, inverse=True)) < 1e-6, f"seed={seed}"


@pytest.mark.parametrize("config", [(1, 4), (2, 4), (16, 8)])
def test_pinned_config_head_blocks(config, seed):
    """Several head blocks per row (BLOCK_H < H, the last one partial) and a block wider than H, pinned by
    the ``config`` keyword in both directions."""
    x, positions, freqs = make_case(seed, 5, 3, 32, 8)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    kernel_options.reset_backends_ran()
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, EPS, config=config), x, grad)
    assert kernel_options.backends_ran()["norm_rope.config"] == "block_h={},num_warps={}".format(*config)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs), x, grad)
    assert rel_fro(out, ref) < 1e-5 and rel_fro(dx, dx_ref) < 1e-5, f"seed={seed} config={config}"
    tail = rope_tail(x, positions, freqs, config=config)
    assert rel_fro(tail, apply_rope(x, positions, freqs)) < 1e-6, f"seed={seed} config={config}"


@pytest.mark.parametrize("config", ["8", "3,4", "8,3", "a,b"])
def test_pinned_config_errors(monkeypatch, config, seed):
    """A bad pin fails where the options are resolved, naming the variable; a bad ``config`` keyword
    fails at the kernel, naming it."""
    monkeypatch.setenv("DSV4CP_TRITON_NORM_ROPE_CONFIG", config)
    with pytest.raises(ValueError, match=r"^DSV4CP_TRITON_NORM_ROPE_CONFIG(\.\w+)?:"):
        KernelOptions.resolve()
    x, positions, freqs = make_case(seed, 2, 3, 16, 4)
    with pytest.raises(ValueError, match=r"^config(\.\w+)?:"):
        rope_tail(x, positions, freqs, config=config)  # the keyword reads text as the option does


def test_large_eps(seed):
    x, positions, freqs = make_case(seed, 4, 3, 16, 4)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, 0.5), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs, 0.5), x, grad)
    assert rel_fro(out, ref) < 1e-5 and rel_fro(dx, dx_ref) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_through_interpreter(dtype, seed):
    x, positions, freqs = make_case(seed, 8, 3, 32, 8, dtype=dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, EPS), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs), x.float(), grad.float())
    assert out.dtype == dx.dtype == dtype, f"seed={seed}"
    assert rel_fro(out, ref) < 1e-2 and rel_fro(dx, dx_ref) < 1e-2, f"seed={seed}"
    tail, dtail = fwd_bwd(lambda t: rope_tail(t, positions, freqs, inverse=True), x, grad)
    tail_ref, dtail_ref = fwd_bwd(lambda t: apply_rope(t, positions, freqs, inverse=True), x.float(), grad.float())
    assert tail.dtype == dtail.dtype == dtype
    assert rel_fro(tail, tail_ref) < 1e-2 and rel_fro(dtail, dtail_ref) < 1e-2, f"seed={seed}"


def test_saved_tensors_hold_no_fp32_copy(seed):
    """Autograd keeps x in its own dtype and the [rows, H] rstd (plus positions / freqs), nothing else."""
    x, positions, freqs = make_case(seed, 5, 3, 32, 8, dtype=torch.bfloat16)
    leaf = x.requires_grad_(True)
    out = head_norm_rope(leaf, positions, freqs, EPS)
    saved = out.grad_fn.saved_tensors
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16, [(t.dtype, tuple(t.shape)) for t in saved]
    assert any(t.dtype == torch.float32 and t.shape == (5, 3) for t in saved)
    assert sum(t.numel() for t in saved) <= x.numel() + 5 * 3 + 5 + 4
    tail = rope_tail(leaf, positions, freqs)
    assert all(t.numel() <= 5 for t in tail.grad_fn.saved_tensors)


def test_empty_rows_and_no_grad(seed):
    x = torch.randn(0, 3, 16)
    positions = torch.zeros(0, dtype=torch.int64)
    freqs = torch.ones(2, dtype=torch.float64)
    assert head_norm_rope(x, positions, freqs, EPS).shape == (0, 3, 16)
    assert rope_tail(x, positions, freqs).shape == (0, 3, 16)
    x, positions, freqs = make_case(seed, 4, 3, 16, 8)
    with torch.no_grad():
        assert rel_fro(head_norm_rope(x, positions, freqs, EPS), reference_norm_rope(x, positions, freqs)) < 1e-5
    assert head_norm_rope(x, positions.to(torch.int32), freqs, EPS).grad_fn is None  # x needs no grad


@pytest.mark.parametrize(
    "field,make",
    [
        ("x", lambda x, p, f: (x[0], p, f)),
        ("x", lambda x, p, f: (x.double(), p, f)),
        ("x", lambda x, p, f: (x.to(torch.int32), p, f)),
        ("x", lambda x, p, f: (x[..., :15], p, f)),  # odd D
        ("positions", lambda x, p, f: (x, p[:-1], f)),
        ("positions", lambda x, p, f: (x, p.float(), f)),
        ("positions", lambda x, p, f: (x, p[:, None], f)),
        ("freqs", lambda x, p, f: (x, p, torch.ones(9, dtype=torch.float64))),  # P = 18 > D = 16
        ("freqs", lambda x, p, f: (x, p, f[:0])),
        ("freqs", lambda x, p, f: (x, p, torch.ones(2, dtype=torch.int64))),
    ],
)
def test_validation_names_the_field(field, make, seed):
    x, positions, freqs = make_case(seed, 4, 3, 16, 4)
    args = make(x, positions, freqs)
    with pytest.raises(ValueError, match=f"^{field}:"):
        head_norm_rope(*args, EPS)
    with pytest.raises(ValueError, match=f"^{field}:"):
        rope_tail(*args)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), "1e-6"])
def test_validation_eps(eps, seed):
    x, positions, freqs = make_case(seed, 4, 3, 16, 4)
    with pytest.raises(ValueError, match="^eps:"):
        head_norm_rope(x, positions, freqs, eps)


def test_use_fused_on_cpu_and_fp64():
    x = torch.randn(4, 3, 32)
    assert not use_fused(x)  # CPU: the torch path
    assert not use_fused(x.double())
    if HAS_CUDA:
        assert use_fused(x.cuda()) and use_fused(x.cuda().bfloat16(), torch.ones(16))
        assert not use_fused(x.cuda().double())
        assert not use_fused(x.cuda()[..., :24])  # D not a multiple of 16
        assert not use_fused(x.cuda(), torch.ones(17))  # P > D


# ------------------------------------------------------------------------------------------ GPU
def _flash_freqs() -> torch.Tensor:
    from dsv4cp.config import DSv4Config
    from dsv4cp.layer.rope import rope_frequencies

    return rope_frequencies(DSv4Config.preset("flash"), 4)  # YaRN frequencies of a C layer, P = 64


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_flash_head_norm_rope(dtype, seed):
    rows, h, d = 4096, 64, 512
    freqs = _flash_freqs()
    x, positions, _ = make_case(seed, rows, h, d, 64, max_pos=2**20, device="cuda", dtype=dtype)
    assert use_fused(x, freqs)
    grad = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(dtype)
    out, dx = fwd_bwd(lambda t: head_norm_rope(t, positions, freqs, EPS), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: reference_norm_rope(t, positions, freqs), x.float(), grad.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dx.dtype == dtype
    assert rel_fro(out, ref) < tol, f"seed={seed} {dtype}: forward rel err {rel_fro(out, ref):.2e}"
    assert rel_fro(dx, dx_ref) < tol, f"seed={seed} {dtype}: dx rel err {rel_fro(dx, dx_ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inverse", [False, True])
def test_gpu_flash_rope_tail(inverse, seed):
    rows, h, d = 4096, 64, 512
    freqs = _flash_freqs()
    x, positions, _ = make_case(seed, rows, h, d, 64, max_pos=2**20, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
    out, dx = fwd_bwd(lambda t: rope_tail(t, positions, freqs, inverse=inverse), x, grad)
    ref, dx_ref = fwd_bwd(lambda t: apply_rope(t, positions, freqs, inverse=inverse), x.float(), grad.float())
    assert rel_fro(out, ref) < 1e-2 and rel_fro(dx, dx_ref) < 1e-2, f"seed={seed}"
    assert torch.equal(out[..., :448], x[..., :448])


@pytest.mark.gpu
@needs_cuda
def test_gpu_flash_rotate_tail_in_place(seed):
    rows, h, d = 4096, 64, 512
    freqs = _flash_freqs()
    x, positions, _ = make_case(seed, rows, h, d, 64, max_pos=2**20, device="cuda", dtype=torch.bfloat16)
    ref = apply_rope(x.float(), positions, freqs, inverse=True)
    got = rotate_tail_(x.clone(), positions, freqs, inverse=True)
    assert rel_fro(got, ref) < 1e-2, f"seed={seed}"
    assert torch.equal(got[..., :448], x[..., :448])
