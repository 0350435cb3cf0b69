"""What every implementation of an op must agree on, shared by the torch references in :mod:`dsv4cp.ops`
and the kernels here: the sparse-attention input checks and the indexer's top-k tie rule.

A leaf module (torch only): ``dsv4cp.ops`` imports the kernels, never the reverse, so a rule both sides
apply lives below both.
"""

from __future__ import annotations

import torch

__all__ = ["check_sparse_attention_inputs", "select_top"]


def check_sparse_attention_inputs(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, topk_length: torch.Tensor | None
) -> None:
    """Raise ``ValueError`` naming the argument unless the inputs follow the op contract of
    :func:`dsv4cp.ops.sparse_attention`: ``q [T, H, D]`` floating, ``kv [N, D]`` of q's dtype,
    ``idx [T, Kt]`` int32/int64, ``sink [H]`` floating, ``topk_length [T]`` int32/int64 or None, all on
    q's device."""
    for name, tensor in (("q", q), ("kv", kv), ("idx", idx), ("sink", sink)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: must be a tensor, got {type(tensor).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: must be [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"kv: must be [N, {d}], got shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv: dtype must match q ({q.dtype}), got {kv.dtype}")
    if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"q: dtype must be a floating type, got {q.dtype}")
    if idx.dim() != 2 or idx.shape[0] != t:
        raise ValueError(f"idx: must be [{t}, Kt], got shape {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: must be int32 (or int64), got {idx.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink: must be [{h}], got shape {tuple(sink.shape)}")
    if not sink.is_floating_point():
        raise ValueError(f"sink: must be a floating tensor (fp32 in the model), got {sink.dtype}")
    if topk_length is not None and topk_length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_length: must be int32 (or int64), got {topk_length.dtype}")
    if topk_length is not None and topk_length.shape != (t,):
        raise ValueError(f"topk_length: must be [{t}], got shape {tuple(topk_length.shape)}")
    for name, tensor in (("kv", kv), ("idx", idx), ("sink", sink), ("topk_length", topk_length)):
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")


def select_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` best finite columns of each row of ``scores [rows, columns]``, ties at the cut going
    to the lowest columns (ReLU makes exact-zero scores common, and the rule must not depend on the CP
    layout). Returns ``[rows, keep]`` int64 columns in increasing order, ``-1`` past a row's finite ones."""
    cut = torch.topk(scores, keep, dim=1).values[:, -1:]
    above = scores > cut
    at_cut = scores == cut
    room = keep - above.sum(1, keepdim=True)
    chosen = (above | (at_cut & (at_cut.cumsum(1) <= room))) & torch.isfinite(scores)
    columns = torch.arange(scores.shape[1], 0, -1, device=scores.device)  # lower column = larger key
    where = torch.topk(chosen * columns, keep, dim=1).indices
    return torch.where(chosen.gather(1, where), where, -1)
