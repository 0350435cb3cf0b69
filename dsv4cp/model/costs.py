"""Per layer, per rank, per phase: FLOPs, HBM bytes, communication bytes and roofline time bounds.

:func:`estimate` turns the closed-form counts of :mod:`dsv4cp.model.counts` into one record per
``(rank, phase, direction)`` (columns :data:`COLUMNS`) and summaries per direction. Phase names are
those of the profiling NVTX ranges (:func:`nvtx_ranges` maps them), so a measured breakdown lines up
with its bound.

FLOP accounting (docs/design.md §4.3)
----------------------------
* ``sparse_attn``: ``2 (D_qk + D_v) = 4 D`` per (query, head, valid key); valid keys per query
  ``min(pos + 1, W)`` plus ``min(K, visible)`` (C) or ``visible`` (H), visible = ``(pos + 1) // r``.
  Backward = 2.5 x forward.
* ``indexer.score``: ``2 Hi Di`` per (query, visible entry) (the ReLU and head weighting are not
  counted). ``indexer.topk`` counts no FLOPs (comparisons only).
* Projections and compressors: ``2 x MACs`` of their matrix products, on the rows each rank actually
  projects: own rows for queries, indexer queries and the output projection; ``halo + own`` rows for
  the window KV and both compressors. The halo part is recorded separately as ``redundant_flops``
  (rank 0 projects the zero rows it receives in place of a halo, as the layer does), so
  ``flops - redundant_flops`` summed over ranks equals the CP = 1 count. Compressor pooling counts
  ``2`` FLOPs per (entry, pooled slot, channel) (the weighted sum; 8 slots with the ratio-4 overlap),
  on the entries the rank owns. The indexer's Hadamard rotation is a ``Di x Di`` matrix product.
  Norms, RoPE, softmax exponentials and gates are not counted as FLOPs.
* Backward of a matrix product = 2 x forward (input and weight gradients), EXCEPT where the input is
  detached and only the weight gradient exists (1 x): the indexer's query projection, head-weight
  projection and compressor run on detached inputs (docs/design.md §1.5), so their backward computes weight
  gradients only; the Hadamard rotation has no weight, only an input gradient.
* ``indexer.loss``: forward recomputes the attention logits ``q . k`` (``2 D`` per (query, head,
  key)) over the scored compressed keys (sparse: the selected ``min(K, visible)``; dense: all visible
  plus the window keys for its denominator) and the indexer scores ``2 Hi Di`` at the scored entries,
  except where the sparse loss takes the selection's own scores (the kernel option
  ``indexer_loss_scores=selection``, the default): then it scores nothing and reads the ``[L, K]`` fp32
  scores the top-k wrote (priced in the top-k's bytes); backward differentiates the scores only (target
  detached): ``2 x`` the scores' forward, either way.

HBM bytes (assumptions)
-----------------------
Operator-level compulsory traffic: every operator (a matrix product, one fused elementwise chain such
as norm + RoPE, a pooling, a gather kernel) reads each of its inputs once and writes each output once;
tensors passed between operators go through HBM; reuse inside an operator (a gathered key row used
by many queries, a weight used by every row) is assumed to hit on-chip memory, so gathers count the
DISTINCT rows they may touch (the key buffer once), not one load per (query, key). This keeps the
bound a lower bound for a well-tiled kernel. Sizes: activations, weights, gathered rows and their
gradients in bf16 (``act_bytes``, 2); softmax statistics (lse), indexer scores and weight gradients
in fp32 (4); indices int32 (4); key-buffer gradients accumulated in fp32 (the atomics path).
Backward of a matrix product reads the output gradient and the other operand and writes each input
gradient; backward of an elementwise chain reads the output gradient and the input and writes the
input gradient. Not counted: the concatenation building the key buffer, the halo concatenation,
parameter-gradient all-reduce, optimizer traffic.

Communication bytes: what each rank RECEIVES. Halo forward: ``Hw x hidden`` bf16 rows from rank - 1
(none on rank 0); backward: their gradient from rank + 1 (none on the last rank); its time bound
uses max(sent, received) / P2P bandwidth. All-gathers: ``(cp - 1) x capacity x width`` bf16
(``width`` D for compressed KV, Di for indexer keys); the backward reduce-scatters move the same
bytes. Time bound, NCCL bus-bandwidth rule: ``(cp - 1) / cp x gathered bytes / busbw``.

Roofline time bound of a record: compute phases ``max(flops / peak, hbm_bytes / hbm_bw)``;
communication phases their transfer time. Per rank and direction: compute = sum over compute phases,
comm = sum over communication phases, bound with perfect overlap ``max(compute, comm)``, without
``compute + comm``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.partition import RowSplit
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.model.counts import DocsLike, RankCounts, rank_counts
from dsv4cp.model.machine import Machine, resolve_machine

PHASES: tuple[str, ...] = (
    "halo", "q_proj", "kv_proj", "compress", "indexer.compress", "indexer.q_proj", "indexer.score",
    "indexer.topk", "allgather.kv", "allgather.index_k", "sparse_attn", "out_proj", "indexer.loss",
)
"""Phase names, in the order a forward pass runs them (as the profiling NVTX ranges name them)."""

COMM_PHASES = frozenset({"halo", "allgather.kv", "allgather.index_k"})
"""Phases whose time is communication; the others are compute."""

DIRECTIONS: tuple[str, ...] = ("fwd", "bwd")
BOTH = "fwd+bwd"
"""Direction label of summaries over forward and backward together."""

COLUMNS: tuple[str, ...] = (
    "rank", "phase", "direction", "resource", "flops", "redundant_flops", "hbm_bytes", "comm_bytes",
    "time_lower_bound_s", "limiter",
)
"""Columns of :meth:`LayerEstimate.table` (one record per rank, phase, direction).

``resource`` is ``compute`` or ``comm``; ``redundant_flops`` the part of ``flops`` spent on halo rows;
``comm_bytes`` the bytes the rank receives; ``limiter`` the ceiling that sets the bound (``flops``,
``hbm``, ``allgather``, ``p2p``, or ``-`` when the record is empty)."""

ACT_BYTES = 2
"""bf16 activations, weights, gathered rows and their gradients."""
F32 = 4
IDX = 4

_LAYER_PHASES = {
    "W": ("halo", "q_proj", "kv_proj", "sparse_attn", "out_proj"),
    "H": ("halo", "q_proj", "kv_proj", "compress", "allgather.kv", "sparse_attn", "out_proj"),
    "C": PHASES,
}
_FORWARD_ONLY = frozenset({"indexer.score", "indexer.topk"})
"""The selection runs without gradient: its scores are recomputed (and differentiated) by the loss."""


def layer_phases(kind: str) -> tuple[str, ...]:
    """The phases a layer of ``kind`` ('W', 'C' or 'H') runs, in :data:`PHASES` order."""
    return _LAYER_PHASES[kind]


def phase_directions(phase: str) -> tuple[str, ...]:
    return ("fwd",) if phase in _FORWARD_ONLY else DIRECTIONS


def nvtx_ranges(phase: str, direction: str) -> tuple[str, ...]:
    """The ``dsv4cp`` NVTX range names (without the domain prefix) that time ``phase`` in ``direction``.

    Gathers are timed by launch and wait ranges; their backward is the reduce-scatter.
    """
    if phase not in PHASES or direction not in DIRECTIONS:
        raise ValueError(f"phase/direction: unknown pair ({phase!r}, {direction!r})")
    if phase.startswith("allgather."):
        base = phase if direction == "fwd" else "reducescatter." + phase.removeprefix("allgather.")
        return (f"{base}.launch", f"{base}.wait")
    return (f"{phase}.{direction}",)


def range_to_phase(name: str) -> tuple[str, str] | None:
    """Inverse of :func:`nvtx_ranges`: ``(phase, direction)`` of a range name (``dsv4cp.`` prefix
    optional), or None for ranges the model has no record for (``step``, ``kv_rebuild.bwd``, ...)."""
    return _RANGE_INDEX.get(name.removeprefix("dsv4cp."))


_RANGE_INDEX = {
    rng: (phase, direction)
    for phase in PHASES for direction in phase_directions(phase) for rng in nvtx_ranges(phase, direction)
}


_LOSS_SCORES_RANGE = "indexer.score."
"""Prefix of the ranges that time the indexer loss's differentiable scores (:mod:`dsv4cp.ops.indexer`)."""
_TIMED_IN_TOPK = ("indexer.score", "fwd")
"""The model phase whose work no range of its own times: the selection's scoring runs in ``indexer.topk.fwd``."""


def measured_phase(range_name: str) -> tuple[str, str] | None:
    """``(phase, direction)`` whose bound the time of a measured NVTX range faces (``dsv4cp.`` prefix
    optional), or None for ranges the model has no record for.

    :func:`range_to_phase`, except the ``indexer.score.fwd`` / ``.bwd`` ranges: they time the indexer
    LOSS's differentiable scores at the selected entries (:func:`dsv4cp.ops.indexer.indexer_scores` and
    the backward of the selection's own scores, called by :mod:`dsv4cp.layer.indexer_loss`), which the
    model prices inside ``indexer.loss`` in both directions, so they face ``("indexer.loss", direction)``.
    The forward range runs nested inside ``indexer.loss.fwd`` (as does the backward one in the dense
    variant, whose forward computes the gradients; the sparse one's follows the loss's backward region);
    per-phase compute attributes each kernel to its innermost range (:mod:`dsv4cp.profiling.overlap`,
    rule 1), so the ranges' compute do not overlap and summing them counts every kernel once. The model's
    own ``indexer.score`` phase (the top-k's scoring of every visible entry) has no range of its own: see
    :func:`phase_measured_in`.
    """
    name = range_name.removeprefix("dsv4cp.")
    if name.startswith(_LOSS_SCORES_RANGE):
        direction = name.removeprefix(_LOSS_SCORES_RANGE)
        return ("indexer.loss", direction) if direction in DIRECTIONS else None
    return range_to_phase(name)


def phase_measured_in(phase: str, direction: str) -> tuple[str, str]:
    """The ``(phase, direction)`` key under which a model phase's bound meets measured time: the key
    :func:`measured_phase` gives the ranges that time its work.

    Itself, except ``("indexer.score", "fwd")``: the model prices the top-k as two forward phases, the
    scoring of every visible entry (``indexer.score``) and the selection (``indexer.topk``), while one
    range, ``indexer.topk.fwd``, times both (the top-k's score and select kernels run inside it), so the
    scoring's bound is compared under ``("indexer.topk", "fwd")``. Consumers sum the bounds (FLOPs, bytes)
    of the model phases that share a key.
    """
    if phase not in PHASES or direction not in phase_directions(phase):
        raise ValueError(f"phase/direction: unknown pair ({phase!r}, {direction!r})")
    return ("indexer.topk", "fwd") if (phase, direction) == _TIMED_IN_TOPK else (phase, direction)


# ---------------------------------------------------------------------------------- accumulation
class _Acc:
    """Per-rank cost arrays of one phase, forward and backward."""

    def __init__(self, cp: int, act_bytes: int):
        self.b = act_bytes
        self.v = {
            d: {k: np.zeros(cp) for k in ("flops", "redundant_flops", "hbm_bytes", "comm_bytes", "comm_s")}
            for d in DIRECTIONS
        }

    def add(self, direction: str, **values) -> None:
        for key, value in values.items():
            self.v[direction][key] = self.v[direction][key] + value

    def matmul(self, m, k: int, n: int, *, groups: int = 1, dx: bool = True, dw: bool = True,
               redundant_rows=0) -> None:
        """``[m, k] @ [k, n]`` (block-diagonal in ``groups`` blocks: weight ``k n / groups``)."""
        b, weight = self.b, k * n / groups
        flops = 2.0 * m * weight
        self.add("fwd", flops=flops, redundant_flops=2.0 * redundant_rows * weight,
                 hbm_bytes=b * (m * k + weight + m * n))
        grads = int(dx) + int(dw)
        self.add("bwd", flops=grads * flops, redundant_flops=grads * 2.0 * redundant_rows * weight)
        if dx:  # dX = dY W^T: read dY and W, write dX
            self.add("bwd", hbm_bytes=b * (m * n + weight + m * k))
        if dw:  # dW = dY^T X: read dY and X, write an fp32 weight gradient
            self.add("bwd", hbm_bytes=b * (m * n + m * k) + F32 * weight)

    def elementwise(self, elems, *, bytes_in: int | None = None, bytes_out: int | None = None,
                    backward: bool = True) -> None:
        """One fused elementwise chain over ``elems`` values (no FLOPs counted)."""
        bi = self.b if bytes_in is None else bytes_in
        bo = self.b if bytes_out is None else bytes_out
        self.add("fwd", hbm_bytes=elems * (bi + bo))
        if backward:
            self.add("bwd", hbm_bytes=elems * (bo + 2 * bi))


def loss_takes_selection_scores(cfg: DSv4Config, options: KernelOptions) -> bool:
    """Whether ``cfg``'s indexer loss reads the top-k selection's scores instead of scoring its entries
    again: the sparse loss under the kernel option ``indexer_loss_scores=selection`` of ``options`` (a
    Case's, for a measured step), as the layer decides it."""
    return cfg.indexer_loss == "sparse" and options.indexer_loss_scores == "selection"


def _phase_costs(cfg: DSv4Config, n: RankCounts, machine: Machine, act_bytes: int,
                 selection_scores: bool) -> dict[str, _Acc]:
    selection_scores = selection_scores and cfg.indexer_loss == "sparse"  # the dense loss scores every entry
    cp, b = n.cp, act_bytes
    Hw = float(n.halo)
    L = n.rank_rows.astype(float)  # [cp]: slices may differ (a balanced split)
    E = L + Hw
    H, D, hidden, ql = cfg.n_heads, cfg.head_dim, cfg.hidden, cfg.q_lora_rank
    Hi, Di, K, W = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.window
    G = float(n.gathered_rows)
    kind = n.kind
    new = lambda: _Acc(cp, b)  # noqa: E731
    costs: dict[str, _Acc] = {}

    # ---- halo: last Hw rows of x to rank + 1; backward returns their gradient
    acc = costs["halo"] = new()
    recv_f, send_f = n.halo_recv_rows * hidden * b, n.halo_send_rows * hidden * b
    acc.add("fwd", comm_bytes=recv_f, hbm_bytes=recv_f + send_f,
            comm_s=np.maximum(recv_f, send_f) / machine.p2p_bandwidth)
    acc.add("bwd", comm_bytes=send_f, hbm_bytes=recv_f + send_f + 2 * send_f,  # + add into own rows
            comm_s=np.maximum(recv_f, send_f) / machine.p2p_bandwidth)

    # ---- queries: wq_a, q_norm, wq_b, per-head RMS norm + RoPE (own rows)
    acc = costs["q_proj"] = new()
    acc.matmul(L, hidden, ql)
    acc.elementwise(L * ql)
    acc.matmul(L, ql, H * D)
    acc.elementwise(L * H * D)

    # ---- window KV: wkv, kv_norm + RoPE on halo + own rows
    acc = costs["kv_proj"] = new()
    acc.matmul(E, hidden, D, redundant_rows=Hw)
    acc.elementwise(E * D)

    def compressor(acc: _Acc, width: int, overlap: bool, rotate: bool, detached: bool) -> None:
        coff = 2 if overlap else 1
        slots = (2 if overlap else 1) * n.ratio
        entries = n.owned_entries.astype(float)
        # wkv and wgate in one product on the ext rows
        acc.matmul(E, hidden, 2 * coff * width, dx=not detached, redundant_rows=Hw)
        # pooling (+ ape, softmax, RMSNorm, RoPE fused): reads values and gates of the pooled slots
        pool_in = entries * slots * width * 2 * b
        acc.add("fwd", flops=2.0 * entries * slots * width, hbm_bytes=pool_in + entries * width * b)
        acc.add("bwd", flops=4.0 * entries * slots * width, hbm_bytes=2 * pool_in + entries * width * b)
        if rotate:
            acc.matmul(entries, width, width, dw=False)

    if kind != "W":
        compressor(costs.setdefault("compress", new()), D, kind == "C", False, False)

    if kind == "C":
        compressor(costs.setdefault("indexer.compress", new()), Di, True, cfg.hadamard, True)

        acc = costs["indexer.q_proj"] = new()
        acc.matmul(L, ql, Hi * Di, dx=False)  # detached latent
        acc.elementwise(L * Hi * Di)  # RoPE
        if cfg.hadamard:
            acc.matmul(L * Hi, Di, Di, dw=False)
        acc.matmul(L, hidden, Hi, dx=False)  # head weights from detached x

        visible = n.visible_entries.astype(float)
        acc = costs["indexer.score"] = new()
        acc.add("fwd", flops=2.0 * Hi * Di * visible,
                hbm_bytes=L * Hi * Di * b + L * Hi * b + G * Di * b + visible * F32)

        acc = costs["indexer.topk"] = new()  # reads every score; writes the indices (and the loss's scores)
        acc.add("fwd", hbm_bytes=visible * F32 + L * K * IDX + (L * K * F32 if selection_scores else 0.0))

    # ---- gathers (forward) and reduce-scatters (backward)
    gathers = {"C": (("allgather.index_k", Di), ("allgather.kv", D)), "H": (("allgather.kv", D),)}
    for phase, width in gathers.get(kind, ()):
        acc = costs[phase] = new()
        if cp == 1:
            continue
        received = np.full(cp, (cp - 1) * n.capacity * width * b, dtype=float)
        seconds = machine.collective_time(G * width * b, cp)
        local = n.capacity * width * b
        acc.add("fwd", comm_bytes=received, comm_s=seconds, hbm_bytes=local + G * width * b)
        acc.add("bwd", comm_bytes=received, comm_s=seconds, hbm_bytes=G * width * b + local)

    # ---- sparse attention over [ext kv | gathered compressed kv]
    keys = n.attention_keys.astype(float)
    key_rows = E + (G if kind != "W" else 0.0)
    width = W + (K if kind == "C" else n.max_entries_per_doc if kind == "H" else 0)
    acc = costs["sparse_attn"] = new()
    fwd = 4.0 * D * H * keys
    q_bytes = L * H * D * b
    acc.add("fwd", flops=fwd,
            hbm_bytes=q_bytes + key_rows * D * b + L * width * IDX + q_bytes + L * H * F32)
    acc.add("bwd", flops=2.5 * fwd,
            hbm_bytes=3 * q_bytes + L * H * F32 + L * width * IDX + key_rows * D * b  # q, out, dout, lse, idx, kv
            + q_bytes + key_rows * D * F32)  # dq, dkv (fp32)

    # ---- output: inverse RoPE, grouped wo_a, wo_b
    acc = costs["out_proj"] = new()
    acc.elementwise(L * H * D)
    acc.matmul(L, H * D, cfg.o_groups * cfg.o_lora_rank, groups=cfg.o_groups)
    acc.matmul(L, cfg.o_groups * cfg.o_lora_rank, hidden)

    # ---- indexer KL loss
    if kind == "C":
        dense = cfg.indexer_loss == "dense"
        scored = (n.visible_entries if dense else n.compressed_keys).astype(float)
        logit_keys = scored + (n.window_keys.astype(float) if dense else 0.0)
        acc = costs["indexer.loss"] = new()
        acc.add("fwd", flops=2.0 * D * H * logit_keys,
                hbm_bytes=q_bytes + key_rows * D * b + L * H * F32 + L * K * IDX)  # q, keys, lse, ids
        if selection_scores:  # the selection's scores, read
            acc.add("fwd", hbm_bytes=L * K * F32)
        else:  # the entries scored again: indexer q, w, keys read
            acc.add("fwd", flops=2.0 * Hi * Di * scored, hbm_bytes=L * Hi * Di * b + L * Hi * b + G * Di * b)
        acc.add("bwd", flops=2.0 * 2.0 * Hi * Di * scored,
                hbm_bytes=L * Hi * Di * b + L * Hi * b + G * Di * b + L * K * IDX  # re-read q, w, keys, ids
                + L * Hi * Di * b + L * Hi * b + G * Di * F32)  # write dq, dw, dkeys (fp32)
    return costs


UNITS: tuple[str, ...] = ("row", "window_key", "visible_entry", "compressed_key")
"""The work counts that :func:`unit_costs` prices: an own row (with its ``1 / r`` share of an owned
compressed entry), a (query, window key) pair, a (query, visible entry) pair, a (query, compressed key)
pair of the attention."""


def unit_costs(cfg: DSv4Config, ratio: int, selection_scores: bool | None = None, *,
               kernel_options: KernelOptions = DEFAULT_OPTIONS) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """This module's accounting per unit of work: ``{phase: {direction: {"flops" | "hbm_bytes": [4]}}}``
    with the four entries priced per :data:`UNITS` (compute phases of a ``ratio`` layer only).

    Every compute phase's FLOPs and bytes are linear in the rank's rows, owned entries, window keys,
    visible entries and compressed keys, so evaluating them on four unit "ranks" (one row and ``1 / r``
    owned entry; one window key; one visible entry; one compressed key; no halo, no gathered slot)
    gives the price of each. The halo rows and the gathered buffers, which cost every rank alike, are
    left out. The per-row costs of the balanced split (:mod:`dsv4cp.model.row_costs`) derive from these.
    """
    cfg.check_ratio(ratio)
    kind = layer_kind(ratio)
    row, window_key, visible_entry, compressed_key = np.eye(len(UNITS))  # one unit "rank" each
    none = np.zeros(len(UNITS))
    probe = RankCounts(
        kind=kind, ratio=ratio, cp=len(UNITS), total=0, rows=1, halo=0, capacity=0, n_docs=0,
        max_entries_per_doc=0, rank_rows=row, halo_recv_rows=none, halo_send_rows=none, query_rows=row,
        window_keys=window_key, visible_entries=visible_entry if ratio else none,  # W layers see no entry
        compressed_keys=compressed_key if ratio else none, owned_entries=row / ratio if ratio else none,
    )
    if selection_scores is None:
        selection_scores = loss_takes_selection_scores(cfg, kernel_options)
    costs = _phase_costs(cfg, probe, Machine(), ACT_BYTES, selection_scores)  # the machine prices communication only
    return {
        phase: {d: {key: np.asarray(costs[phase].v[d][key], dtype=float) for key in ("flops", "hbm_bytes")}
                for d in phase_directions(phase)}
        for phase in layer_phases(kind) if phase not in COMM_PHASES
    }


# ---------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class DirectionSummary:
    """Whole-layer numbers of one direction (``fwd``, ``bwd`` or ``fwd+bwd``); times in seconds.

    ``rank_*`` tuples are indexed by rank. ``model_flops`` = ``total_flops`` minus ``halo_flops`` (the
    redundant work on halo rows, summed on its own: a difference of two large sums would lose it to
    rounding at 1e12 tokens), i.e. the CP = 1 FLOPs (what TFLOPs/GPU divides). Imbalances are max / mean
    (1.0 when everything is zero). ``attention_s`` is the slowest rank's sparse-attention bound.
    """

    direction: str
    cp: int
    total_flops: float
    model_flops: float
    halo_flops: float
    rank_flops: tuple[float, ...]
    rank_compute_s: tuple[float, ...]
    rank_comm_s: tuple[float, ...]
    rank_comm_bytes: tuple[float, ...]
    attention_s: float

    @property
    def rank_bound_overlap_s(self) -> tuple[float, ...]:
        return tuple(max(a, c) for a, c in zip(self.rank_compute_s, self.rank_comm_s))

    @property
    def rank_bound_serial_s(self) -> tuple[float, ...]:
        return tuple(a + c for a, c in zip(self.rank_compute_s, self.rank_comm_s))

    @property
    def bound_overlap_s(self) -> float:
        """Layer lower bound with compute and communication perfectly overlapped (slowest rank)."""
        return max(self.rank_bound_overlap_s)

    @property
    def bound_serial_s(self) -> float:
        """Layer lower bound with no overlap at all (slowest rank)."""
        return max(self.rank_bound_serial_s)

    @property
    def compute_s(self) -> float:
        return max(self.rank_compute_s)

    @property
    def comm_s(self) -> float:
        return max(self.rank_comm_s)

    @property
    def flops_imbalance(self) -> float:
        return _imbalance(self.rank_flops)

    @property
    def time_imbalance(self) -> float:
        """Max / mean of the per-rank bounds with overlap."""
        return _imbalance(self.rank_bound_overlap_s)

    def model_tflops_per_gpu(self, seconds: float) -> float:
        """docs/design.md §4.3: model FLOPs / (max-over-ranks time x cp), in TFLOP/s, for a layer time."""
        if not seconds > 0:
            raise ValueError(f"seconds: must be positive, got {seconds!r}")
        return self.model_flops / (seconds * self.cp) / 1e12

    def as_record(self) -> dict:
        """Flat scalar fields (for sweep tables)."""
        return {
            "direction": self.direction, "total_flops": self.total_flops, "model_flops": self.model_flops,
            "halo_flops": self.halo_flops,
            "max_rank_flops": max(self.rank_flops), "flops_imbalance": self.flops_imbalance,
            "compute_s": self.compute_s, "comm_s": self.comm_s, "attention_s": self.attention_s,
            "comm_bytes_per_rank": max(self.rank_comm_bytes),
            "bound_overlap_s": self.bound_overlap_s, "bound_serial_s": self.bound_serial_s,
            "time_imbalance": self.time_imbalance,
            "tflops_per_gpu_at_bound": (
                self.model_tflops_per_gpu(self.bound_overlap_s) if self.bound_overlap_s > 0 else float("nan")
            ),
        }


def _imbalance(values) -> float:
    values = np.asarray(values, dtype=float)
    mean = values.mean()
    return float(values.max() / mean) if mean > 0 else 1.0


@dataclass(frozen=True)
class LayerEstimate:
    """The cost model of one layer on one packed batch over ``cp`` ranks (see :func:`estimate`)."""

    cfg: DSv4Config
    ratio: int
    cp: int
    machine: Machine
    counts: RankCounts
    records: pd.DataFrame = field(repr=False)

    @property
    def kind(self) -> str:
        return self.counts.kind

    @property
    def total(self) -> int:
        return self.counts.total

    def table(self, direction: str | None = None, rank: int | None = None) -> pd.DataFrame:
        """The records (columns :data:`COLUMNS`), optionally of one direction and/or one rank."""
        table = self.records
        if direction is not None:
            table = table[table["direction"] == _check_direction(direction, both=False)]
        if rank is not None:
            table = table[table["rank"] == rank]
        return table.reset_index(drop=True)

    def phase_table(self, direction: str | None = None) -> pd.DataFrame:
        """Per (phase, direction) over ranks: summed and max-rank FLOPs, max-rank bytes and bound."""
        table = self.table(direction)
        grouped = table.groupby(["phase", "direction"], sort=False)
        out = grouped.agg(
            resource=("resource", "first"), flops=("flops", "sum"), redundant_flops=("redundant_flops", "sum"),
            max_rank_flops=("flops", "max"), max_rank_hbm_bytes=("hbm_bytes", "max"),
            max_rank_comm_bytes=("comm_bytes", "max"), max_rank_bound_s=("time_lower_bound_s", "max"),
        ).reset_index()
        flops = grouped["flops"]
        out["flops_imbalance"] = (flops.max() / flops.mean()).fillna(1.0).to_numpy()
        return out

    def summary(self, direction: str = "fwd") -> DirectionSummary:
        """Whole-layer numbers of ``fwd``, ``bwd`` or ``fwd+bwd``."""
        direction = _check_direction(direction, both=True)
        table = self.records
        if direction != BOTH:
            table = table[table["direction"] == direction]
        ranks = range(self.cp)
        by_rank = table.groupby("rank")
        compute = table[table["resource"] == "compute"].groupby("rank")["time_lower_bound_s"].sum()
        comm = table[table["resource"] == "comm"].groupby("rank")["time_lower_bound_s"].sum()
        attn = table[table["phase"] == "sparse_attn"]["time_lower_bound_s"]
        flops = by_rank["flops"].sum().reindex(ranks, fill_value=0.0)
        return DirectionSummary(
            direction=direction, cp=self.cp,
            total_flops=float(table["flops"].sum()),
            model_flops=float(table["flops"].sum() - table["redundant_flops"].sum()),
            halo_flops=float(table["redundant_flops"].sum()),
            rank_flops=tuple(flops.tolist()),
            rank_compute_s=tuple(compute.reindex(ranks, fill_value=0.0).tolist()),
            rank_comm_s=tuple(comm.reindex(ranks, fill_value=0.0).tolist()),
            rank_comm_bytes=tuple(by_rank["comm_bytes"].sum().reindex(ranks, fill_value=0.0).tolist()),
            attention_s=float(attn.max()) if len(attn) else 0.0,
        )

    @property
    def fwd(self) -> DirectionSummary:
        return self.summary("fwd")

    @property
    def bwd(self) -> DirectionSummary:
        return self.summary("bwd")

    @property
    def step(self) -> DirectionSummary:
        return self.summary(BOTH)

    def rank_table(self) -> pd.DataFrame:
        """One row per (rank, direction incl. ``fwd+bwd``): FLOPs, compute/comm bounds, both layer bounds."""
        rows = []
        for direction in (*DIRECTIONS, BOTH):
            s = self.summary(direction)
            for rank in range(self.cp):
                rows.append({
                    "rank": rank, "direction": direction, "flops": s.rank_flops[rank],
                    "comm_bytes": s.rank_comm_bytes[rank], "compute_s": s.rank_compute_s[rank],
                    "comm_s": s.rank_comm_s[rank], "bound_overlap_s": s.rank_bound_overlap_s[rank],
                    "bound_serial_s": s.rank_bound_serial_s[rank],
                })
        return pd.DataFrame(rows)

    def summary_frame(self) -> pd.DataFrame:
        """One row per direction (``fwd``, ``bwd``, ``fwd+bwd``) of scalar fields plus the setup
        (config name, ratio, kind, cp, total, docs, machine): the sweep/notebook record."""
        setup = self.setup()
        return pd.DataFrame([{**setup, **self.summary(d).as_record()} for d in (*DIRECTIONS, BOTH)])

    def setup(self) -> dict:
        c = self.counts
        return {
            "config": self.cfg.name, "ratio": self.ratio, "kind": self.kind, "cp": self.cp, "tokens": c.total,
            "tokens_per_rank": c.rows, "docs": c.n_docs, "halo": c.halo, "capacity": c.capacity,
            "machine": self.machine.name,
        }

    def model_tflops_per_gpu(self, measured_s: float, direction: str = "fwd") -> float:
        """Model TFLOP/s per GPU of a measured layer time (max over ranks) in ``direction``."""
        return self.summary(direction).model_tflops_per_gpu(measured_s)


def _check_direction(direction: str, both: bool) -> str:
    allowed = (*DIRECTIONS, BOTH) if both else DIRECTIONS
    if direction not in allowed:
        raise ValueError(f"direction: must be one of {allowed}, got {direction!r}")
    return direction


def estimate(
    cfg: DSv4Config, ratio: int, packed_or_lengths: DocsLike, cp: int, machine: Machine | None = None,
    total: int | None = None, *, act_bytes: int = ACT_BYTES, split: RowSplit | None = None, padding: bool = True,
    selection_scores: bool | None = None, kernel_options: KernelOptions = DEFAULT_OPTIONS,
) -> LayerEstimate:
    """The analytic cost of one ``ratio`` layer of ``cfg`` on a packed batch split over ``cp`` ranks.

    Args:
        packed_or_lengths: a :class:`PackedSeqs` (its padded extents and ``total``) or document
            lengths (concatenated, no padding).
        machine: ceilings for the time bounds (default: the machine this process runs on,
            :func:`~dsv4cp.model.machine.this_machine`).
        total: rows of the batch (default ``packed.total`` or the sum of the lengths); extra rows
            form a tail padding segment. Must be divisible by ``cp``.
        act_bytes: bytes per activation/weight element (2 = bf16).
        split: the ranks' row ranges (e.g. :func:`dsv4cp.model.partition.partition`); None: equal slices.
        padding: False prices the gathered buffer at the entries the ranks own (their mean per rank in
            place of the static capacity): the work without capacity padding.
        selection_scores: whether the sparse indexer loss takes the selection's scores (prices no
            re-scoring); None: as ``kernel_options`` decide (:func:`loss_takes_selection_scores`).
        kernel_options: the options the step runs (default: every option at its default).
    """
    machine = resolve_machine(machine)
    counts = rank_counts(cfg, ratio, packed_or_lengths, cp, total, split)
    if not padding:
        counts = dataclasses.replace(counts, capacity=float(sum(counts.owned_entries)) / counts.cp)
    if selection_scores is None:
        selection_scores = loss_takes_selection_scores(cfg, kernel_options)
    costs = _phase_costs(cfg, counts, machine, act_bytes, selection_scores)
    rows = []
    for phase in layer_phases(counts.kind):
        acc, resource = costs[phase], "comm" if phase in COMM_PHASES else "compute"
        for direction in phase_directions(phase):
            v = acc.v[direction]
            if resource == "comm":
                seconds = v["comm_s"]
                limiter = np.where(seconds > 0, "p2p" if phase == "halo" else "allgather", "-")
            else:
                t_flops, t_bytes = v["flops"] / machine.peak_flops, v["hbm_bytes"] / machine.hbm_bandwidth
                seconds = np.maximum(t_flops, t_bytes)
                limiter = np.where(seconds == 0, "-", np.where(t_flops >= t_bytes, "flops", "hbm"))
            for rank in range(counts.cp):
                rows.append((
                    rank, phase, direction, resource, float(v["flops"][rank]), float(v["redundant_flops"][rank]),
                    float(v["hbm_bytes"][rank]), float(v["comm_bytes"][rank]), float(seconds[rank]),
                    str(limiter[rank]),
                ))
    records = pd.DataFrame(rows, columns=list(COLUMNS))
    return LayerEstimate(cfg=cfg, ratio=ratio, cp=counts.cp, machine=machine, counts=counts, records=records)
