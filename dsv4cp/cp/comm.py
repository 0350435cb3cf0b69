"""Differentiable CP collectives (docs/design.md §3.2, 3.4, 3.5).

* :func:`exchange_halo`: forward sends each rank's last rows to the next rank; backward returns the
  halo's gradient and adds it into the sender's rows.
* :func:`all_gather_rows`: forward all-gathers row blocks rank-major; backward reduce-scatters.
  In ``overlap="async"`` mode the forward collective is only LAUNCHED by this call and completed by
  :meth:`PendingGather.wait`; in backward the reduce-scatter is launched as soon as its gradient is
  complete, and its wait is held back (:func:`hold_backward_waits`) until the query path's backward
  has run, just before the local producer's backward needs the scattered rows. Graph edges, not the
  engine's choice among ready nodes, fix that order; both modes build the same graph.

Every rank issues the same collectives in the same order; with one rank they are identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv4cp.choices import OVERLAP_MODES  # noqa: F401  (the modes' names: checked without torch)
from dsv4cp.cp.emulate import emulated_shift, fill_all_gather, fill_reduce_scatter, is_emulated
from dsv4cp.profiling.nvtx import nvtx_range


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
    if is_emulated(group):  # one process alone: its neighbours' rows are drawn, not received
        return emulated_shift(send, group, step)
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
class _GatherState:
    """What the gather's autograd nodes share: the collectives' handles and the scattered gradient.

    It holds no tensor of the autograd graph (nodes keep it in their context; a graph tensor here
    would make a reference cycle through C++ that keeps every step's graph alive).
    """

    name: str
    group: dist.ProcessGroup
    async_op: bool
    forward_work: object | None = None
    backward_work: object | None = None
    grad_local: torch.Tensor | None = None
    """This rank's rows of the reduce-scattered gradient ``[n, ...]``, valid once the scatter has completed."""
    scattered: torch.Tensor | None = None
    """The gradient whose reduce-scatter was launched (None: not launched yet)."""

    def launch_backward(self, grad: torch.Tensor) -> None:
        if self.scattered is not None:
            return
        size = dist.get_world_size(self.group)
        with nvtx_range(f"reducescatter.{self.name}.launch"):
            local = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            work = _reduce_scatter_tensor(local, grad.contiguous(), group=self.group, async_op=self.async_op)
            fill_reduce_scatter(local, grad, self.group)  # an emulated rank's rows (dsv4cp.cp.emulate)
        self.grad_local, self.scattered = local, grad
        self.backward_work = work if self.async_op else None

    def check_launched_with(self, grad: torch.Tensor) -> None:
        launched = self.scattered
        if launched is not None and (launched.data_ptr(), launched.shape) != (grad.data_ptr(), grad.shape):
            raise RuntimeError(
                f"gather {self.name!r}: its reduce-scatter was launched early with a gradient that other "
                "consumers of the gathered rows have since added to"
            )


@dataclass
class PendingGather:
    """One gathered tensor: the launched forward all-gather and, in backward, its reduce-scatter.

    Backward order (docs/design.md §3.5) is fixed by graph edges, not by the order in which the autograd
    engine happens to pick ready nodes (it prefers the most recently created one):

    * the reduce-scatter is launched by the backward of :meth:`wait`'s node, which autograd runs as
      soon as the gathered rows' gradient is complete (every consumer has contributed), or earlier
      by :meth:`launch_backward` from inside the node that completes it;
    * ``wait(ahead_of=t)`` makes the backward of ``t``'s producer depend on that node, so it starts
      only after the launch;
    * the reduce-scatter's wait is the backward of the launch node, which also needs the gradient
      of ``wait_token``: :func:`hold_backward_waits` hands that over only once its tensor's gradient
      is complete. The local producer's backward (the compressor) runs after the wait.
    """

    name: str = "kv"
    """Which gathered tensor ("kv" or "index_k"): names its profiling ranges."""
    gathered: torch.Tensor | None = field(default=None, repr=False)
    """``[cp * n, ...]``, filled once the all-gather has completed: read it through :meth:`wait`."""
    wait_token: torch.Tensor | None = field(default=None, repr=False)
    """0-dim output of the launch node whose gradient releases the backward wait (None: no collective)."""
    _state: _GatherState | None = field(default=None, repr=False)

    def wait(self, ahead_of: torch.Tensor | None = None) -> torch.Tensor:
        """The gathered tensor, once its forward all-gather has completed (differentiable).

        ``ahead_of``: a tensor computed before this call whose producer's backward must start only
        after this gather's reduce-scatter is launched (the query path, docs/design.md §3.5).
        """
        if self._state is None:
            return self.gathered
        token = _OrderToken.apply(ahead_of) if ahead_of is not None and ahead_of.requires_grad else None
        return _CompleteGather.apply(self.gathered, self._state, token)

    def launch_backward(self, grad: torch.Tensor) -> None:
        """Launch the reduce-scatter of the gathered rows' COMPLETE gradient ``grad [cp * n, ...]``.

        For the node that produces ``grad`` when it is the gathered rows' only differentiable
        consumer (the recomputed attention): the launch then precedes the rest of that node's
        backward. The wait node's own launch becomes a no-op; it checks it received this gradient.
        """
        if self._state is not None:
            self._state.launch_backward(grad)


class _OrderToken(torch.autograd.Function):
    """A 0-dim tensor whose consumer's backward must run before the backward of ``x``'s producer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return None  # an ordering edge only: adds nothing to x's gradient


class _HoldBackwardWaits(torch.autograd.Function):
    """Identity on ``x``; its backward, run once x's gradient is complete, releases the waits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *wait_tokens: torch.Tensor) -> torch.Tensor:
        ctx.tokens = len(wait_tokens)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad,) + (None,) * ctx.tokens


def hold_backward_waits(x: torch.Tensor, *gathers: PendingGather | None) -> torch.Tensor:
    """``x``, unchanged, with the backward waits of ``gathers``' reduce-scatters held until x's
    gradient is complete: everything computed from the result is back-propagated while the
    reduce-scatters fly (docs/design.md §3.5). Call it before the gathers' rows are waited for in forward."""
    tokens = [g.wait_token for g in gathers if g is not None and g.wait_token is not None]
    if not tokens or not x.requires_grad:
        return x
    return _HoldBackwardWaits.apply(x, *tokens)


class _LaunchGather(torch.autograd.Function):
    """Forward: launch the all-gather. Backward: wait for the reduce-scatter and hand this rank's
    rows of the gradient to their producer."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, state: _GatherState) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.state = state
        ctx.set_materialize_grads(False)  # the gathered rows' gradient arrives through the state
        size = dist.get_world_size(state.group)
        with nvtx_range(f"allgather.{state.name}.launch"):
            out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
            work = _all_gather_tensor(out, local.contiguous(), group=state.group, async_op=state.async_op)
            fill_all_gather(out, local, state.group)  # an emulated rank's peers' rows (dsv4cp.cp.emulate)
        state.forward_work = work if state.async_op else None
        return out, local.new_zeros(())

    @staticmethod
    def backward(ctx, _grad_gathered, _grad_token):
        state = ctx.state
        if state.backward_work is not None:
            with nvtx_range(f"reducescatter.{state.name}.wait"):
                state.backward_work.wait()
        grad_local = state.grad_local
        state.backward_work = state.grad_local = state.scattered = None
        return grad_local, None


class _CompleteGather(torch.autograd.Function):
    """Forward: wait for the all-gather. Backward: launch the reduce-scatter of the complete gradient."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor, state: _GatherState, _ahead_token) -> torch.Tensor:
        ctx.state = state
        ctx.set_materialize_grads(False)
        if state.forward_work is not None:
            with nvtx_range(f"allgather.{state.name}.wait"):
                state.forward_work.wait()
            state.forward_work = None
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            ctx.state.check_launched_with(grad)
            ctx.state.launch_backward(grad)
        return None, None, None


def all_gather_rows(
    local: torch.Tensor, group: dist.ProcessGroup | None, overlap: str = "none", name: str = "kv"
) -> PendingGather:
    """Launch the all-gather of ``local [n, ...]`` into ``[cp * n, ...]`` (rank-major).

    Returns a :class:`PendingGather`; call ``.wait()`` where the gathered rows are needed. Gradients
    of the gathered rows are reduce-scattered (summed) back to their owners; with ``overlap="async"``
    the collectives are asynchronous and their waits deferred (see :class:`PendingGather`).
    ``name`` ("kv" or "index_k") names the collectives' profiling ranges.
    """
    if group is None or dist.get_world_size(group) == 1:
        return PendingGather(name, gathered=local)
    state = _GatherState(name, group, async_op=overlap == "async")
    gathered, token = _LaunchGather.apply(local, state)
    return PendingGather(name, gathered, token if token.requires_grad else None, state)
