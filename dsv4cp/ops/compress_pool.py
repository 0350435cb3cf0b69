"""The compressor's gated pooling (docs/design.md §1.4): the op, its torch reference and its dispatch.

:func:`compress_pool` pools, for each of ``C`` groups, the ``S`` ext rows ``group_rows[j]`` of the
compressor's projections ``values, gates [E, W]`` into one ``[Dc]`` entry under a per-channel softmax
over the slots, the gates biased by ``ape [r, W]`` by position in the group. With overlap (ratio 4,
``S = 2r``, ``W = 2 Dc``) slots ``[0, r)`` take the A half (columns ``[0, Dc)``) of group j-1's rows
and slots ``[r, 2r)`` the B half (``[Dc, 2 Dc)``) of group j's; without, ``S = r`` and ``W = Dc``.
Exact formula, shapes and the contract on the layout: :mod:`dsv4cp.kernels.compress_pool_triton`.

Backends: ``"torch"`` (:func:`compress_pool_torch`, autograd through gathers and a softmax, any device
and float dtype, fp64 stays fp64) and ``"triton"`` (fused forward and an atomic-free backward; bf16 /
fp16 / fp32, CUDA, or CPU under Triton's interpreter). ``"auto"`` takes triton where it serves the
inputs (:func:`dsv4cp.kernels.compress_pool_triton.use_triton`: CUDA) and torch otherwise.
"""

from __future__ import annotations

import torch

from dsv4cp.kernels import compress_pool_triton
from dsv4cp.kernels.compress_pool_triton import check_pool_inputs, use_triton
from dsv4cp.ops.custom_op_library import note_eager

__all__ = ["POOL_BACKENDS", "compress_pool", "compress_pool_torch"]

POOL_BACKENDS = ("auto", "torch", "triton")


def compress_pool_torch(values: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, group_rows: torch.Tensor,
                        group_valid: torch.Tensor) -> torch.Tensor:
    """:func:`compress_pool` in torch: gathers the groups' rows (index_select: its backward is an
    index_add, not a sort), applies the slot biases and the softmax over slots, in fp32 (fp64 for fp64).

    Shapes as :func:`compress_pool`; ``[C, Dc]`` in ``promote_types(values.dtype, fp32)``."""
    r, halves = check_pool_inputs(values, gates, ape, group_rows, group_valid)
    work = torch.promote_types(values.dtype, torch.float32)
    c, slots = group_rows.shape
    dc = values.shape[1] // halves
    present = (group_rows >= 0) & group_valid[:, None]
    flat = group_rows.clamp_min(0).flatten()
    v = values.to(work).index_select(0, flat).view(c, slots, values.shape[1])  # (C may be 0: no -1 here)
    g = gates.to(work).index_select(0, flat).view(c, slots, gates.shape[1])
    if halves == 2:  # slots [0, r) read the A half of the columns, slots [r, 2r) the B half
        v = torch.cat((v[:, :r, :dc], v[:, r:, dc:]), dim=1)
        g = torch.cat((g[:, :r, :dc], g[:, r:, dc:]), dim=1)
    # Slot s = h * r + k reads ape[k, h * Dc:(h + 1) * Dc]: its row's position in the r-aligned group.
    bias = ape.to(work).view(r, halves, dc).transpose(0, 1).reshape(slots, dc)
    g = (g + bias).masked_fill(~present[..., None], float("-inf"))
    some = present.any(1)
    g = g.masked_fill(~some[:, None, None], 0.0)  # keep the softmax of an empty group finite
    pooled = (torch.softmax(g, dim=1) * v).sum(1)
    return pooled * some[:, None].to(work)


def compress_pool(values: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, group_rows: torch.Tensor,
                  group_valid: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Gated per-channel pooling of the compressor's groups, differentiable in values, gates and ape.

    Args:
        values, gates: ``[E, W]`` floating: the compressor's value and gate projections of its E ext rows
            (bf16 from the linear layers; the math runs in fp32).
        ape: ``[r, W]`` floating: the gate bias by position in the group (r = the compression ratio).
        group_rows: ``[C, S]`` int64 ext row of each group slot, ``-1`` absent; ``S = r``, or ``2r`` with
            overlap (then ``W = 2 Dc``). No (row, column) element may be pooled by two slots (the triton
            backward writes each element once; :func:`dsv4cp.cp.layout.build_layout` guarantees it).
        group_valid: ``[C]`` bool; invalid groups pool nothing.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (module docs).

    Returns:
        ``[C, Dc]`` pooled entries in ``promote_types(values.dtype, fp32)`` (fp32 from the triton
        backend); 0 for invalid groups and groups with no present slot.
    """
    if backend not in POOL_BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(POOL_BACKENDS)}, got {backend!r}")
    check_pool_inputs(values, gates, ape, group_rows, group_valid)
    if backend == "triton" or (backend == "auto" and use_triton(values, gates)):
        note_eager("compress_pool", "triton")
        if torch.compiler.is_compiling():  # one opaque node: .compress_pool_library
            pooled, _lse = torch.ops.dsv4cp.compress_pool_fwd(values, gates, ape, group_rows, group_valid)
            return pooled
        return compress_pool_triton.compress_pool_triton(values, gates, ape, group_rows, group_valid)
    note_eager("compress_pool", "torch")
    return compress_pool_torch(values, gates, ape, group_rows, group_valid)
