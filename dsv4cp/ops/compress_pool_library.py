"""The compressor's pooling kernels (:mod:`dsv4cp.kernels.compress_pool_triton`) as ``torch.library`` custom ops.

Under ``torch.compile`` :func:`dsv4cp.ops.compress_pool.compress_pool` calls these opaque ops where it
would run the Triton kernels (Dynamo cannot trace their autograd function):

* ``dsv4cp::compress_pool_fwd(values [E, W], gates [E, W], ape [r, W], group_rows [C, S], group_valid [C])
  -> (pooled [C, Dc], lse [C, Dc])``, both fp32; differentiable in values, gates and ape;
* ``dsv4cp::compress_pool_bwd(dpooled, values, gates, ape, group_rows, group_valid, pooled, lse)
  -> (dvalues, dgates, dape)`` in the inputs' dtypes.

The same kernels and layout preparation as the eager autograd function (unit column strides, ``ape`` in
fp32, ``group_valid`` read as bytes). The pooling has no kernel option.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.kernels import compress_pool_triton as kernels


def _prepared(values, gates, ape, group_rows, group_valid):
    """The kernels' view of the inputs: unit column strides, fp32 ``ape``, bytes for the bool flags."""
    return (kernels._unit_columns(values), kernels._unit_columns(gates), ape.to(torch.float32).contiguous(),
            group_rows.contiguous(), group_valid.contiguous().view(torch.uint8))


@torch.library.custom_op("dsv4cp::compress_pool_fwd", mutates_args=())
def compress_pool_fwd(values: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, group_rows: torch.Tensor,
                      group_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kernel_options.note_backend("compress_pool", "triton")
    v, g, ape32, rows, valid = _prepared(values, gates, ape, group_rows, group_valid)
    return kernels._pool_fwd(v, g, ape32, rows, valid, ape.shape[0])


@compress_pool_fwd.register_fake
def _(values, gates, ape, group_rows, group_valid):
    shape = (group_rows.shape[0], values.shape[1] * ape.shape[0] // group_rows.shape[1])
    return values.new_empty(shape, dtype=torch.float32), values.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("dsv4cp::compress_pool_bwd", mutates_args=())
def compress_pool_bwd(dpooled: torch.Tensor, values: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                      group_rows: torch.Tensor, group_valid: torch.Tensor, pooled: torch.Tensor, lse: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v, g, ape32, rows, valid = _prepared(values, gates, ape, group_rows, group_valid)
    dout = dpooled.to(torch.float32).contiguous()
    dvalues, dgates, dape = kernels._pool_bwd(dout, v, g, ape32, rows, valid, pooled, lse, ape.shape[0])
    return dvalues, dgates, dape.to(ape.dtype)


@compress_pool_bwd.register_fake
def _(dpooled, values, gates, ape, group_rows, group_valid, pooled, lse):
    return values.new_empty(values.shape), gates.new_empty(gates.shape), ape.new_empty(ape.shape)


def _setup_context(ctx, inputs, output) -> None:
    values, gates, ape, group_rows, group_valid = inputs
    pooled, lse = output
    ctx.save_for_backward(values, gates, ape, group_rows, group_valid, pooled, lse)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dpooled, _dlse):
    values, gates, ape, group_rows, group_valid, pooled, lse = ctx.saved_tensors
    dvalues, dgates, dape = compress_pool_bwd(dpooled, values, gates, ape, group_rows, group_valid, pooled, lse)
    return dvalues, dgates, dape, None, None


compress_pool_fwd.register_autograd(_backward, setup_context=_setup_context)
