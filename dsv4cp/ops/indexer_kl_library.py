"""The fused KL pass of :mod:`dsv4cp.ops.indexer_kl` as a ``torch.library`` custom op, what
``torch.compile`` traces in its place (Dynamo cannot trace the kernel's launch):

* ``dsv4cp::indexer_kl_rows(target_mass [rows, K], scores [rows, K], valid [rows, K] bool, row_weight [rows],
  with_grad) -> (row_loss [rows], dscores [rows, K] or [0, 0])`` fp32 (the kernel of
  :mod:`dsv4cp.kernels.indexer_kl_triton`), differentiable in ``scores`` through the saved ``dscores``
  (computed when ``with_grad``): the backward scales it by the rows' incoming gradient.

The op takes no kernel options (the pass has none); it notes ``indexer_kl`` -> ``triton`` as it runs.
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options


@torch.library.custom_op("dsv4cp::indexer_kl_rows", mutates_args=())
def indexer_kl_rows(target_mass: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor,
                    row_weight: torch.Tensor, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from dsv4cp.kernels.indexer_kl_triton import kl_rows_triton  # lazy: imports triton

    kernel_options.note_backend("indexer_kl", "triton")
    row_loss, dscores = kl_rows_triton(target_mass, scores, valid, row_weight, with_grad=with_grad)
    return row_loss, dscores if dscores is not None else scores.new_empty((0, 0))


@indexer_kl_rows.register_fake
def _(target_mass, scores, valid, row_weight, with_grad):
    grad_shape = scores.shape if with_grad else (0, 0)
    return scores.new_empty(scores.shape[:1]), scores.new_empty(grad_shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_rows, _grad_dscores):
    (dscores,) = ctx.saved_tensors
    return None, grad_rows[:, None] * dscores, None, None, None


indexer_kl_rows.register_autograd(_backward, setup_context=_setup_context)
