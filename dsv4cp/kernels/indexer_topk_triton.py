"""Streaming indexer top-k: scoring and a running top-k in ONE kernel pass.

Same contract as :func:`dsv4cp.kernels.indexer_triton.indexer_topk_triton` (and the torch op
:func:`dsv4cp.ops.indexer.indexer_topk`): per query, the ``k`` visible key rows with the highest score
``sum_h w[t, h] relu(<q[t, h], keys[g]>)``, ties at the cut going to the LOWEST key rows, returned as
``[T, k]`` int64 key rows in increasing order with ``-1`` past a row's visible count. The chunked path
writes every chunk's ``[rows, width]`` scores (or packed keys) to memory and then selects from that
buffer in a second pass; this kernel never stores a score. Measured slower than the chunked path (see
the cost argument's end): kept as an option (the kernel option ``topk_impl=stream``), not the default.

Kernel (``_stream_topk_kernel``). One program per block of ``BLOCK_M`` query rows. It walks the key
rows its queries can see in tiles of ``BLOCK_N``; each tile's masked scores are computed by the device
function ``_score_kernel`` calls (``_head_sum``: key tile on chip, loop over heads, ``acc += w_h
relu(q_h k^T)`` in one fp32 register tile: the same arithmetic, though another tile shape may sum a
product in another order inside the matrix unit, so scores can differ from the chunked path's in the
last bits). Each score is then packed with its key row into ONE int64 sort key (``_pack_keys``, the
score kernel's packed layout):

* high 32 bits: the fp32 score's bits made order-preserving as a signed integer (non-negative floats
  keep their bits, negative ones flip their magnitude bits; ``-0.0`` is first turned into ``+0.0`` so
  that the two zeros tie, as they do for ``torch.topk``);
* low 32 bits: ``2^32 - 1 - row``, so of two equal scores the lower key row has the larger key.

A single integer comparison is then the whole tie rule, every key is distinct, and invisible entries
get ``INT64_MIN`` (below every packed score). Each program keeps, per query row, its best ``KP`` keys
(``KP`` = ``k`` rounded up to a power of two, at least ``BLOCK_N``) sorted in descending order, in
registers, and the current ``k``-th best key as a per-row threshold. Per tile:

1. candidates at or below the threshold are dropped (they can never enter the final top ``k``: the
   threshold only rises); if no row of the block keeps one, the tile is done (no sorting at all);
2. the candidates are sorted ascending (``tl.sort``, a bitonic network over ``BLOCK_N``);
3. ``max(best_tail, candidates)`` elementwise, with ``best_tail`` the ``BLOCK_N`` smallest kept keys
   (descending): the classic merge step of bitonic top-k. It holds exactly the ``BLOCK_N`` largest of
   their union, and the kept keys above the tail stay (each has fewer than ``KP`` keys above it);
4. that bitonic sequence is sorted by one bitonic merge (``log2 BLOCK_N`` compare-exchange steps),
   written back as the (ascending) tail, and the now V-shaped ``KP`` list re-sorted by one more
   bitonic merge (``log2 KP`` steps; skipped when ``KP == BLOCK_N``).

At the end the top ``k`` keys give their rows, sorted ascending (one more ``tl.sort``), ``-1`` padding.

Cost argument (flash shapes: Hi = 64, Di = 128, k = 512, ``BLOCK_N = 128``, ``KP = 512``). Scoring a
(query, key) pair costs ``2 Hi Di = 16384`` matrix FLOPs (~17 ps of an H200's ~990 TFLOP/s) plus ~128
CUDA-core ops of the head epilogue. The chunked path as it was then stored the fp32 score and ran
``torch.topk`` and the tie rule's passes over ``[rows, width]`` buffers (fp32, bool and int64
temporaries: tens of bytes of HBM traffic per pair). Here a pair below its row's threshold
costs ~3 integer ops and no traffic. A tile with survivors costs, per candidate, the tile sort
(``log2 BLOCK_N (log2 BLOCK_N + 1) / 2 = 28`` compare-exchange steps), the tail merge (7) and the
``KP``-wide re-sort amortised over the tile (``9 KP / BLOCK_N = 36``): ~70 steps of ~5 ops, i.e.
~350 CUDA-core ops per pair, the same order as the scoring's time. Expect the kernel at ~1.5-2x the
scoring time where most tiles have survivors (early, short rows: a row keeps a new key with
probability ~``k / n`` after ``n`` keys, so a 128-key tile of a 16-row block has survivors until rows
are far past ``16 * 128 * k`` keys), i.e. below the scoring kernel's own throughput but with no buffer
and no second pass. A block skips a tile only when none of its rows has a survivor, which is why
``BLOCK_M`` stays at 16 rows (also: the ``[BLOCK_M, KP]`` int64 lists live in registers). Nothing of
size ``[T, G]`` or ``[rows, width]`` exists: the extra memory is the ``[T, k]`` output and ``O(T)``
metadata. Which tile is fastest on the H200 is what ``bench/test_bench_indexer.py`` measures
(``test_indexer_topk_stream_config``). Measured, the estimate above was wrong: the merges cost far more
than the scoring and 16-row tiles run the scoring on mma.sync, not wgmma, so this path is slower than
the chunked one and not the default (docs/kernels.md).

Key ranges. Each program scans only the key rows its queries can see: with ``key_row_limit = (base,
ratio)`` (a CP layout's static causal bound, :func:`~dsv4cp.kernels.indexer_plan.plan_static_chunks`),
rows ``[0, min(G, base + last_row // ratio + 1))``, from sizes alone; without it, the exact per-query
ranges of :func:`~dsv4cp.kernels.indexer_plan.key_ranges`, computed and read ON THE DEVICE (the
kernel takes the block's min / max). Neither reads device data on the host, so the top-k is CUDA-graph
safe and never stalls the CPU. Tiles whose queries see none of their keys (other documents, padding)
load nothing and are skipped.

Limits: ``k`` up to :data:`MAX_STREAM_K` (beyond it the running list no longer fits on chip: the
wrapper falls back to the chunked path). No split over key ranges: at T >= 8K there are >= 256 programs
of 32 rows, enough to fill the GPU; short batches leave it partly idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels._triton_launch import Kernels, pinned_config
from dsv4cp.kernels._triton_launch import interpreted as _interpreted
from dsv4cp.kernels.indexer_plan import key_ranges
from dsv4cp.kernels.indexer_triton import (
    IndexerConfig,
    _check_k,
    _check_key_row_limit,
    _check_qwk,
    _check_visibility,
    _dot_f32,
    _head_sum,
    _pack_keys,
    _precision,
    _prepare,
)

__all__ = ["MAX_STREAM_K", "STREAM_CONFIG_ENV", "indexer_topk_stream", "stream_config_ladder"]

MAX_STREAM_K = 1024
"""Largest ``k`` the streaming kernel keeps on chip (``[BLOCK_M, KP]`` int64 running lists)."""

STREAM_CONFIG_ENV = kernel_options.OPTIONS["triton_topk_stream_config"].env
"""The variable of the kernel option ``triton_topk_stream_config``: pins the streaming kernel's launch:
``"block_m,block_n,num_warps,num_stages"``."""

_LOW_MASK = tl.constexpr(0xFFFFFFFF)
"""The low 32 bits of a packed key: ``_LOW_MASK - key row``."""

_EMPTY = tl.constexpr(-(2**63))
"""Packed key of an invisible entry / an empty slot: below every packed score."""

_NO_ROW = tl.constexpr(2**62)
"""Sort key of an empty output slot: after every key row."""


def _stream_topk_kernel(
    Q, WT, KEYS, QDOC, QLIM, KDOC, KJ, LO, HI_ROW, OUT,  # pointers
    T, G, HEADS, K, LIMIT_BASE, LIMIT_RATIO,
    stride_qt, stride_qh, stride_wh, stride_kn, stride_ot,
    DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KP: tl.constexpr, HAS_RANGES: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    NATIVE_SORT: tl.constexpr, LOG_N: tl.constexpr, LOG_KP: tl.constexpr,
):
    """Top-``K`` key rows of query rows ``[pid * BLOCK_M, pid * BLOCK_M + BLOCK_M)``.

    Q ``[T, HEADS, DI]``, WT ``[HEADS, T]`` fp32, KEYS ``[G, DI]``, QDOC / QLIM ``[T]`` int32, KDOC / KJ
    ``[G]`` int32; LO / HI_ROW ``[T]`` int64 per-query key-row ranges (read when HAS_RANGES, else the
    bound ``LIMIT_BASE + row // LIMIT_RATIO + 1``). OUT ``[T, K]`` int64 (rows ``stride_ot`` apart).
    NATIVE_SORT: sort with Triton's ``tl.sort`` / ``tl.bitonic_merge`` (compiled kernels), else with
    :func:`_network_sort` / :func:`_network_merge` (the interpreter: the same networks, vectorised);
    LOG_N, LOG_KP: ``log2 BLOCK_N``, ``log2 KP``.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    qdoc = tl.load(QDOC + rows, mask=rmask, other=-1)
    qlim = tl.load(QLIM + rows, mask=rmask, other=0)
    if HAS_RANGES:
        lo = tl.load(LO + rows, mask=rmask, other=0)
        hi = tl.load(HI_ROW + rows, mask=rmask, other=0)
        live = hi > lo
        start = tl.min(tl.where(live, lo, G)).to(tl.int32)
        stop = tl.max(tl.where(live, hi, 0)).to(tl.int32)
    else:
        last = tl.minimum(pid * BLOCK_M + BLOCK_M, T) - 1
        start = 0
        stop = tl.minimum(G, LIMIT_BASE + last // LIMIT_RATIO + 1)

    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    q_ptrs = Q + rows64[:, None] * stride_qt + d[None, :]
    q_mask = rmask[:, None] & dmask[None, :]
    slot = tl.arange(0, KP)
    part = tl.arange(0, KP // BLOCK_N)
    best = tl.full([BLOCK_M, KP], _EMPTY, tl.int64)  # descending
    thr = tl.full([BLOCK_M], _EMPTY, tl.int64)  # the k-th best key so far
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < stop
        kdoc = tl.load(KDOC + cols, mask=cmask, other=-2)
        kj = tl.load(KJ + cols, mask=cmask, other=0)
        vis = (qdoc[:, None] >= 0) & (kdoc[None, :] == qdoc[:, None]) & (kj[None, :] < qlim[:, None])
        if tl.max(vis.to(tl.int32)) > 0:  # a tile nobody sees loads nothing
            k = tl.load(KEYS + cols.to(tl.int64)[:, None] * stride_kn + d[None, :],
                        mask=cmask[:, None] & dmask[None, :], other=0.0)
            if DOT_F32:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 products there
                k = k.to(tl.float32)
            acc = _head_sum(q_ptrs, q_mask, WT + rows64, rmask, tl.trans(k), HEADS, stride_qh, stride_wh,
                            BLOCK_M, BLOCK_N, PRECISION, DOT_F32)  # the score kernel's arithmetic
            # one comparison of the packed keys decides score, then the lower key row
            packed = _pack_keys(acc, cols, BLOCK_N)
            cand = tl.where(vis & (tl.abs(acc) < float("inf")) & (packed > thr[:, None]), packed, _EMPTY)  # finite only
            if tl.max(cand) > _EMPTY:
                if NATIVE_SORT:
                    cand = tl.sort(cand)  # ascending
                else:
                    cand = _network_sort(cand, BLOCK_M, LOG_N, False)
                if KP == BLOCK_N:
                    merged = tl.maximum(best, cand)  # bitonic: the best KP of both
                else:
                    parts = tl.reshape(best, [BLOCK_M, KP // BLOCK_N, BLOCK_N])
                    is_tail = (part == KP // BLOCK_N - 1)[None, :, None]
                    tail = tl.sum(tl.where(is_tail, parts, 0), 1)  # the BLOCK_N smallest, descending
                    if NATIVE_SORT:
                        top = tl.bitonic_merge(tl.maximum(tail, cand), descending=False)
                    else:
                        top = _network_merge(tl.maximum(tail, cand), BLOCK_M, LOG_N, False)
                    parts = tl.where(is_tail, top[:, None, :], parts)  # descending, then ascending
                    merged = tl.reshape(parts, [BLOCK_M, KP])
                if NATIVE_SORT:
                    best = tl.bitonic_merge(merged, descending=True)
                else:
                    best = _network_merge(merged, BLOCK_M, LOG_KP, True)
                thr = tl.sum(tl.where(slot[None, :] == K - 1, best, 0), 1)
    chosen = (slot[None, :] < K) & (best > _EMPTY)
    key_row = tl.full([BLOCK_M, KP], _LOW_MASK, tl.int64)
    key_row = tl.where(chosen, key_row - (best & key_row), _NO_ROW)
    if NATIVE_SORT:
        key_row = tl.sort(key_row)
    else:
        key_row = _network_sort(key_row, BLOCK_M, LOG_KP, False)
    out = tl.where(key_row == _NO_ROW, -1, key_row)
    tl.store(OUT + rows64[:, None] * stride_ot + slot[None, :], out,
             mask=rmask[:, None] & (slot[None, :] < K))


@triton.jit
def _compare_exchange(x, ROWS: tl.constexpr, N: tl.constexpr, GAP: tl.constexpr, BLOCK: tl.constexpr,
                      DESCENDING: tl.constexpr):
    """One step of a bitonic network on ``x [ROWS, N]`` (int64, along the last dim): elements ``GAP``
    apart are compared and ordered, ascending inside each aligned run of ``BLOCK`` elements whose
    index has bit ``log2 BLOCK`` clear and descending in the others (``BLOCK > N``: all one way,
    descending if ``DESCENDING``). Reshape / split / join only: numpy-vectorised under the interpreter,
    where ``tl.sort``'s per-element reductions are ~1000x slower."""
    pairs = tl.permute(tl.reshape(x, [ROWS, N // (2 * GAP), 2, GAP]), (0, 1, 3, 2))
    first, second = tl.split(pairs)  # [ROWS, N // (2 GAP), GAP]
    index = (tl.arange(0, N // (2 * GAP)) * (2 * GAP))[:, None] + tl.arange(0, GAP)[None, :]
    down = ((index // BLOCK) % 2 == 1) != DESCENDING
    low, high = tl.minimum(first, second), tl.maximum(first, second)
    first, second = tl.where(down[None], high, low), tl.where(down[None], low, high)
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), [ROWS, N])


@triton.jit
def _network_sort(x, ROWS: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr):
    """Bitonic sort of ``x [ROWS, 2^LOG_N]`` along the last dim (the network of ``tl.sort``)."""
    for stage in tl.static_range(1, LOG_N + 1):
        for step in tl.static_range(stage):
            x = _compare_exchange(x, ROWS, 1 << LOG_N, 1 << (stage - 1 - step), 1 << stage, DESCENDING)
    return x


@triton.jit
def _network_merge(x, ROWS: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort ``x [ROWS, 2^LOG_N]`` along the last dim when each row is bitonic (``tl.bitonic_merge``)."""
    for step in tl.static_range(LOG_N):
        x = _compare_exchange(x, ROWS, 1 << LOG_N, 1 << (LOG_N - 1 - step), 2 << LOG_N, DESCENDING)
    return x


_KERNELS = Kernels("indexer triton stream top-k", _stream_topk_kernel, op="indexer_topk")


def stream_config_ladder(block_d: int, dtype: torch.dtype, kp: int, interpreted: bool) -> list[IndexerConfig]:
    """Launch configurations tried in order (the first that compiles is kept per shape class):
    ``IndexerConfig(block_m, block_n, num_warps, num_stages)``. Small row blocks: the running lists
    ``[BLOCK_M, KP]`` int64 live in registers, and a tile is skipped only when no row of the block has
    a candidate above its threshold."""
    if interpreted:  # numpy runs the tiles: small ones keep the CPU tests fast and still multi-tile
        return [IndexerConfig(16, 16, 4, 1)]
    if dtype == torch.float32 or block_d > 128:
        ladder = [(16, 64, 4, 2), (16, 32, 4, 1)]
    elif kp <= 512:  # (16, 128, 8, 2) at k = 512 (Triton 3.6 -> ptxas, sm_90a, bf16, Di = 128): 252-255
        # registers, at most 32 bytes spilled, 64 KB shared; (16, 64, 4, 2) spills 128 bytes
        ladder = [(16, 128, 8, 2), (16, 64, 4, 2), (16, 32, 4, 1)]
    else:  # k = 1024 (pro): (16, 128, 8, 2) spills ~740 bytes per thread, 128 KB shared
        ladder = [(16, 128, 8, 2), (16, 64, 8, 2), (16, 32, 4, 1)]
    return [IndexerConfig(*c) for c in ladder]


@torch.no_grad()
def indexer_topk_stream(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    query_doc: torch.Tensor,
    query_limit: torch.Tensor,
    key_doc: torch.Tensor,
    key_j: torch.Tensor,
    k: int,
    *,
    config: IndexerConfig | None = None,
    key_row_limit: tuple[int, int] | None = None,
    native_sort: bool | None = None,
) -> torch.Tensor:
    """Rows of ``keys`` with the ``k`` highest indexer scores among those visible, per query, in one
    streaming kernel pass (no score buffer). Arguments and result as in
    :func:`dsv4cp.kernels.indexer_triton.indexer_topk_triton` (``k <= MAX_STREAM_K``); ``config`` pins
    the launch (``block_m`` query rows per program, ``block_n`` key rows per tile: an
    :class:`IndexerConfig` or the kernel option ``triton_topk_stream_config``'s integers; default:
    :func:`stream_config_ladder`). ``native_sort``: sort with
    ``tl.sort`` / ``tl.bitonic_merge`` (default on CUDA) or with the vectorised network (default under
    the interpreter, where ``tl.sort`` is very slow); lets a CPU test run the GPU's sorting code.

    Returns: ``[T, k]`` int64 key rows in increasing order, ``-1`` where fewer than ``k`` are visible;
    among equal scores at the cut the lower key rows win.
    """
    k = _check_k(k)
    if k > MAX_STREAM_K:
        raise ValueError(f"k: the streaming top-k keeps at most {MAX_STREAM_K} entries per query, got {k}")
    _check_qwk(q, w, keys)
    _check_visibility(q, keys, query_doc, query_limit, key_doc, key_j)
    base, ratio = _check_key_row_limit(key_row_limit)
    pinned = pinned_config(config, IndexerConfig)
    t, hi, di = q.shape
    g = keys.shape[0]
    out = torch.full((t, k), -1, dtype=torch.int64, device=q.device)
    if t == 0 or g == 0:
        return out
    dev = q.device
    if key_row_limit is None:
        lo, hi_row = key_ranges(query_doc, query_limit, key_doc, key_j)  # on the device: no host read
    else:
        lo = hi_row = out  # unread (HAS_RANGES=False): any tensor argument
    q, wt, keys, qdoc, qlim, kdoc, kj = _prepare(q, w, keys, query_doc, query_limit, key_doc, key_j)
    block_d = triton.next_power_of_2(di)
    kp_min = triton.next_power_of_2(k)
    kernel = _KERNELS.build("_stream_topk_kernel", dev)
    ladder = stream_config_ladder(block_d, q.dtype, kp_min, _interpreted(dev))

    def launch(cfg: IndexerConfig) -> None:
        kernel[(triton.cdiv(t, cfg.block_m),)](
            q, wt, keys, qdoc, qlim, kdoc, kj, lo, hi_row, out,
            t, g, hi, k, base, max(ratio, 1),
            q.stride(0), q.stride(1), wt.stride(0), keys.stride(0), out.stride(0),
            DI=di, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            KP=max(kp_min, cfg.block_n), HAS_RANGES=key_row_limit is None,
            PRECISION=_precision(q.dtype, dev), DOT_F32=_dot_f32(q.dtype, dev),
            NATIVE_SORT=native_sort if native_sort is not None else not _interpreted(dev),
            LOG_N=cfg.block_n.bit_length() - 1, LOG_KP=max(kp_min, cfg.block_n).bit_length() - 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _KERNELS.launch("stream_topk", (dev.type, di, q.dtype, kp_min), ladder, pinned, launch)
    return out
