"""Peak memory per rank of one layer step, estimated before anything is allocated.

The commands that measure refuse a step whose estimate exceeds the device's free memory (instead of
dying in the allocator after minutes of set-up). The estimate is a sum of named terms, each a tensor
family the layer keeps alive at the peak; per-row tensors scale with the rank's rows ``L = T / cp``
(``E = L + halo`` for the window-KV and compressor paths), the gathered compressed rows ``G`` with
the whole batch.

Terms (``b`` = bytes of the dtype; widths per row; C/H/W = layer kinds):

* parameters ``b P`` and, with backward, their gradients ``b P``;
* per own row, kept for backward: the input ``x`` and output (``2 hidden``), the query latent before
  and after its norm (``2 q_lora_rank``), the query-sized tensors (the up-projection, the normed and
  rotated queries, the attention output and its inverse rotation: :data:`QUERY_COPIES_FWD` times
  ``H D``), the grouped output latent (``o_groups o_lora_rank``), the key indices (int32 ``W + K``),
  the attention lse (fp32 ``H``); C layers: indexer queries and head weights (``2 Hi Di + Hi``);
* per halo-extended row: the window KV before/after norm and RoPE (``3 D``) and, C/H, the compressor
  projections (``2 x 2 D`` for the overlapping ratio-4 compressor, ``2 D`` otherwise; C adds the
  indexer compressor's ``2 x 2 Di``);
* the key buffer ``(E + G) D`` and, C, the gathered indexer keys ``G Di``;
* backward only: the query-sized gradients alive together at the peak (:data:`QUERY_COPIES_BWD`
  more ``H D`` per row) and the fp32 key-buffer gradient ``4 (E + G) D``;
* chunked temporaries of the torch paths, bounded by their budgets (:data:`TEMPORARY_BYTES`).

``recompute`` drops one query copy from what the forward keeps, but the backward rebuilds it before
the peak, so the fwd+bwd peak does not change (as measured: 15.62 vs 15.69 GiB below).

Accuracy: calibrated on the committed 2 x H200 records (flash C layer, one 65536-token document,
fwd+bwd, bf16: measured allocator peak 27.71 GiB at CP = 1 and 15.62 / 15.69 GiB per rank at CP = 2
without / with recompute; estimate 30.1 and 15.6 GiB: +9 % and 0 %) and on CPU fp32 runs (process
peak RSS above the baseline; ``tests/model/test_memory_estimate.py``): flash C 1024 and 2048 tokens
fwd+bwd measured 1.21 and 1.12 x the estimate, flash W 2048 1.08 x, flash C 2048 fwd 0.88 x, tiny C
65536 fwd+bwd 1.33 x. So: within 10 % on the GPU path, within about a third on CPU, where the torch
path keeps fp32 copies in the norms that the fused GPU path does not. Small batches (parameters and
allocator overhead dominate) and other layer kinds on GPU are not calibrated.
"""

from __future__ import annotations

import torch

from dsv4cp.config import INDEXER_RATIO, DSv4Config, layer_kind
from dsv4cp.model.counts import DocsLike, rank_counts

QUERY_COPIES_FWD = 4
"""``[L, H D]`` tensors the forward keeps for backward (see the module docstring)."""
QUERY_COPIES_BWD = 2
"""Further ``[L, H D]`` gradients alive at the backward peak (dq and the output gradient)."""
TEMPORARY_BYTES = 512 * 2**20
"""Chunked temporaries (gathered keys and logits of the torch attention and indexer paths)."""

_DIRECTIONS = ("fwd", "fwd+bwd")


def parameter_count(cfg: DSv4Config, ratio: int) -> int:
    """Parameters of one ``ratio`` layer (weights of every projection, norms and tables ignored)."""
    h, d, hidden, ql = cfg.n_heads, cfg.head_dim, cfg.hidden, cfg.q_lora_rank
    count = hidden * ql + ql * h * d + hidden * d  # wq_a, wq_b, wkv
    count += h * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * hidden  # wo_a (grouped), wo_b
    kind = layer_kind(ratio)
    if kind != "W":
        overlap = 2 if ratio == INDEXER_RATIO else 1
        count += 2 * hidden * overlap * d  # compressor wkv and wgate
    if kind == "C":
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        count += ql * hi * di + hidden * hi + 2 * hidden * 2 * di  # indexer wq, head weights, compressor
    return count


def peak_bytes_estimate(
    cfg: DSv4Config, ratio: int, packed: DocsLike, cp: int, direction: str, dtype: torch.dtype,
    recompute: bool = False,
) -> int:
    """Estimated peak bytes per rank of one ``direction`` step (``fwd`` or ``fwd+bwd``) of a layer.

    Args:
        cfg, ratio: the layer.
        packed: the whole batch (PackedSeqs or document lengths); ``packed.total`` rows.
        cp: ranks the rows are split over.
        direction: ``fwd`` (forward with the autograd graph kept) or ``fwd+bwd``.
        dtype: parameter and activation dtype.
        recompute: selective recompute (changes the forward-only estimate, not the fwd+bwd peak).

    Raises ``ValueError`` naming the field for a bad direction, dtype or split (as the cost model).
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction: must be one of {_DIRECTIONS}, got {direction!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
    counts = rank_counts(cfg, ratio, packed, cp)
    b = dtype.itemsize
    rows, ext, gathered = counts.rows, counts.ext_rows, counts.gathered_rows
    kind = counts.kind
    h, d, hidden = cfg.n_heads, cfg.head_dim, cfg.hidden
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    backward = direction == "fwd+bwd"

    query_copies = QUERY_COPIES_FWD - (1 if recompute and not backward else 0)
    top_k = cfg.index_topk if kind == "C" else (counts.max_entries_per_doc if kind == "H" else 0)
    own = b * (2 * hidden + 2 * cfg.q_lora_rank + query_copies * h * d + cfg.o_groups * cfg.o_lora_rank)
    own += 4 * (cfg.window + top_k) + 4 * h
    extended = b * 3 * d
    if kind != "W":
        extended += b * 2 * (2 if ratio == INDEXER_RATIO else 1) * d
    if kind == "C":
        own += b * (2 * hi * di + hi)
        extended += b * 2 * 2 * di
    key_rows = ext + gathered
    total = parameter_count(cfg, ratio) * b * (2 if backward else 1)
    total += rows * own + ext * extended + key_rows * d * b
    if kind == "C":
        total += gathered * di * b
    if backward:
        total += rows * QUERY_COPIES_BWD * h * d * b + key_rows * d * 4
    return int(total + TEMPORARY_BYTES)
