"""Triton kernel of the slot compaction the library adapters hand FlashMLA and cuDNN
(:func:`dsv4cp.kernels._library.compact_slots`, whose torch version is the reference).

``compact_slots_triton(idx [T, Kt] int, topk_length [T] int | None, slots) -> (out [T, slots] int32,
length [T] int32)``: per row, the valid slots (``idx >= 0`` and, with ``topk_length``, before it) in their
order, then ``-1``; ``length`` their count.

Kernel (``_compact_kernel``): one program per row, the whole row in one tile (``Kt`` up to a few thousand
slots): a prefix sum of the valid flags gives each valid slot its place, one masked scatter store writes
it, and a second store writes ``-1`` over the places from the count on (disjoint addresses, so no
ordering between the two). Why a kernel: the torch version is a running count, a batched binary search
and a gather, each a pass over ``[T, slots]`` plus int64 temporaries; this reads the row once and writes
the output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["compact_slots_triton"]


@triton.jit
def _compact_kernel(IDX, LENGTH_IN, OUT, LENGTH_OUT, KT, SLOTS, stride_it, stride_ot,
                    HAS_LENGTH: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``t = program id``: ``OUT[t, :count]`` the valid slots of ``IDX[t, :KT]`` in order, ``OUT[t,
    count:SLOTS] = -1``, ``LENGTH_OUT[t] = count`` (``BLOCK >= max(KT, SLOTS)``, a power of 2)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < KT
    slot = tl.load(IDX + t * stride_it + j, mask=inside, other=-1)
    valid = inside & (slot >= 0)
    if HAS_LENGTH:
        valid = valid & (j < tl.load(LENGTH_IN + t))
    flags = valid.to(tl.int32)
    place = tl.cumsum(flags, 0) - 1
    count = tl.sum(flags, 0)
    tl.store(OUT + t * stride_ot + place, slot.to(tl.int32), mask=valid)
    tl.store(OUT + t * stride_ot + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= count) & (j < SLOTS))
    tl.store(LENGTH_OUT + t, count)


def compact_slots_triton(idx: torch.Tensor, topk_length: torch.Tensor | None,
                         slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``slots >= Kt``. CUDA tensors, or CPU ones under Triton's interpreter."""
    t, kt = idx.shape
    if slots < kt:
        raise ValueError(f"slots: must be at least idx's {kt} slots, got {slots}")
    out = torch.empty(t, slots, dtype=torch.int32, device=idx.device)
    length = torch.empty(t, dtype=torch.int32, device=idx.device)
    if t == 0:
        return out, length
    idx = idx.contiguous()
    lengths_in = topk_length.contiguous() if topk_length is not None else length  # unread without HAS_LENGTH
    _compact_kernel[(t,)](idx, lengths_in, out, length, kt, slots, idx.stride(0), out.stride(0),
                          HAS_LENGTH=topk_length is not None, BLOCK=triton.next_power_of_2(max(kt, slots, 1)))
    return out, length
