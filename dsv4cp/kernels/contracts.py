"""What every implementation of an op must agree on, shared by the torch references in :mod:`dsv4cp.ops`
and the kernels here: the sparse-attention input checks, the indexer's top-k tie rule and its
``key_row_limit`` check.

A leaf module (torch only): ``dsv4cp.ops`` imports the kernels, never the reverse, so a rule both sides
apply lives below both.
"""

from __future__ import annotations

import torch

__all__ = ["check_key_row_limit", "check_sparse_attention_inputs", "pack_selection_keys", "select_top",
           "select_top_packed"]


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


def check_key_row_limit(key_row_limit) -> tuple[int, int]:
    """The indexer top-k's ``key_row_limit`` checked: a tuple ``(base >= 0, ratio >= 1)`` of ints (query
    row t sees no key row at or past ``base + t // ratio + 1``), returned; None gives ``(0, 0)`` (no
    bound). Shared by the torch op and the Triton kernels."""
    if key_row_limit is None:
        return 0, 0
    ok = (isinstance(key_row_limit, tuple) and len(key_row_limit) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in key_row_limit))
    if not ok or key_row_limit[0] < 0 or key_row_limit[1] < 1:
        raise ValueError(f"key_row_limit: must be a tuple (base >= 0, ratio >= 1) of ints, got {key_row_limit!r}")
    return key_row_limit


_LOW_BITS = 0xFFFFFFFF


def _ordered_bits(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys of fp32 ``scores`` that sort as the floats do (-0.0 folded into +0.0 so that zeros tie,
    as torch.topk ranks them; -inf lowest)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


_NEG_INF_KEY = int(_ordered_bits(torch.tensor([float("-inf")]))[0])


def pack_selection_keys(scores: torch.Tensor) -> torch.Tensor:
    """``[rows, columns]`` int64 selection keys of ``scores [rows, columns]`` (fp32, bf16 or fp16): the
    fp32 score's order-preserving bits in the high 32 bits (``-0.0`` folded into ``+0.0``, non-finite
    scores mapped to ``-inf``, the lowest) and ``2^32 - 1 - column`` in the low 32 bits. A larger key is
    a better entry under the tie rule of :func:`select_top`; the layout that
    :func:`select_top_packed` decodes and the Triton score kernel's packed epilogue writes."""
    if scores.shape[1] >= _LOW_BITS:
        raise ValueError(f"scores: at most {_LOW_BITS - 1} columns, got {scores.shape[1]}")
    scores = scores.masked_fill(~torch.isfinite(scores), float("-inf"))
    columns = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return (_ordered_bits(scores) << 32) | (_LOW_BITS - columns)


def select_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` best finite columns of each row of ``scores [rows, columns]``, ties at the cut going
    to the lowest columns (ReLU makes exact-zero scores common, and the rule must not depend on the CP
    layout). Returns ``[rows, keep]`` int64 columns in increasing order, ``-1`` past a row's finite ones.

    One ``torch.topk`` over int64 keys that hold the score's order-preserving bits in the high half and
    ``2^32 - 1 - column`` in the low half (:func:`pack_selection_keys`, :func:`select_top_packed`): a
    single comparison then IS the rule (higher score, then lower column), so no cut value, tie count or
    second selection is needed (8 bytes per score, one pass).
    fp32, bf16 and fp16 scores are exact in fp32 keys; fp64 scores (the fp64 reference path) are ranked by
    a stable descending sort instead, which sends ties to the lowest column just the same. Non-finite
    scores (-inf: invisible; +inf and NaN: from non-finite inputs) are never chosen (docs/design.md §4.5)."""
    _check_keep(keep, scores.shape[1])
    if scores.dtype == torch.float64:
        scores = scores.masked_fill(~torch.isfinite(scores), float("-inf"))
        order = torch.sort(scores + 0.0, dim=1, descending=True, stable=True)  # + 0.0: -0.0 ties +0.0
        best = order.indices[:, :keep]
        chosen = torch.where(torch.isfinite(order.values[:, :keep]), best, scores.shape[1]).sort(dim=1).values
        return torch.where(chosen < scores.shape[1], chosen, -1)
    return select_top_packed(pack_selection_keys(scores), keep)


def select_top_packed(keys: torch.Tensor, keep: int) -> torch.Tensor:
    """:func:`select_top` of already packed ``keys [rows, columns]`` int64 (the layout of
    :func:`pack_selection_keys`, packed over all ``columns``): one ``torch.topk`` over the keys, then the
    decode. Returns ``[rows, keep]`` int64 columns in increasing order, ``-1`` past a row's finite ones
    (keys whose high half is ``-inf``'s are never chosen)."""
    if keys.dim() != 2 or keys.dtype != torch.int64:
        raise ValueError(f"keys: must be a [rows, columns] int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
    columns = keys.shape[1]
    if columns >= _LOW_BITS:
        raise ValueError(f"columns: at most {_LOW_BITS - 1}, got {columns}")
    _check_keep(keep, columns)
    top = torch.topk(keys, keep, dim=1, sorted=False).values
    finite = (top >> 32) > _NEG_INF_KEY
    chosen = torch.where(finite, _LOW_BITS - (top & _LOW_BITS), columns)  # invalid ones sort last
    chosen = chosen.sort(dim=1).values
    return torch.where(chosen < columns, chosen, -1)


def _check_keep(keep: int, columns: int) -> None:
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= columns:
        raise ValueError(f"keep: must be an int in [0, {columns}] (the columns), got {keep!r}")
