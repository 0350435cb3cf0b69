"""The compressor's gated pooling (docs/design.md §1.4) as Triton kernels: forward, and a backward that
recomputes the softmax and writes every input gradient directly (no atomics, no index_add).

Inputs (the shapes :func:`check_pool_inputs` enforces): ``values, gates [E, W]`` (bf16 / fp16 / fp32:
the compressor's projections of its E ext rows), ``ape [r, W]`` (the gate bias by position in the
group), ``group_rows [C, S]`` int64 (the ext row pooled by each group slot, ``-1`` = absent),
``group_valid [C]`` bool. ``S = halves * r`` with ``halves`` 1, or 2 for an overlapping compressor,
and ``W = halves * Dc``. Slot ``s`` reads the columns ``[h * Dc, (h + 1) * Dc)`` of its row, with
``h = s // r``, and the bias row ``s % r`` of ``ape`` (the row's position in its r-aligned group):

    pooled[j, c] = sum_s softmax_s(gates[rows[j, s], h*Dc + c] + ape[s % r, h*Dc + c]) * values[rows[j, s], h*Dc + c]

over the present slots of group j, in fp32; groups with no present slot, or not valid, give 0.
Result ``[C, Dc]`` fp32.

Backward (given ``dpooled [C, Dc]``), with ``p`` the softmax recomputed from the inputs and the saved
log-sum-exp: ``dvalues = p * dpooled``, ``dgates = p * dpooled * (values - pooled)`` at each present
slot's (row, column) element, written in the inputs' dtypes. Every (row, column) element belongs to at
most one present slot (a row of the layout lies in one group, and in the overlapping case feeds the
next group through the other half of the columns), so each program writes its elements alone; rows in
no group keep the zero the gradients are allocated with. ``dape [r, W]`` (fp32) is the per-slot column
sum of ``dgates``: each program stores its block's partial sums, reduced afterwards in torch (a fixed
order: deterministic).

Why: autograd of the torch composition runs an fp32 index_add of ``[C * S, W]`` values and gates,
the cat / masked_fill / softmax backward chain and fp32 copies of the gathered ``[C, S, W]`` tensors,
several times the forward's traffic.

Kernels: one program per (block of ``BLOCK_G`` groups, block of ``BLOCK_C`` columns) loops over the
``S`` slots, gathering ``[BLOCK_G, BLOCK_C]`` tiles (contiguous columns of BLOCK_G rows). The forward
keeps an online softmax (running max, sum and weighted sum) and stores the pooled tile and its
log-sum-exp; the backward reloads the gates and values of each slot.

Importing this module imports no triton (:func:`use_triton` and :func:`check_pool_inputs` are safe
anywhere): the kernels are built on first launch, compiled for CUDA tensors, interpreted for CPU tensors
(which needs ``TRITON_INTERPRET=1`` before triton's first import).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from dsv4cp.kernels import HAS_TRITON

__all__ = ["SUPPORTED_DTYPES", "check_pool_inputs", "compress_pool_triton", "use_triton"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

tl = None  # ``triton.language``, bound by _kernels() on first launch (the kernel bodies read this global)
_KERNELS = None


# ---------------------------------------------------------------------------------------------------
# Kernel bodies: plain functions built by _kernels() into triton.jit (CUDA) or interpreted (CPU) kernels.
# ---------------------------------------------------------------------------------------------------


def _pool_fwd_kernel(
    VALUES, GATES, APE, ROWS, VALID, OUT, LSE,  # pointers
    C, stride_v, stride_g,
    S: tl.constexpr, R: tl.constexpr, DC: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (group block, column block): OUT = the pooled tile, LSE = log(sum_s exp(gate_s)) (+inf where a
    group has no present slot).

    VALUES / GATES ``[E, W]`` (unit column stride), APE ``[R, W]`` fp32 contiguous, ROWS ``[C, S]`` int64,
    VALID ``[C]`` uint8, OUT / LSE ``[C, DC]`` fp32 contiguous; ``W = (S // R) * DC``."""
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    gmask = groups < C
    cmask = cols < DC
    valid = tl.load(VALID + groups, mask=gmask, other=0) != 0
    m = tl.full([BLOCK_G, BLOCK_C], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    for s in range(S):
        src = (s // R) * DC + cols  # this slot's half of the columns
        rows = tl.load(ROWS + groups.to(tl.int64) * S + s, mask=gmask, other=-1)
        present = valid & (rows >= 0)
        mask = present[:, None] & cmask[None, :]
        bias = tl.load(APE + (s % R) * (S // R) * DC + src, mask=cmask, other=0.0)
        g = tl.load(GATES + rows[:, None] * stride_g + src[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.where(mask, g + bias[None, :], float("-inf"))
        v = tl.load(VALUES + rows[:, None] * stride_v + src[None, :], mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, g)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no slot yet: keep exp() away from inf - inf
        alpha = tl.exp(m - shift)
        p = tl.exp(g - shift)
        denom = denom * alpha + p
        acc = acc * alpha + p * v
        m = m_new
    some = denom > 0
    safe = tl.where(some, denom, 1.0)
    out = tl.where(some, acc / safe, 0.0)
    lse = tl.where(some, m + tl.log(safe), float("inf"))
    offs = groups[:, None].to(tl.int64) * DC + cols[None, :]
    tile = gmask[:, None] & cmask[None, :]
    tl.store(OUT + offs, out, mask=tile)
    tl.store(LSE + offs, lse, mask=tile)


def _pool_bwd_kernel(
    VALUES, GATES, APE, ROWS, VALID, OUT, LSE, DOUT, DVALUES, DGATES, DAPE_PART,  # pointers
    C, stride_v, stride_g,
    S: tl.constexpr, R: tl.constexpr, DC: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (group block, column block) of the backward: for each slot, p = exp(gate + bias - LSE),
    DVALUES = p * DOUT, DGATES = p * DOUT * (value - OUT) at the slot's (row, column) elements, and the
    block's column sums of DGATES in ``DAPE_PART[block, s, :]``.

    Pointers as the forward's; DOUT ``[C, DC]`` fp32 contiguous, DVALUES / DGATES ``[E, W]`` contiguous
    (zero-filled by the caller), DAPE_PART ``[cdiv(C, BLOCK_G), S, DC]`` fp32."""
    block = tl.program_id(0)
    groups = block * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    gmask = groups < C
    cmask = cols < DC
    tile = gmask[:, None] & cmask[None, :]
    valid = tl.load(VALID + groups, mask=gmask, other=0) != 0
    offs = groups[:, None].to(tl.int64) * DC + cols[None, :]
    out = tl.load(OUT + offs, mask=tile, other=0.0)
    lse = tl.load(LSE + offs, mask=tile, other=float("inf"))
    dout = tl.load(DOUT + offs, mask=tile, other=0.0)
    w = (S // R) * DC
    for s in range(S):
        src = (s // R) * DC + cols
        rows = tl.load(ROWS + groups.to(tl.int64) * S + s, mask=gmask, other=-1)
        present = valid & (rows >= 0)
        mask = present[:, None] & cmask[None, :]
        bias = tl.load(APE + (s % R) * w + src, mask=cmask, other=0.0)
        g = tl.load(GATES + rows[:, None] * stride_g + src[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(VALUES + rows[:, None] * stride_v + src[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.where(mask, tl.exp(g + bias[None, :] - lse), 0.0)
        dv = p * dout
        dg = dv * (v - out)
        dst = rows[:, None] * w + src[None, :]
        tl.store(DVALUES + dst, dv.to(DVALUES.dtype.element_ty), mask=mask)
        tl.store(DGATES + dst, dg.to(DGATES.dtype.element_ty), mask=mask)
        tl.store(DAPE_PART + (block.to(tl.int64) * S + s) * DC + cols, tl.sum(dg, 0), mask=cmask)


def _kernels():
    """The module's kernel set, created (and triton imported) on first use."""
    global _KERNELS, tl
    if _KERNELS is None:
        from triton import language

        from dsv4cp.kernels._triton_launch import Kernels

        tl = language
        _KERNELS = Kernels("compress_pool triton", _pool_fwd_kernel, _pool_bwd_kernel, op="compress_pool")
    return _KERNELS


# ---------------------------------------------------------------------------------------------------
# Validation, dispatch, launch parameters.
# ---------------------------------------------------------------------------------------------------


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def check_pool_inputs(values, gates, ape, group_rows, group_valid) -> tuple[int, int]:
    """Raise ``ValueError`` naming the argument unless the pooling's inputs fit together (see the module
    docs); return ``(r, halves)``. Reads shapes, dtypes and devices only (no device work).

    Not checked (it would read the device): that rows lie in ``[-1, E)`` and that no (row, column)
    element is pooled by two slots; :func:`dsv4cp.cp.layout.build_layout`'s layouts satisfy both."""
    for name, t in (("values", values), ("gates", gates), ("ape", ape)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point:
            raise ValueError(f"{name}: must be a 2-D floating tensor, got {_describe(t)}")
    if gates.shape != values.shape:
        raise ValueError(f"gates: must have values' shape {tuple(values.shape)}, got {tuple(gates.shape)}")
    if not isinstance(group_rows, torch.Tensor) or group_rows.dim() != 2 or group_rows.dtype != torch.int64:
        raise ValueError(f"group_rows: must be a [C, S] int64 tensor, got {_describe(group_rows)}")
    if not isinstance(group_valid, torch.Tensor) or group_valid.dtype != torch.bool \
            or tuple(group_valid.shape) != (group_rows.shape[0],):
        raise ValueError(f"group_valid: must be a [C] = [{group_rows.shape[0]}] bool tensor, "
                         f"got {_describe(group_valid)}")
    r, width = ape.shape
    if r < 1 or width != values.shape[1]:
        raise ValueError(f"ape: must be [r, W] with r >= 1 and W = {values.shape[1]} (values' width), "
                         f"got {tuple(ape.shape)}")
    slots = group_rows.shape[1]
    if slots not in (r, 2 * r):
        raise ValueError(f"group_rows: slots S must be r = {r} or 2r (overlap), got {slots}")
    halves = slots // r
    if width % halves:
        raise ValueError(f"values: width {width} must split into {halves} halves (S = {slots}, r = {r})")
    for name, t in (("gates", gates), ("ape", ape), ("group_rows", group_rows), ("group_valid", group_valid)):
        if t.device != values.device:
            raise ValueError(f"{name}: must be on values' device {values.device}, got {t.device}")
    return r, halves


def use_triton(values: torch.Tensor, gates: torch.Tensor) -> bool:
    """Whether the compiled kernels serve these inputs: CUDA tensors in bf16 / fp16 / fp32 (fp64 stays on
    the torch reference), triton installed. Imports nothing."""
    return (HAS_TRITON and values.is_cuda and values.dtype in SUPPORTED_DTYPES
            and gates.dtype in SUPPORTED_DTYPES)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _launch_params(groups: int, slots: int, dc: int) -> tuple[int, int, int]:
    """``(BLOCK_G, BLOCK_C, num_warps)``: 128 columns (256-byte bf16 row segments per gather) and 16
    groups per program, fewer groups when there are few long groups (ratio 128: C = T / 128) so the grid
    still covers the device's SMs several times."""
    block_c = min(128, _pow2(dc))
    block_g = 16 if slots <= 16 else 4
    block_g = min(block_g, _pow2(max(groups, 1)))
    return block_g, block_c, 4


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _launch_shape(group_rows: torch.Tensor, dc: int):
    c, slots = group_rows.shape
    block_g, block_c, num_warps = _launch_params(c, slots, dc)
    return (-(-c // block_g), -(-dc // block_c)), block_g, block_c, num_warps


def _pool_fwd(values, gates, ape, group_rows, valid, r):
    c, slots = group_rows.shape
    dc = values.shape[1] * r // slots
    out = torch.empty(c, dc, dtype=torch.float32, device=values.device)
    lse = torch.empty_like(out)
    if out.numel() == 0:
        return out, lse
    grid, block_g, block_c, num_warps = _launch_shape(group_rows, dc)
    _kernels().build("_pool_fwd_kernel", values.device)[grid](
        values, gates, ape, group_rows, valid, out, lse,
        c, values.stride(0), gates.stride(0),
        S=slots, R=r, DC=dc, BLOCK_G=block_g, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out, lse


def _pool_bwd(dout, values, gates, ape, group_rows, valid, out, lse, r):
    c, slots = group_rows.shape
    width = values.shape[1]
    dc = width * r // slots
    dvalues = torch.zeros(values.shape, dtype=values.dtype, device=values.device)
    dgates = torch.zeros(gates.shape, dtype=gates.dtype, device=gates.device)
    if out.numel() == 0:
        return dvalues, dgates, torch.zeros(r, width, dtype=torch.float32, device=values.device)
    grid, block_g, block_c, num_warps = _launch_shape(group_rows, dc)
    part = torch.empty(grid[0], slots, dc, dtype=torch.float32, device=values.device)
    _kernels().build("_pool_bwd_kernel", values.device)[grid](
        values, gates, ape, group_rows, valid, out, lse, dout, dvalues, dgates, part,
        c, values.stride(0), gates.stride(0),
        S=slots, R=r, DC=dc, BLOCK_G=block_g, BLOCK_C=block_c, num_warps=num_warps,
    )
    # Slot s = h * r + k holds ape[k, h * Dc:(h + 1) * Dc].
    dape = part.sum(0).view(slots // r, r, dc).transpose(0, 1).reshape(r, width)
    return dvalues, dgates, dape


# ---------------------------------------------------------------------------------------------------
# Autograd function and the public API.
# ---------------------------------------------------------------------------------------------------


class _CompressPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, gates, ape, group_rows, group_valid, r):
        values, gates = _unit_columns(values), _unit_columns(gates)
        ape32 = ape.to(torch.float32).contiguous()
        valid = group_valid.contiguous().view(torch.uint8)  # triton has no bool pointers; read with stride 1
        rows = group_rows.contiguous()
        out, lse = _pool_fwd(values, gates, ape32, rows, valid, r)
        ctx.save_for_backward(values, gates, ape32, rows, valid, out, lse)
        ctx.r, ctx.ape_dtype = r, ape.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        values, gates, ape32, rows, valid, out, lse = ctx.saved_tensors
        dout = dout.to(torch.float32).contiguous()
        dvalues, dgates, dape = _pool_bwd(dout, values, gates, ape32, rows, valid, out, lse, ctx.r)
        needs = ctx.needs_input_grad
        return (dvalues if needs[0] else None, dgates if needs[1] else None,
                dape.to(ctx.ape_dtype) if needs[2] else None, None, None, None)


def compress_pool_triton(values: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, group_rows: torch.Tensor,
                         group_valid: torch.Tensor) -> torch.Tensor:
    """The gated pooling (module docs) by the Triton kernels, differentiable in values, gates and ape.

    Args:
        values, gates: ``[E, W]`` bf16 / fp16 / fp32 (unit column stride, else copied once).
        ape: ``[r, W]`` floating (read in fp32; its gradient in its own dtype).
        group_rows: ``[C, S]`` int64 ext rows, ``-1`` absent; ``S = r`` or ``2r`` (overlap).
        group_valid: ``[C]`` bool; an invalid group pools nothing.

    Returns:
        ``[C, W * r / S]`` fp32 pooled entries (0 for groups with no present slot).
    """
    r, _ = check_pool_inputs(values, gates, ape, group_rows, group_valid)
    for name, t in (("values", values), ("gates", gates)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype must be one of bf16, fp16, fp32 for the triton kernels, got {t.dtype}")
    if values.device.type not in ("cuda", "cpu"):
        raise ValueError(f"values: device must be cuda (or cpu under the Triton interpreter), got {values.device}")
    return _CompressPool.apply(values, gates, ape, group_rows, group_valid, r)
