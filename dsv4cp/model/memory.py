"""Peak memory per rank of one layer step, estimated before anything is allocated.

The commands that measure refuse a step whose estimate exceeds the device's free memory (instead of
dying in the allocator after minutes of set-up). The estimate is a sum of named terms
(:func:`peak_terms`), each a tensor family the layer keeps alive at the peak; per-row tensors scale
with the rank's rows ``L = T / cp`` (``E = L + halo`` for the window-KV and compressor paths), the
gathered compressed rows ``G`` with the whole batch. Each term says whether it shrinks with CP: the
ones that do not (parameters and their gradients, the gathered keys of every rank, fixed scratch
budgets) are why the CP = 2 peak per rank is more than half the CP = 1 peak.

Terms (``b`` = bytes of the dtype; widths per row; C/H/W = layer kinds):

* parameters ``b P`` and, with backward, their gradients ``b P``;
* per own row, kept for backward: the input ``x`` and output (``2 hidden``), the query latent before
  and after its norm (``2 q_lora_rank``), the grouped output latent (``o_groups o_lora_rank``), the
  key indices (int32 ``W + K``), the attention lse (fp32 ``H``); C layers: indexer queries and head
  weights (``2 Hi Di + Hi``);
* per own row, query-sized ``H D`` tensors: :data:`QUERY_COPIES_FWD` kept by the forward (the
  up-projection, the normed and rotated queries, the attention output and its inverse rotation); at
  the fwd+bwd peak, inside the sparse-attention backward, the inverse rotation is gone (the output
  projection's backward, which ran first, freed it) and :data:`QUERY_COPIES_BWD` gradients (the
  output's and dq) are alive;
* per halo-extended row: the window KV before/after norm and RoPE (``3 D``) and, C/H, the compressor
  projections (``2 x 2 D`` for the overlapping ratio-4 compressor, ``2 D`` otherwise; C adds the
  indexer compressor's ``2 x 2 Di``);
* the key buffer ``(E + G) D`` and, C, the gathered indexer keys ``G Di``; backward: the fp32 key
  gradient ``4 (E + G) D``;
* backward: the Triton sparse-attention backward's p and ds scratch, ``2 L Kt H b`` (``Kt = W + K``
  slots) in query chunks of at most :data:`SPARSE_BWD_SCRATCH_BYTES` (the kernel's ``BWD_SCRATCH_BYTES``)
  and at most a :data:`SPARSE_BWD_MIN_CHUNKS`-th of the rank's rows: at 64K tokens the byte cap binds at
  CP = 1 (2 GiB) and the chunk rule at CP = 2 (1 GiB), so the scratch shrinks with CP (it did not
  before the chunk rule: 2 GiB on every rank; modelled CP = 2 / CP = 1 peak 0.554x before, 0.518x with it);
* chunked temporaries of the torch paths and allocator slack, bounded by :data:`TEMPORARY_BYTES`.

``recompute`` drops one query copy from what the forward keeps, but the backward rebuilds it before
the peak, so the fwd+bwd peak does not change (as measured: 15.62 vs 15.69 GiB below).

Accuracy: calibrated on the committed 2 x H200 records (flash C layer, one 65536-token document,
fwd+bwd, bf16: measured allocator peak 27.71 GiB at CP = 1 and 15.62 / 15.69 GiB per rank at CP = 2
without / with recompute; estimate 28.1 and 15.6 GiB: +2 % and 0 %; the CP = 2 / CP = 1 ratio
0.554 against 0.556 to 0.564 measured) and on CPU fp32 runs (process peak RSS above the baseline;
``tests/model/test_memory_estimate.py``), where the torch path keeps fp32 copies in the norms that
the fused GPU path does not: within about a third. Small batches (parameters and allocator overhead
dominate) and other layer kinds on GPU are not calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4cp.config import INDEXER_RATIO, DSv4Config, layer_kind
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model.counts import DocsLike, rank_counts

QUERY_COPIES_FWD = 4
"""``[L, H D]`` tensors the forward keeps for backward (see the module docstring)."""
QUERY_COPIES_BWD = 2
"""Further ``[L, H D]`` gradients alive at the backward peak (dq and the output gradient)."""
SPARSE_BWD_SCRATCH_BYTES = 2 * 2**30
"""Cap of the Triton sparse-attention backward's p / ds scratch (``BWD_SCRATCH_BYTES`` of
``dsv4cp.kernels.sparse_attention_triton``, mirrored so the model need not import Triton)."""
SPARSE_BWD_MIN_CHUNKS = 5
"""Query chunks the sparse-attention backward splits its rows into at least (``BWD_SCRATCH_MIN_CHUNKS``)."""
SPARSE_BWD_MIN_CHUNK_ROWS = 1024
"""Smallest chunk when ``min_chunks`` splits: 1024 queries x 2 head blocks still give every SM of an
H200 about 15 programs per launch."""
TEMPORARY_BYTES = 512 * 2**20
"""Chunked temporaries (gathered keys and logits of the torch attention and indexer paths)."""

_DIRECTIONS = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class MemoryTerm:
    """One tensor family alive at the estimated peak of a rank."""

    name: str
    bytes: int
    shrinks_with_cp: bool
    """True when it is proportional to the rank's own (or halo-extended) rows; False for what every
    rank holds whole (parameters, gathered keys) and for fixed budgets."""


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


def sparse_bwd_scratch_bytes(
    rows: int, slots: int, heads: int, itemsize: int, min_chunks: int = SPARSE_BWD_MIN_CHUNKS,
) -> int:
    """The Triton sparse-attention backward's p and ds buffers ``2 x [chunk, Kt, H]`` for ``rows``
    queries processed in query chunks of at most :data:`SPARSE_BWD_SCRATCH_BYTES`.

    ``min_chunks > 1`` models a kernel that also splits the rows into at least that many chunks (of
    at least :data:`SPARSE_BWD_MIN_CHUNK_ROWS` rows), so its scratch shrinks with the rank's rows
    under CP instead of staying at the cap.
    """
    if min_chunks < 1:
        raise ValueError(f"min_chunks: must be >= 1, got {min_chunks}")
    if rows == 0:
        return 0
    per_query = 2 * slots * heads * itemsize
    capped = max(1, SPARSE_BWD_SCRATCH_BYTES // per_query)
    chunk = min(rows, capped, max(SPARSE_BWD_MIN_CHUNK_ROWS, -(-rows // min_chunks)))
    return chunk * per_query


def peak_terms(
    cfg: DSv4Config, ratio: int, packed: DocsLike, cp: int, direction: str, dtype: torch.dtype,
    recompute: bool = False, sparse_bwd_min_chunks: int = SPARSE_BWD_MIN_CHUNKS, *,
    split: RowSplit | None = None, rank: int | None = None,
) -> list[MemoryTerm]:
    """The named terms of :func:`peak_bytes_estimate` (bytes per rank, the most loaded rank's rows).

    ``sparse_bwd_min_chunks``: see :func:`sparse_bwd_scratch_bytes` (what-if of a kernel change).
    ``split``: the ranks' row ranges (None: equal slices); ``rank``: the terms of that rank's own rows
    instead of the most loaded rank's (the gathered buffers are the same on every rank).

    Raises ``ValueError`` naming the field for a bad direction, dtype or split (as the cost model).
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction: must be one of {_DIRECTIONS}, got {direction!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
    counts = rank_counts(cfg, ratio, packed, cp, split=split)
    b = dtype.itemsize
    rows, ext, gathered = counts.rows, counts.ext_rows, counts.gathered_rows
    if rank is not None:
        if not 0 <= rank < cp:
            raise ValueError(f"rank: must be in [0, {cp}), got {rank!r}")
        rows = int(counts.rank_rows[rank])
        ext = rows + counts.halo
    kind = counts.kind
    h, d, hidden = cfg.n_heads, cfg.head_dim, cfg.hidden
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    backward = direction == "fwd+bwd"

    if backward:  # the inverse-rotated output is freed by the output projection's backward
        query_copies = QUERY_COPIES_FWD - 1 + QUERY_COPIES_BWD
    else:
        query_copies = QUERY_COPIES_FWD - (1 if recompute else 0)
    top_k = cfg.index_topk if kind == "C" else (counts.max_entries_per_doc if kind == "H" else 0)
    own = b * (2 * hidden + 2 * cfg.q_lora_rank + cfg.o_groups * cfg.o_lora_rank) + 4 * (cfg.window + top_k) + 4 * h
    extended = b * 3 * d
    if kind != "W":
        extended += b * 2 * (2 if ratio == INDEXER_RATIO else 1) * d
    if kind == "C":
        own += b * (2 * hi * di + hi)
        extended += b * 2 * 2 * di
    params = parameter_count(cfg, ratio) * b
    terms = [
        MemoryTerm("parameters", params, False),
        MemoryTerm("own rows: activations kept for backward", rows * own, True),
        MemoryTerm("own rows: query-sized tensors", rows * query_copies * h * d * b, True),
        MemoryTerm("halo-extended rows: window KV and compressor projections", ext * extended, True),
        MemoryTerm("key buffer: window rows", ext * d * b, True),
        MemoryTerm("key buffer: gathered compressed rows (all ranks)", gathered * d * b, False),
    ]
    if kind == "C":
        terms.append(MemoryTerm("gathered indexer keys (all ranks)", gathered * di * b, False))
    if backward:
        slots = cfg.window + top_k
        scratch = sparse_bwd_scratch_bytes(rows, slots, h, b, sparse_bwd_min_chunks)
        shrinks = scratch < sparse_bwd_scratch_bytes(2 * rows, slots, h, b, sparse_bwd_min_chunks)
        terms += [
            MemoryTerm("parameter gradients", params, False),
            MemoryTerm("key-buffer gradient fp32: window rows", ext * d * 4, True),
            MemoryTerm("key-buffer gradient fp32: gathered rows (all ranks)", gathered * d * 4, False),
            MemoryTerm("sparse-attention backward scratch (p, ds)", scratch, shrinks),
        ]
    terms.append(MemoryTerm("chunked temporaries and allocator slack", TEMPORARY_BYTES, False))
    return terms


def peak_bytes_estimate(
    cfg: DSv4Config, ratio: int, packed: DocsLike, cp: int, direction: str, dtype: torch.dtype,
    recompute: bool = False, sparse_bwd_min_chunks: int = SPARSE_BWD_MIN_CHUNKS,
) -> int:
    """Estimated peak bytes per rank of one ``direction`` step (``fwd`` or ``fwd+bwd``) of a layer.

    Args:
        cfg, ratio: the layer.
        packed: the whole batch (PackedSeqs or document lengths); ``packed.total`` rows.
        cp: ranks the rows are split over.
        direction: ``fwd`` (forward with the autograd graph kept) or ``fwd+bwd``.
        dtype: parameter and activation dtype.
        recompute: selective recompute (changes the forward-only estimate, not the fwd+bwd peak).
        sparse_bwd_min_chunks: the sparse-attention backward's chunk rule (1: the rule before
            ``BWD_SCRATCH_MIN_CHUNKS``, for records measured with it).

    Raises ``ValueError`` naming the field for a bad direction, dtype or split (as the cost model).
    """
    terms = peak_terms(cfg, ratio, packed, cp, direction, dtype, recompute, sparse_bwd_min_chunks)
    return sum(term.bytes for term in terms)


def rank_peak_bytes(
    cfg: DSv4Config, ratio: int, packed: DocsLike, split: RowSplit, direction: str, dtype: torch.dtype,
    recompute: bool = False,
) -> list[int]:
    """Estimated peak bytes of every rank of ``split`` (:func:`peak_bytes_estimate` per rank's own rows)."""
    return [sum(t.bytes for t in peak_terms(cfg, ratio, packed, split.cp, direction, dtype, recompute,
                                            split=split, rank=rank)) for rank in range(split.cp)]
