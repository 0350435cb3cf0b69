"""The indexer's top-k selection as a pass sees it: recorded while a layer runs (the layer does not
return it), numbered by entry so that CP degrees compare, and imposed on another layer.

The parity pass imposes the checked layer's selection on the fp64 reference, so that everything after
the selection is compared on the same entries (an entry that ties with another within the checked
dtype's rounding may be picked either way), and judges the selection itself apart: the share of the
reference's own choices that the checked layer also chose.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dsv4cp.cp.layout import RankLayout
from dsv4cp.layer import attention as attention_module
from dsv4cp.ops.indexer import indexer_scores


@contextmanager
def recording_selection(sink: list[torch.Tensor]) -> Iterator[None]:
    """Record every top-k selection the layer makes (its rows of the gathered buffer) while the block runs."""
    original = attention_module.indexer_topk

    def recording(*args, **kwargs):
        selected = original(*args, **kwargs)
        sink.append(selected[0] if isinstance(selected, tuple) else selected)  # (rows, scores) with scores
        return selected

    attention_module.indexer_topk = recording
    try:
        yield
    finally:
        attention_module.indexer_topk = original


@contextmanager
def imposed_selection(rows: torch.Tensor, own: list[torch.Tensor]) -> Iterator[None]:
    """Make a one-rank layer select ``rows [T, K]`` (entry numbers, which are its gathered rows at CP = 1)
    instead of its own choice, which is still made and appended to ``own``. With ``return_scores`` the
    imposed entries' scores come from the layer's own indexer (:func:`~dsv4cp.ops.indexer.indexer_scores`)."""
    original = attention_module.indexer_topk

    def imposing(q, w, keys, *args, return_scores: bool = False, **kwargs):
        chosen = original(q, w, keys, *args, return_scores=False, **kwargs)
        own.append(chosen)
        if chosen.shape != rows.shape:
            raise ValueError(f"selection: the imposed rows are {tuple(rows.shape)}, the layer selects "
                             f"{tuple(chosen.shape)}")
        forced = rows.to(chosen.device)
        if not return_scores:
            return forced
        with torch.no_grad():
            scores = indexer_scores(q, w, keys, forced)
        return forced, torch.where(forced >= 0, scores, 0.0)

    attention_module.indexer_topk = imposing
    try:
        yield
    finally:
        attention_module.indexer_topk = original


def global_entries(selected: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    """``[rows, K]`` gathered-buffer rows -> the entries' batch-wide numbers ``eid`` (``-1`` stays ``-1``):
    the same entry has the same number at every CP degree."""
    rows = selected.clamp_min(0)
    doc = layout.gathered_doc[rows].clamp_min(0)
    eid = layout.doc_first_eid[doc] + layout.gathered_j[rows]
    return torch.where(selected >= 0, eid, -1)


def agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of ``want``'s chosen entries (``[T, K]``, ``-1`` for none) that ``got`` chose in the same
    row; 1.0 when ``want`` chose none."""
    chosen, same = int((want >= 0).sum()), 0
    if chosen == 0:
        return 1.0
    for start in range(0, want.shape[0], _AGREEMENT_ROWS):  # [rows, K, K] comparisons, a block at a time
        w, g = want[start:start + _AGREEMENT_ROWS], got[start:start + _AGREEMENT_ROWS].to(want.device)
        same += int(((w.unsqueeze(2) == g.unsqueeze(1)).any(dim=2) & (w >= 0)).sum())
    return same / chosen


_AGREEMENT_ROWS = 128
"""Rows per block of :func:`agreement` (at K = 1024: 128 MiB of comparisons)."""
