"""Fused per-head RMS norm + partial RoPE of the attention queries, and the tail-only rotation of the
attention outputs (Triton), replacing ``apply_rope(rms_norm(q, eps), positions, freqs)`` and
``apply_rope(out, positions, freqs, inverse=True)`` (the ops of :mod:`dsv4cp.ops.norm_rope`) on CUDA.

Ops on ``x [rows, H, D]`` with ``P = 2 * len(freqs)`` rotary dims (the LAST ``P`` dims, interleaved
pairs ``(D-P+2i, D-P+2i+1)``, angle ``positions[r] * freqs[i]``, exactly as
:func:`dsv4cp.ops.norm_rope.apply_rope`):

* :func:`head_norm_rope`: ``y = x * rsqrt(mean(x^2) + eps)`` per (row, head) in fp32 (weightless RMS
  norm), then the rotation of y's tail; the output is written in x's dtype. Autograd saves x (its own
  dtype), the rstd ``[rows, H]`` fp32, the positions and the frequencies: no fp32 copy of the tensor.
  Backward: the gradient's tail is rotated back (angle ``-pos * freq``), then
  ``dx = rstd * (g - y * mean(g * y))`` with y recomputed from x and rstd, in fp32; dx in x's dtype.
* :func:`rope_tail`: the first ``D - P`` dims copied, the tail rotated by ``+-pos * freq``; backward
  rotates the gradient's tail by the opposite angle. Autograd saves the positions and frequencies only.
* :func:`rotate_tail_`: the tail rotated IN PLACE (not differentiable), reading and writing only the last
  ``P`` dims: for a buffer its caller owns, e.g. the output projection's input gradient
  (:func:`dsv4cp.ops.grouped_linear.head_group_projection`).

Why: the torch composition upcasts the whole ``[L, H, D]`` tensor to fp32 (and autograd keeps several
fp32 copies) and rebuilds it with ``torch.cat`` to rotate 64 of its 512 dims. At the flash shape
(32768 rows x 64 heads x 512, bf16: 2.1 GB per tensor) the fused forward moves x in and y out
(4.3 GB, ~1 ms at H200 bandwidth) and the backward g and x in and dx out (6.4 GB, ~1.5 ms);
:func:`rope_tail` moves 4.3 GB each way.

Kernels (one program per (row, block of ``BLOCK_H`` heads), the whole head dim as one tile,
``BLOCK_D = next_pow2(D)``):

* ``_rope_fwd_kernel``: loads ``[BLOCK_H, BLOCK_D]``, optionally normalises it (``NORM``), then views the
  tile as pairs (``reshape [BLOCK_H, BLOCK_D/2, 2]`` + ``split``: the pair dim stays inside a thread),
  rotates pair ``j`` by the row's table entry ``j - (D-P)/2`` (pairs of the first ``D - P`` dims pass
  through unchanged), ``join``s the pairs back and stores the tile contiguously: one read and one write
  of every element, no gather of the tail. The rstd is stored per (row, head).
* ``_norm_rope_bwd_kernel``: loads the gradient and x, rotates the gradient back, RMS-norm backward.
  :func:`rope_tail`'s backward is the forward kernel with the angle negated.

Angles. The kernels read ``cos / sin [rows, P/2]`` fp32 tables built in torch the way ``apply_rope``
builds them (fp64 angle ``pos * freq``, fp64 cos / sin, rounded to fp32: 3e-8 absolute error, and
bit-identical to apply_rope's fp32 factors): ``rows * P * 4`` bytes (8 MB at the flash shape) and a few
tiny torch kernels, recomputed in the backward from the saved positions. Forming the angle in fp32 in
the kernel (fp32 position times fp32 frequency, fp32 sin / cos) is NOT precise enough: measured against
the fp64 path with the flash preset's frequencies (``rope_frequencies``, W and C/H layers, P = 64), the
max absolute cos / sin error is 5e-4 at positions <= 2^14, 7e-3 at <= 2^17 and 5.5e-2 at <= 2^20 (the
fp32 product's rounding: the ulp of a 1e6 rad angle is 0.0625) -- far above bf16's 4e-3 relative step.

Launch: ``BLOCK_H = min(next_pow2(H), max(1, 4096 // BLOCK_D))`` heads (8 at D = 512: a [8, 512] tile,
16 fp32 values per thread at 8 warps), 4 warps up to 2048 elements per tile, else 8.
The ``config`` keyword (the op hands it the kernel option ``triton_norm_rope_config``,
``"block_h,num_warps"``) pins both (powers of two). Checked by
compiling for sm_90 with Triton 3.9 without a GPU (``triton.compile`` with 16-divisible pointers and
strides, as launches specialise them, + ptxas -v), bf16 at D = 512, [8, 512] tiles, 8 warps: forward 40
registers (32 for the rope-only variant), backward 48, no spill; 16-byte vector loads and stores of
the tile; the reshape / split / join stay in registers (pairs within a thread: ``sizePerThread
[1, 4, 2]``); 1 KB of shared memory only for re-laying-out the [BLOCK_D/2] cos / sin vectors and rstd.
fp16 / fp32 alike (fp32 forward 40, backward 59 registers).

Importing this module imports no triton (:func:`use_fused` is safe anywhere, e.g. in
:mod:`dsv4cp.ops.norm_rope`): the kernels are built on first launch (compiled for CUDA tensors, on
Triton's interpreter for CPU tensors, which needs ``TRITON_INTERPRET=1`` before triton's first import),
through :class:`dsv4cp.kernels._triton_launch.Kernels`.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from dsv4cp import kernel_options
from dsv4cp.kernels import HAS_TRITON

__all__ = ["MAX_TABLES", "SUPPORTED_DTYPES", "clear_rope_tables", "head_norm_rope", "rope_table", "rope_tail",
           "rotate_tail_", "use_fused"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

tl = None  # ``triton.language``, bound by _kernels() on first launch (the kernel bodies read this global)
_KERNELS = None


# ---------------------------------------------------------------------------------------------------
# Kernel bodies: plain functions built by _kernels() into triton.jit (CUDA) or interpreted (CPU) kernels.
# ---------------------------------------------------------------------------------------------------


def _rope_fwd_kernel(
    X, COS, SIN, OUT, RSTD,  # pointers
    H, stride_xr, stride_xh, stride_or, stride_oh, eps,
    D: tl.constexpr, HALF_NOPE: tl.constexpr, HALF_P: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, NORM: tl.constexpr, INVERSE: tl.constexpr,
):
    """One (row r, head block): OUT[r, h] = rotate(norm(X[r, h])) for the block's heads.

    X ``[rows, H, D]`` (last dim contiguous), COS / SIN ``[rows, HALF_P]`` fp32, OUT ``[rows, H, D]``
    (last dim contiguous; OUT may be X: each program loads its tile before storing it), RSTD ``[rows, H]``
    fp32 (written iff NORM). Pair j = dims (2j, 2j+1) of the tile is rotated by table entry
    ``j - HALF_NOPE`` when that is in ``[0, HALF_P)``, by minus the angle if INVERSE."""
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < D)[None, :]
    x = tl.load(X + r * stride_xr + heads[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
        tl.store(RSTD + r * H + heads, rstd, mask=hmask)
        x = x * rstd[:, None]

    i = tl.arange(0, BLOCK_D // 2) - HALF_NOPE  # table entry of each pair
    tail = (i >= 0) & (i < HALF_P)
    c = tl.load(COS + r * HALF_P + i, mask=tail, other=1.0)[None, :]
    s = tl.load(SIN + r * HALF_P + i, mask=tail, other=0.0)[None, :]
    if INVERSE:
        s = -s
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
    rot_even = tl.where(tail[None, :], even * c - odd * s, even)  # where: the first D-P dims pass exactly
    rot_odd = tl.where(tail[None, :], even * s + odd * c, odd)
    y = tl.reshape(tl.join(rot_even, rot_odd), (BLOCK_H, BLOCK_D))
    tl.store(OUT + r * stride_or + heads[:, None] * stride_oh + d[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def _norm_rope_bwd_kernel(
    G, X, RSTD, COS, SIN, DX,  # pointers
    H, stride_gr, stride_gh, stride_xr, stride_xh,
    D: tl.constexpr, HALF_NOPE: tl.constexpr, HALF_P: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One (row r, head block) of head_norm_rope's backward: gy = G with its tail rotated back (angle
    ``-pos * freq``), y = X * rstd, DX = rstd * (gy - y * mean(gy * y)) (fp32, stored in DX's dtype).

    G, X ``[rows, H, D]`` (last dim contiguous), RSTD ``[rows, H]`` fp32, COS / SIN ``[rows, HALF_P]``
    fp32, DX ``[rows, H, D]`` contiguous."""
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < D)[None, :]
    g = tl.load(G + r * stride_gr + heads[:, None] * stride_gh + d[None, :], mask=mask, other=0.0)
    g = g.to(tl.float32)

    i = tl.arange(0, BLOCK_D // 2) - HALF_NOPE
    tail = (i >= 0) & (i < HALF_P)
    c = tl.load(COS + r * HALF_P + i, mask=tail, other=1.0)[None, :]
    s = tl.load(SIN + r * HALF_P + i, mask=tail, other=0.0)[None, :]
    g_even, g_odd = tl.split(tl.reshape(g, (BLOCK_H, BLOCK_D // 2, 2)))
    gy_even = tl.where(tail[None, :], g_even * c + g_odd * s, g_even)  # transpose of the rotation
    gy_odd = tl.where(tail[None, :], g_odd * c - g_even * s, g_odd)
    gy = tl.reshape(tl.join(gy_even, gy_odd), (BLOCK_H, BLOCK_D))

    x = tl.load(X + r * stride_xr + heads[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + r * H + heads, mask=hmask, other=0.0)[:, None]
    y = x.to(tl.float32) * rstd
    mean_gy = tl.sum(gy * y, 1)[:, None] / D
    dx = rstd * (gy - y * mean_gy)
    tl.store(DX + r * H * D + heads[:, None] * D + d[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def _kernels():
    """The module's kernel set, created (and triton imported) on first use."""
    global _KERNELS, tl
    if _KERNELS is None:
        from triton import language

        from dsv4cp.kernels._triton_launch import Kernels

        tl = language
        _KERNELS = Kernels("norm_rope triton", _rope_fwd_kernel, _norm_rope_bwd_kernel, op="norm_rope")
    return _KERNELS


# ---------------------------------------------------------------------------------------------------
# Dispatch, validation, launch parameters.
# ---------------------------------------------------------------------------------------------------


def use_fused(x: torch.Tensor, freqs: torch.Tensor | None = None) -> bool:
    """Whether the fused kernels serve ``x [rows, H, D]``: a CUDA bf16 / fp16 / fp32 tensor (fp64 stays on
    the torch path), triton installed, D a multiple of 16 and, when ``freqs`` is given, ``0 < P <= D``
    (P = 2 * len(freqs) is even by construction). Imports nothing."""
    if not (HAS_TRITON and x.is_cuda and x.dim() == 3 and x.dtype in SUPPORTED_DTYPES):
        return False
    d = x.shape[2]
    if d == 0 or d % 16 != 0:
        return False
    return freqs is None or 0 < 2 * freqs.numel() <= d


def _check(x, positions, freqs, eps=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x: must be a [rows, heads, D] tensor, got {_describe(x)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: dtype must be one of bf16, fp16, fp32 for the triton kernels, got {x.dtype}")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"x: device must be cuda (or cpu under the Triton interpreter), got {x.device}")
    rows, _, d = x.shape
    if d == 0 or d % 2 != 0:
        raise ValueError(f"x: head dim D must be positive and even (rotary pairs), got {d}")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] != rows:
        raise ValueError(f"positions: must be a [rows] = [{rows}] integer tensor, got {_describe(positions)}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"positions: dtype must be an integer type, got {positions.dtype}")
    if positions.device != x.device:
        raise ValueError(f"positions: must be on x's device {x.device}, got {positions.device}")
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 1 or not freqs.dtype.is_floating_point:
        raise ValueError(f"freqs: must be a 1-D floating [P/2] tensor, got {_describe(freqs)}")
    if not 0 < 2 * freqs.numel() <= d:
        raise ValueError(f"freqs: rotary dims P = 2 * len(freqs) must be in [2, D = {d}], got {2 * freqs.numel()}")
    if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [rows, P/2]`` fp32 of the angles ``positions * freqs``, formed in fp64 exactly as
    :func:`dsv4cp.ops.norm_rope.apply_rope` forms them (then rounded to fp32).

    Kept for the :data:`MAX_TABLES` most recent ``(positions, freqs)``: a layer's positions come from its
    batch's layout, built once per batch (:mod:`dsv4cp.cp.layout_cache`), and every rotation of a step
    (forward and backward of the queries, keys, compressed entries and outputs) reads one of three tables,
    so each is formed once instead of ~12 times a step (6 small kernels each). A kept table is reused for
    the same memory, shape and strides of both tensors, neither written since (autograd version
    counters), while the tensor the positions view is alive (held weakly: a batch's tables go with its
    layout; the frequencies, a few numbers, are held). Formed afresh, and not kept, while a CUDA graph is
    captured (the graph must compute it) or ``torch.compile`` traces."""
    if torch.compiler.is_compiling() or (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _form_table(positions, freqs)
    base = positions if positions._base is None else positions._base
    key = (positions.data_ptr(), positions.shape, positions.stride(), positions.dtype, positions.device,
           freqs.data_ptr(), freqs.shape, freqs.stride(), freqs.dtype, freqs.device)
    versions = (positions._version, freqs._version)
    kept = _TABLES.get(key)
    if kept is not None and kept.base() is base and kept.versions == versions:
        _TABLES.move_to_end(key)
        return kept.table
    table = _form_table(positions, freqs)
    _TABLES[key] = _KeptTable(weakref.ref(base, lambda _ref, key=key: _drop_table(key)), freqs, versions, table)
    _TABLES.move_to_end(key)
    while len(_TABLES) > MAX_TABLES:
        _TABLES.popitem(last=False)
    return table


MAX_TABLES = 8
"""RoPE tables kept (least recently used dropped first): three per layer kind of a batch."""


class _KeptTable(NamedTuple):
    base: weakref.ref  # the tensor the positions view; dead once the batch's layout is gone
    freqs: torch.Tensor  # held: its memory cannot be reused while the table is kept
    versions: tuple[int, int]
    table: tuple[torch.Tensor, torch.Tensor]


_TABLES: OrderedDict[tuple, _KeptTable] = OrderedDict()


def _drop_table(key: tuple) -> None:
    kept = _TABLES.get(key)
    if kept is not None and kept.base() is None:
        del _TABLES[key]


def clear_rope_tables() -> None:
    """Forget the kept tables (frees their memory)."""
    _TABLES.clear()


def _form_table(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.to(torch.float64)[:, None] * freqs.to(positions.device)[None, :]
    return angles.cos().to(torch.float32).contiguous(), angles.sin().to(torch.float32).contiguous()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


Config = tuple[int, int] | None
"""A pinned launch ``(block_h, num_warps)`` (the kernel option ``triton_norm_rope_config``, powers of two,
checked where it is read), or None: the default rule."""


def _launch_params(h: int, d: int, config: Config) -> tuple[int, int, int]:
    """``(BLOCK_D, BLOCK_H, num_warps)``, from the pinned ``config`` or the default rule; notes the launch
    as ``norm_rope.config``."""
    block_d = _pow2(d)
    if config is not None:
        block_h, num_warps = kernel_options.OPTIONS["triton_norm_rope_config"].parse(config, "config")
    else:
        block_h = min(_pow2(h), max(1, 4096 // block_d))
        num_warps = 4 if block_h * block_d <= 2048 else 8
    kernel_options.note_backend("norm_rope.config", f"block_h={block_h},num_warps={num_warps}")
    return block_d, block_h, num_warps


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(2) == 1 or t.shape[2] == 1 else t.contiguous()


def _rope_fwd(x, cos, sin, *, norm: bool, inverse: bool, eps: float = 0.0, out: torch.Tensor | None = None,
              config: Config = None):
    """``(out, rstd or None)``: the forward kernel (also rope_tail's backward, with inverse flipped).
    ``out``: where to write (x itself rotates in place; last dim contiguous); default a new tensor."""
    x = _last_contiguous(x)
    rows, h, d = x.shape
    if out is None:
        out = torch.empty(rows, h, d, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, h, dtype=torch.float32, device=x.device) if norm else None
    if out.numel() == 0:
        return out, rstd
    block_d, block_h, num_warps = _launch_params(h, d, config)
    half_p = cos.shape[1]
    kernel = _kernels().build("_rope_fwd_kernel", x.device)
    kernel[(rows, -(-h // block_h))](
        x, cos, sin, out, rstd if norm else cos,  # dummy RSTD pointer when not normalising
        h, x.stride(0), x.stride(1), out.stride(0), out.stride(1), float(eps),
        D=d, HALF_NOPE=(d - 2 * half_p) // 2, HALF_P=half_p, BLOCK_D=block_d, BLOCK_H=block_h,
        NORM=norm, INVERSE=inverse, num_warps=num_warps,
    )
    return out, rstd


def _norm_rope_bwd(g, x, rstd, cos, sin, config: Config = None):
    g, x = _last_contiguous(g), _last_contiguous(x)
    rows, h, d = x.shape
    dx = torch.empty(rows, h, d, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    block_d, block_h, num_warps = _launch_params(h, d, config)
    half_p = cos.shape[1]
    kernel = _kernels().build("_norm_rope_bwd_kernel", x.device)
    kernel[(rows, -(-h // block_h))](
        g, x, rstd, cos, sin, dx,
        h, g.stride(0), g.stride(1), x.stride(0), x.stride(1),
        D=d, HALF_NOPE=(d - 2 * half_p) // 2, HALF_P=half_p, BLOCK_D=block_d, BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return dx


# ---------------------------------------------------------------------------------------------------
# Autograd functions and the public API.
# ---------------------------------------------------------------------------------------------------


class _HeadNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, freqs, eps, config):
        cos, sin = rope_table(positions, freqs)
        out, rstd = _rope_fwd(x, cos, sin, norm=True, inverse=False, eps=eps, config=config)
        ctx.save_for_backward(x, rstd, positions, freqs)
        ctx.config = config
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, rstd, positions, freqs = ctx.saved_tensors
        if grad_out is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        cos, sin = rope_table(positions, freqs)
        if grad_out.dtype != x.dtype:
            grad_out = grad_out.to(x.dtype)
        return _norm_rope_bwd(grad_out, x, rstd, cos, sin, ctx.config), None, None, None, None


class _RopeTail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, freqs, inverse, config):
        cos, sin = rope_table(positions, freqs)
        out, _ = _rope_fwd(x, cos, sin, norm=False, inverse=inverse, config=config)
        ctx.save_for_backward(positions, freqs)
        ctx.inverse, ctx.config = inverse, config
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        positions, freqs = ctx.saved_tensors
        if grad_out is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        cos, sin = rope_table(positions, freqs)
        grad, _ = _rope_fwd(grad_out, cos, sin, norm=False, inverse=not ctx.inverse, config=ctx.config)
        return grad, None, None, None, None


def head_norm_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, eps: float, *,
                   config: Config = None) -> torch.Tensor:
    """``apply_rope(rms_norm(x, eps), positions, freqs)`` fused (differentiable in x).

    Args:
        x: ``[rows, H, D]`` bf16 / fp16 / fp32 (D even; the last dim contiguous, else copied once).
        positions: ``[rows]`` integer document positions (angles formed in fp64, see the module docs).
        freqs: ``[P/2]`` angular frequencies (fp64 or fp32), ``2 <= P <= D``.
        eps: the RMS norm's epsilon.
        config: a pinned launch ``(block_h, num_warps)`` of both directions (:data:`Config`).

    Returns:
        ``[rows, H, D]`` contiguous, x's dtype: the per-(row, head) RMS-normalised x (fp32 math) with its
        last P dims rotated pairwise by ``positions * freqs``.
    """
    _check(x, positions, freqs, eps)
    return _HeadNormRope.apply(x, positions, freqs.detach(), float(eps), config)


def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, *,
              config: Config = None) -> torch.Tensor:
    """``apply_rope(x, positions, freqs, inverse)`` fused (differentiable in x): the first ``D - P`` dims
    copied, the last ``P`` rotated by ``+positions * freqs`` (``-`` when ``inverse``) in fp32.

    Args and result as :func:`head_norm_rope` (without eps)."""
    _check(x, positions, freqs)
    return _RopeTail.apply(x, positions, freqs.detach(), bool(inverse), config)


def rotate_tail_(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, *,
                 config: Config = None) -> torch.Tensor:
    """In place, not differentiable: rotate the last ``P`` dims of ``x [rows, H, D]`` by ``+positions *
    freqs`` (``-`` when ``inverse``), as :func:`rope_tail` does, reading and writing only those dims (the
    first ``D - P`` are not touched: ``P / D`` of the traffic of a rotating copy). Returns ``x``.

    ``x``: bf16 / fp16 / fp32 with its last dim contiguous (e.g. a gradient buffer its caller owns)."""
    _check(x, positions, freqs)
    if x.stride(2) != 1 and x.shape[2] > 1:
        raise ValueError(f"x: the last dim must be contiguous to rotate in place, got strides {x.stride()}")
    if x.numel() == 0:
        return x
    cos, sin = rope_table(positions, freqs)
    tail = x[..., x.shape[2] - 2 * freqs.numel():]
    _rope_fwd(tail, cos, sin, norm=False, inverse=inverse, out=tail, config=config)
    return x
