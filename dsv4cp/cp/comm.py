"""Differentiable CP collectives (DESIGN 3.2, 3.4, 3.5).

* :func:`exchange_halo`: forward sends each rank's last rows to the next rank; backward returns the
  halo's gradient and adds it into the sender's rows.
* :func:`all_gather_rows`: forward all-gathers row blocks rank-major; backward reduce-scatters.
  In ``overlap="async"`` mode the forward collective is only LAUNCHED by this call and completed by
  :meth:`PendingGather.wait`, and the backward reduce-scatter is launched as soon as its gradient
  exists while the wait is deferred to the point where the local producer's backward needs it.

Every rank issues the same collectives in the same order; with one rank they are identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv4cp.profiling.nvtx import nvtx_range

OVERLAP_MODES = ("none", "async")



def _all_gather_tensor(*args, **kwargs):
    # torch 2.13 renamed the tensor-in/tensor-out collectives; the GPU image's 2.11 has only the old names.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_tensor(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# ---------------------------------------------------------------------------- halo
class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, halo: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.halo, ctx.group = halo, group
        with nvtx_range("halo.fwd"):
            received = _shift_to_next(x[-halo:].contiguous(), group)
            return torch.cat((received, x), dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        halo = ctx.halo
        with nvtx_range("halo.bwd"):
            returned = _shift_to_previous(grad[:halo].contiguous(), ctx.group)
            grad_x = grad[halo:].clone()
            grad_x[-halo:] += returned
        return grad_x, None, None


def p2p_shift(send: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send ``send`` to rank + step and receive the same shape from rank - step (zeros at the edges)."""
    size, rank = group_size_and_rank(group)
    received = torch.zeros_like(send)
    ops = []
    if 0 <= rank + step < size:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, rank + step), group))
    if 0 <= rank - step < size:
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, rank - step), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def _shift_to_next(rows: torch.Tensor, group) -> torch.Tensor:
    return p2p_shift(rows, group, +1)


def _shift_to_previous(rows: torch.Tensor, group) -> torch.Tensor:
    return p2p_shift(rows, group, -1)


def exchange_halo(x_local: torch.Tensor, halo: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[halo + L, ...]``: the previous rank's last ``halo`` rows (zeros on rank 0), then ``x_local``."""
    if group is None or halo == 0 or dist.get_world_size(group) == 1:
        return x_local
    return _HaloExchange.apply(x_local, halo, group)


# ---------------------------------------------------------------------------- gather / scatter
@dataclass
class PendingGather:
    """Handles of one gathered tensor's collectives: the forward all-gather and backward reduce-scatter."""

    name: str = "kv"
    """Which gathered tensor ("kv" or "index_k"): names its profiling ranges."""
    forward_work: object | None = None
    backward_work: object | None = None
    gathered: torch.Tensor | None = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        """The gathered tensor, once its forward all-gather has completed (differentiable)."""
        return _CompleteGather.apply(self.gathered, self)


class _DeferredBackwardWait(torch.autograd.Function):
    """Identity whose backward waits for the reduce-scatter launched by the gather's backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, pending: PendingGather) -> torch.Tensor:
        ctx.pending = pending
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.pending.backward_work is not None:
            with nvtx_range(f"reducescatter.{ctx.pending.name}.wait"):
                ctx.pending.backward_work.wait()
            ctx.pending.backward_work = None
        return grad, None


class _LaunchGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group, pending: PendingGather, async_op: bool) -> torch.Tensor:
        ctx.group, ctx.pending, ctx.async_op = group, pending, async_op
        size = dist.get_world_size(group)
        with nvtx_range(f"allgather.{pending.name}.launch"):
            out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
            work = _all_gather_tensor(out, local.contiguous(), group=group, async_op=async_op)
        pending.forward_work = work if async_op else None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        with nvtx_range(f"reducescatter.{ctx.pending.name}.launch"):
            local = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            work = _reduce_scatter_tensor(local, grad.contiguous(), group=ctx.group, async_op=ctx.async_op)
        ctx.pending.backward_work = work if ctx.async_op else None
        return local, None, None, None


class _CompleteGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered: torch.Tensor, pending: PendingGather) -> torch.Tensor:
        if pending.forward_work is not None:
            with nvtx_range(f"allgather.{pending.name}.wait"):
                pending.forward_work.wait()
            pending.forward_work = None
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_gather_rows(
    local: torch.Tensor, group: dist.ProcessGroup | None, overlap: str = "none", name: str = "kv"
) -> PendingGather:
    """Launch the all-gather of ``local [n, ...]`` into ``[cp * n, ...]`` (rank-major).

    Returns a :class:`PendingGather`; call ``.wait()`` where the gathered rows are needed. Gradients
    of the gathered rows are reduce-scattered (summed) back to their owners. ``name`` ("kv" or
    "index_k") names the collectives' profiling ranges.
    """
    pending = PendingGather(name)
    if group is None or dist.get_world_size(group) == 1:
        pending.gathered = local
        return pending
    async_op = overlap == "async"
    deferred = _DeferredBackwardWait.apply(local, pending) if async_op else local
    pending.gathered = _LaunchGather.apply(deferred, group, pending, async_op)
    return pending
