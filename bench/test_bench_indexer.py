"""Lightning-indexer microbenchmarks (DESIGN 1.6, 4.2, 4.3, 5): scoring + top-K per backend and shape.

Shapes: ONE document of T tokens, its ``G = T/4`` compressed entries as keys (the CP = 1 layout), query
t sees entries ``j < (t + 1) // 4``; ``Hi = 64, Di = 128, K = 512``, bf16 on GPU:

* ``8k``, ``32k``, ``64k``: T = 8192, 32768, 65536 (GPU only);
* ``tiny``: T = 64, Hi = 4, Di = 32, K = 8, fp32 (CPU and GPU: CI exercises every path).

Backends:

* ``torch``: :func:`dsv4cp.ops.indexer.indexer_topk` (the oracle: per-head scores of a query chunk
  against ALL keys, masked, then ``_select_top``);
* ``triton``: :func:`dsv4cp.ops.indexer.fused_indexer_topk` as the layer calls it (its
  default path: ``DSV4CP_TOPK_IMPL``, else the chunked path);
* ``triton-head-pairs``: ``triton`` with ``DSV4CP_TRITON_INDEXER_HEAD_PAIRS=1`` (the chunked path's score
  kernel takes the heads in pairs, one product in flight during the other's epilogue; its own tile
  ladder): beside ``triton`` it times the whole top-k with the option on and off in one run;
* ``triton-bounded-2048x8x4x2``: ``triton`` with the ``bounded`` radix select pinned to ``2048,8,4,2``
  (``DSV4CP_TRITON_SELECT_CONFIG``), its default before ``1024,5,4,2``: the two side by side in one run;
* ``triton-chunked``: the same with ``impl="chunked"`` (fused head-sum score kernel per query chunk,
  then the default selection of ``DSV4CP_TOPK_SELECT``: ``radix`` on CUDA, ``torch`` on the CPU);
* ``triton-chunked-radix``: the chunked path with ``DSV4CP_TOPK_SELECT=radix`` (fp32 score buffers
  planned at 4 bytes per score, selected by the Triton radix select of
  :mod:`dsv4cp.kernels.select_top_triton`);
* ``triton-chunked-radix-bounded``: the same with ``DSV4CP_TOPK_SELECT_VARIANT=bounded`` (the radix
  select's kernel that finds the largest score and a lower bound on the cut first, then starts its
  radix passes below their common bits; ``triton-chunked-radix`` pins ``plain``, the kernel before it);
* ``triton-chunked-torch``: the same with ``DSV4CP_TOPK_SELECT=torch`` (the kernel's epilogue writes
  int64 selection keys into the buffer, then one ``torch.topk`` over them: ``select_top_packed``;
  ``DSV4CP_TOPK_KEYS=packed``: the default before the radix select);
* ``triton-chunked-scores``: the same with ``DSV4CP_TOPK_KEYS=scores`` (the kernel writes fp32 scores,
  ``_select_top`` builds the int64 keys in torch: the path before the packed epilogue);
* ``triton-stream``: the same with ``impl="stream"``
  (:mod:`dsv4cp.kernels.indexer_topk_triton`: scoring and a running top-k in one pass, no buffer);
* ``triton-score``: the Triton path's scoring alone (every chunk scored, nothing selected): the score
  kernel's own throughput (fp32 scores); ``triton-score-packed``: the same writing packed int64 keys;
  ``triton-score-radix``: fp32 scores in the radix path's chunks (4 bytes per score: fewer, taller
  chunks), so ``triton-chunked-radix`` minus it is the radix selection's share.

Also (GPU only) ``test_indexer_score_config``: the score kernel alone at T = 32K under each launch
configuration of the ladder (pinned), to pick the default on the machine, and (ids ending ``-head-pairs``)
with the head-pair loop at the tiles of ``HEAD_PAIR_CONFIGS``, beside the same tile one head at a time;
``test_indexer_topk_stream_config``: the same for the streaming top-k's tiles;
``test_indexer_select`` (GPU only, 32K and 64K): the selection ALONE over every chunk's buffer, scored
once beforehand (``radix``: :func:`~dsv4cp.kernels.select_top_triton.select_top_triton` over the fp32
chunks, also ``radix-static``: the static plan's chunks with their row limits, as the layer runs it;
``torch``: ``select_top_packed`` over the int64 key chunks; TFLOP/s: the top-k's scoring FLOPs over the
selection's time, an effective figure to set beside the others); ``test_indexer_select_config``: the
radix selection alone at 64K under each launch of ``SELECT_SWEEP`` (pinned);
``test_indexer_select_bounded_config``: the same for the ``bounded`` kernel (``BOUNDED_SELECT_SWEEP``);
``test_indexer_topk_packed``: the radix top-k of 16 packed documents (64K tokens, the layer's static
plan) with each select kernel; and
``test_indexer_scores_fwd_bwd``: the differentiable scores at K = 512 given entries per query (the
indexer loss's prediction), forward + backward, torch vs Triton: the default, the original backward
(acq_rel atomics), the deterministic one and (GPU only) the backward pinned to each ladder tile (FLOPs
``3 * 2 * Hi * Di`` per valid slot: the forward, and the backward's ``dq`` and ``dkeys`` products);
``test_indexer_scores_reduce``: the backward's three key-gradient reductions (``atomic``, ``sorted``,
``sorted-bf16``) side by side, forward + backward and the backward alone (GPU: 64K; CPU: tiny);
``test_indexer_scores_reduce_parts``: each part of those backwards timed alone (the sort and destinations,
the backward kernel, the segment sums; and the forward kernel for the gathers' share).

``benchmark.extra_info``: FLOPs ``2 * Hi * Di`` per (query, VISIBLE entry) (DESIGN 4.3: causally
invisible pairs are not counted, whatever a backend computes) and the TFLOP/s of the median;
``peak_extra_bytes`` / ``peak_extra_gib``: on CUDA, ``torch.cuda.max_memory_allocated`` during one
untimed call (after ``reset_peak_memory_stats``) minus what was allocated before it and minus the
output (``None`` on CPU); ``chunks`` / ``budget_bytes`` for the Triton paths.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, Shape, bench_device, bench_dtype, one_shape_at_a_time
from dsv4cp.kernel_options import OPTIONS, KernelOptions
from dsv4cp.ops.indexer import indexer_topk, scores_backward_keywords

_VARIANT_ENV = OPTIONS["topk_select_variant"].env

BACKENDS = ["torch", "triton", "triton-head-pairs", "triton-bounded-2048x8x4x2", "triton-chunked",
            "triton-chunked-radix",
            "triton-chunked-radix-bounded", "triton-chunked-torch", "triton-chunked-scores", "triton-stream",
            "triton-score", "triton-score-packed", "triton-score-radix"]

_SELECT = {"triton-chunked-radix": "radix", "triton-chunked-radix-bounded": "radix", "triton-chunked-torch": "torch",
           "triton-chunked-scores": "torch"}
"""``DSV4CP_TOPK_SELECT`` per backend (the others run the default)."""

_SELECT_VARIANT = {"triton-chunked-radix": "plain", "triton-chunked-radix-bounded": "bounded"}
"""``DSV4CP_TOPK_SELECT_VARIANT`` per backend (the radix select's kernel; the others run the default)."""

_HEAD_PAIRS_ENV = OPTIONS["triton_indexer_head_pairs"].env

_SELECT_PINS = {"triton-bounded-2048x8x4x2": "2048,8,4,2"}
"""``DSV4CP_TRITON_SELECT_CONFIG`` per backend: the default top-k with its ``bounded`` select pinned to the
ladder's first before ``1024,5,4,2`` (the others run the ladder)."""
_SELECT_CONFIG_ENV = OPTIONS["triton_select_config"].env

_DEFAULT_PATH = ("triton", "triton-head-pairs", *_SELECT_PINS)
"""Backends that run the op's default path (``impl`` left to the op) under their variables."""


SHAPES = {
    "tiny": Shape("tiny", 64, 4, 32, 8),
    "8k": Shape("8k", 8192, 64, 128, 512),
    "32k": Shape("32k", 32768, 64, 128, 512),
    "64k": Shape("64k", 65536, 64, 128, 512),
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny")] + [
    pytest.param(name, id=name, marks=GPU_ONLY) for name in ("8k", "32k", "64k")
]




@one_shape_at_a_time
def _inputs(shape: Shape) -> dict:
    """Cached inputs of one shape (the previous shape's are dropped first)."""
    device, dtype = bench_device(), bench_dtype()
    g = torch.Generator(device=device).manual_seed(4242)
    t, hi, di, n = shape.tokens, shape.heads, shape.dim, shape.n_compressed
    q = torch.randn(t, hi, di, device=device, generator=g).to(dtype)
    keys = torch.randn(n, di, device=device, generator=g).to(dtype)
    w = torch.randn(t, hi, device=device, generator=g) * (hi * di) ** -0.5
    pos = torch.arange(t, device=device)
    query_doc = torch.zeros(t, dtype=torch.int64, device=device)
    query_limit = (pos + 1) // 4
    key_doc = torch.zeros(n, dtype=torch.int64, device=device)
    key_j = torch.arange(n, device=device)
    visible_pairs = int(query_limit.clamp_max(n).sum().item())
    entry = {"q": q, "w": w, "keys": keys, "query_doc": query_doc, "query_limit": query_limit,
             "key_doc": key_doc, "key_j": key_j, "visible_pairs": visible_pairs}
    return entry


def _visible(entry: dict):
    qdoc, qlim, kdoc, kj = _vis_args(entry)

    def visible(rows: slice) -> torch.Tensor:
        return ((qdoc[rows, None] >= 0) & (kdoc[None, :] == qdoc[rows, None])
                & (kj[None, :] < qlim[rows, None]))

    return visible


def _runner(backend: str, shape: Shape, entry: dict):
    """A no-argument callable running ``backend`` once, plus extra info about it."""
    q, w, keys = entry["q"], entry["w"], entry["keys"]
    vis_args = _vis_args(entry)
    if backend == "torch":
        visible = _visible(entry)
        return (lambda: indexer_topk(q, w, keys, visible, shape.topk)), {}
    from dsv4cp.kernels import triton_available

    if not triton_available(q.device):
        pytest.skip(f"{backend}: triton cannot run on {q.device} here")
    from dsv4cp.kernels import indexer_triton as it

    lo, hi = it.key_ranges(*vis_args)
    # bytes per score of each path's chunk plan: radix fp32 4, packed int64 keys 16, torch fp32 keys 24
    from dsv4cp.kernels import interpreted
    from dsv4cp.ops.indexer import fused_indexer_topk

    options = KernelOptions.resolve()  # the variables this benchmark sets, read once
    select = options.topk_select
    radix = backend in ("triton-chunked-radix", "triton-chunked-radix-bounded", "triton-score-radix") or (
        backend in (*_DEFAULT_PATH, "triton-chunked")
        and (select == "radix" or (select == "auto" and not interpreted(q.device))))  # the op's rule
    fp32 = backend in ("triton-chunked-scores", "triton-score")
    per_score = (it.TOPK_RADIX_BYTES_PER_SCORE if radix else
                 it.TOPK_SCORES_BYTES_PER_SCORE if fp32 else it.TOPK_BYTES_PER_SCORE)
    info = {"chunks": len(it.plan_chunks(lo, hi, it.TOPK_BUDGET_BYTES, bytes_per_score=per_score)),
            "budget_bytes": it.TOPK_BUDGET_BYTES, "budget_bytes_per_score": per_score}
    if not backend.startswith("triton-score"):
        impl = "stream" if backend == "triton-stream" else None if backend in _DEFAULT_PATH else "chunked"
        if impl == "stream":
            info = {}  # one kernel pass: no chunks, no budget
        return (lambda: fused_indexer_topk(q, w, keys, *vis_args, shape.topk, impl=impl, options=options)), info

    def score_only():
        last = None
        for _, _, _, scores in it.iter_score_chunks(q, w, keys, *vis_args, packed=not (fp32 or radix),
                                                    bytes_per_score=per_score):
            last = scores
        return last

    return score_only, info


def _peak_extra_bytes(fn) -> int | None:
    """Peak allocator memory of one call beyond what existed before it and beyond its output."""
    if not HAS_CUDA:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    out_bytes = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
    # triton-score returns a view of its internal buffer: that buffer is working memory, not output
    if out is not None and out._base is not None:
        out_bytes = 0
    del out
    return int(peak - out_bytes)


def _rounds(shape: Shape) -> tuple[int, int]:
    if not HAS_CUDA:
        return 2, 1
    return (5, 1) if shape.tokens <= 8192 else (3, 1)


def _bytes(shape: Shape, entry: dict) -> float:
    """Logical traffic: q, w, keys read once, the [T, K] int64 selection written once."""
    el = entry["q"].element_size()
    t, hi, di = shape.tokens, shape.heads, shape.dim
    return t * hi * di * el + t * hi * 4 + shape.n_compressed * di * el + t * shape.topk * 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_indexer_topk(benchmark, measure, shape_name, backend, monkeypatch):
    from dsv4cp.kernels.indexer_triton import TOPK_KEYS_ENV, TOPK_SELECT_ENV

    # the chunked path's selection and (torch selection) buffer: fp32 scores for the old path, else the
    # default (packed keys)
    if backend == "triton-chunked-scores":
        monkeypatch.setenv(TOPK_KEYS_ENV, "scores")
    else:
        monkeypatch.delenv(TOPK_KEYS_ENV, raising=False)
    if backend in _SELECT:
        monkeypatch.setenv(TOPK_SELECT_ENV, _SELECT[backend])
    else:
        monkeypatch.delenv(TOPK_SELECT_ENV, raising=False)
    if backend in _SELECT_VARIANT:
        monkeypatch.setenv(_VARIANT_ENV, _SELECT_VARIANT[backend])
    else:
        monkeypatch.delenv(_VARIANT_ENV, raising=False)
    if backend == "triton-head-pairs":
        monkeypatch.setenv(_HEAD_PAIRS_ENV, "1")
    else:
        monkeypatch.delenv(_HEAD_PAIRS_ENV, raising=False)
    if backend in _SELECT_PINS:
        monkeypatch.setenv(_SELECT_CONFIG_ENV, _SELECT_PINS[backend])
    else:
        monkeypatch.delenv(_SELECT_CONFIG_ENV, raising=False)
    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    fn, info = _runner(backend, shape, entry)
    benchmark.group = f"indexer.topk.{shape.name}"
    flops = 2.0 * shape.heads * shape.dim * entry["visible_pairs"]
    fn()  # compile / pick a configuration outside the timing
    peak = _peak_extra_bytes(fn)
    benchmark.extra_info.update(
        backend=backend, shape=shape.name, T=shape.tokens, Hi=shape.heads, Di=shape.dim, G=shape.n_compressed,
        K=shape.topk, dtype=str(entry["q"].dtype), visible_pairs=entry["visible_pairs"],
        peak_extra_bytes=peak, peak_extra_gib=None if peak is None else peak / 2**30, **info,
    )
    rounds, warmup = _rounds(shape)
    out = measure(fn, None, flops=flops, bytes_moved=_bytes(shape, entry), rounds=rounds,
                  warmup_rounds=warmup, device=entry["q"].device)
    if not backend.startswith("triton-score"):
        assert out.shape == (shape.tokens, shape.topk) and out.dtype == torch.int64
        assert ((out >= -1) & (out < shape.n_compressed)).all()


PACKED_DOCS = 16
"""Documents of ``test_indexer_topk_packed``: 64K tokens as 16 documents of 4K, one after the other."""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the packed top-k is timed on CUDA")
@pytest.mark.parametrize("variant", ["plain", "bounded"])
def test_indexer_topk_packed(benchmark, measure, variant, monkeypatch):
    """The chunked radix top-k at T = 64K packed as :data:`PACKED_DOCS` documents (query t of document d
    sees d's entries ``j < (pos + 1) // 4``), with the static plan the layer uses (``key_row_limit = (0,
    4)``: chunks start at key row 0, so most of a row is other documents' ``-inf``): ``plain`` reads and
    writes every column before the causal limit, ``bounded`` each query's own key range."""
    from dsv4cp.kernels.indexer_triton import TOPK_SELECT_ENV
    from dsv4cp.ops.indexer import fused_indexer_topk

    monkeypatch.setenv(TOPK_SELECT_ENV, "radix")
    monkeypatch.setenv(_VARIANT_ENV, variant)
    options = KernelOptions.resolve()
    shape = SHAPES["64k"]
    entry = _inputs(shape)
    t, n = shape.tokens, shape.n_compressed
    doc_tokens, doc_keys = t // PACKED_DOCS, n // PACKED_DOCS
    pos = torch.arange(t, device=entry["q"].device)
    key_rows = torch.arange(n, device=pos.device)
    vis = (pos // doc_tokens, (pos % doc_tokens + 1) // 4, key_rows // doc_keys, key_rows % doc_keys)
    visible_pairs = int(vis[1].clamp_max(doc_keys).sum().item())

    def run():
        return fused_indexer_topk(entry["q"], entry["w"], entry["keys"], *vis, shape.topk, impl="chunked",
                                  key_row_limit=(0, 4), options=options)

    run()  # compile outside the timing
    benchmark.group = "indexer.topk.packed.64k"
    benchmark.extra_info.update(backend=f"triton-chunked-radix-{variant}", T=t, G=n, K=shape.topk,
                                docs=PACKED_DOCS, visible_pairs=visible_pairs)
    rounds, warmup = _rounds(shape)
    out = measure(run, None, flops=2.0 * shape.heads * shape.dim * visible_pairs, bytes_moved=_bytes(shape, entry),
                  rounds=rounds, warmup_rounds=warmup, device=entry["q"].device)
    assert out.shape == (t, shape.topk) and ((out >= -1) & (out < n)).all()


SCORE_CONFIGS = [(64, 256, 8, 3), (64, 256, 8, 2), (128, 128, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 2)]
HEAD_PAIR_CONFIGS = [(64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 3)]
"""The tiles ``test_indexer_score_config`` also times with the head-pair loop (each one head at a time too):
the plain default, its two-stage form (two pair programs per SM fit its shared memory), the pair ladder's
first two (no spill on sm_90a) and the tall tile (``python -m bench.compile_indexer_score_sm90``)."""
SCORE_CONFIG_PARAMS = [pytest.param(cfg, False, id="x".join(map(str, cfg)))
                       for cfg in SCORE_CONFIGS + [c for c in HEAD_PAIR_CONFIGS if c not in SCORE_CONFIGS]] + [
    pytest.param(cfg, True, id="x".join(map(str, cfg)) + "-head-pairs") for cfg in HEAD_PAIR_CONFIGS]
STREAM_CONFIGS = [(32, 128, 8, 2), (16, 128, 8, 2), (16, 64, 4, 2), (64, 64, 8, 2)]


def _time_pinned_tile(benchmark, measure, cfg, group: str, backend: str, run_with, **extra) -> None:
    """Time ``run_with(config)`` at T = 32K under the pinned tile ``cfg`` (skipped when it does not fit),
    with the scoring FLOPs of the shape; ``extra`` goes into ``extra_info``."""
    from dsv4cp.kernels import indexer_triton as it

    shape = SHAPES["32k"]
    entry = _inputs(shape)
    config = it.IndexerConfig(*cfg)

    def run():
        return run_with(entry, shape, config)

    try:
        run()
    except it.OutOfResources as exc:
        pytest.skip(f"{cfg}: does not fit ({exc})")
    benchmark.group = group
    benchmark.extra_info.update(backend=backend, config=list(cfg), T=shape.tokens, Hi=shape.heads, Di=shape.dim,
                                G=shape.n_compressed, visible_pairs=entry["visible_pairs"], **extra)
    rounds, warmup = _rounds(shape)
    measure(run, None, flops=2.0 * shape.heads * shape.dim * entry["visible_pairs"],
            bytes_moved=_bytes(shape, entry), rounds=rounds, warmup_rounds=warmup, device=entry["q"].device)


def _vis_args(entry: dict) -> tuple:
    return entry["query_doc"], entry["query_limit"], entry["key_doc"], entry["key_j"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="config sweep needs CUDA")
@pytest.mark.parametrize("cfg,head_pairs", SCORE_CONFIG_PARAMS)
def test_indexer_score_config(benchmark, measure, cfg, head_pairs):
    """The scoring kernel alone (no selection) at T = 32K under each pinned tile, one head at a time and
    (``-head-pairs``, the tiles of ``HEAD_PAIR_CONFIGS``) with the head-pair loop."""
    from dsv4cp.kernels import indexer_triton as it

    def score_only(entry, shape, config):
        last = None
        for _, _, _, scores in it.iter_score_chunks(entry["q"], entry["w"], entry["keys"], *_vis_args(entry),
                                                    config=config, head_pairs=head_pairs):
            last = scores
        return last

    _time_pinned_tile(benchmark, measure, cfg, "indexer.score.config.32k",
                      "triton-score-head-pairs" if head_pairs else "triton-score", score_only, head_pairs=head_pairs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="config sweep needs CUDA")
@pytest.mark.parametrize("cfg", STREAM_CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_indexer_topk_stream_config(benchmark, measure, cfg):
    """The streaming top-k at T = 32K under each pinned tile (``block_m, block_n, warps, stages``)."""
    from dsv4cp.kernels.indexer_topk_triton import indexer_topk_stream

    def stream(entry, shape, config):
        return indexer_topk_stream(entry["q"], entry["w"], entry["keys"], *_vis_args(entry), shape.topk,
                                   config=config)

    _time_pinned_tile(benchmark, measure, cfg, "indexer.topk.stream.config.32k", "triton-stream", stream,
                      K=SHAPES["32k"].topk)


SELECT_BACKENDS = ["radix", "radix-static", "radix-bounded", "radix-static-bounded", "torch"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the selection alone is timed on CUDA")
@pytest.mark.parametrize("backend", SELECT_BACKENDS)
@pytest.mark.parametrize("shape_name", ["32k", "64k"])
def test_indexer_select(benchmark, measure, shape_name, backend):
    """The chunked top-k's selection alone: every chunk of the path's plan is scored once (kept, cloned),
    then the timed call selects all of them (``radix``: fp32 chunks at 4 bytes per score, exact plan;
    ``radix-static``: the static plan of ``key_row_limit = (0, 4)`` with each chunk's row limit, as the
    layer runs it; both on the ``plain`` kernel, and ``-bounded`` on the ``bounded`` one;
    ``torch``: int64 packed-key chunks at 16 bytes per score and ``select_top_packed``)."""
    _time_selection(benchmark, measure, shape_name, backend, None, f"indexer.select.{shape_name}")


def _time_selection(benchmark, measure, shape_name: str, backend: str, config, group: str) -> None:
    """Score every chunk of ``backend``'s plan once, then time selecting all of them (``config``: the
    radix select's pinned launch, or None)."""
    from dsv4cp.kernels import indexer_triton as it
    from dsv4cp.kernels.contracts import select_top_packed
    from dsv4cp.kernels.select_top_triton import select_top_triton

    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    radix = backend != "torch"
    limit = (0, 4) if backend.startswith("radix-static") else None
    variant = "bounded" if backend.endswith("-bounded") else "plain"
    per_score = it.TOPK_RADIX_BYTES_PER_SCORE if radix else it.TOPK_BYTES_PER_SCORE
    chunks = [(s, col0, block.clone()) for s, _, col0, block in it.iter_score_chunks(
        entry["q"], entry["w"], entry["keys"], *_vis_args(entry), packed=not radix, bytes_per_score=per_score,
        key_row_limit=limit)]

    def select():
        last = None
        for s, col0, block in chunks:
            keep = min(shape.topk, block.shape[1])
            if radix:
                row_limit = None if limit is None else (limit[0] - col0, limit[1], s)
                last = select_top_triton(block, keep, row_limit=row_limit, config=config, variant=variant)
            else:
                last = select_top_packed(block, keep)
        return last

    select()  # compile outside the timing
    benchmark.group = group
    buffer_bytes = sum(block.numel() * block.element_size() for _, _, block in chunks)
    benchmark.extra_info.update(backend=backend, shape=shape.name, T=shape.tokens, G=shape.n_compressed, K=shape.topk,
                                chunks=len(chunks), buffer_bytes=buffer_bytes,
                                visible_pairs=entry["visible_pairs"])
    rounds, warmup = _rounds(shape)
    measure(select, None, flops=2.0 * shape.heads * shape.dim * entry["visible_pairs"], bytes_moved=buffer_bytes,
            rounds=rounds, warmup_rounds=warmup, device=entry["q"].device)
    chunks.clear()  # gigabytes at 64K: free them before the next case


SELECT_SWEEP = [(2048, 8, 8, 2), (2048, 8, 4, 2), (1024, 8, 4, 2), (2048, 10, 8, 2),
                (2048, 6, 4, 2), (2048, 5, 4, 2), (2048, 4, 4, 2), (2048, 3, 4, 2), (1024, 4, 4, 2),
                (4096, 4, 8, 2), (2048, 4, 8, 2), (1024, 4, 2, 2)]
"""Radix-select launches timed by ``test_indexer_select_config`` (``block_n, radix_bits, num_warps,
num_stages``): the ladder (:data:`dsv4cp.kernels.select_top_triton.SELECT_CONFIGS`), other steps and
warps, and other digit widths: a first H200 run (results/2026-12-01-h200-radix-topk-glue) timed the selection at
~(passes x bins) (8 bits 14.3 ms, 10 bits 35.1, 11 bits 80.3 at 64K), so narrower digits (more passes
over an L2-resident row, far fewer bins) are swept too."""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="config sweep needs CUDA")
@pytest.mark.parametrize("cfg", SELECT_SWEEP, ids=lambda c: "x".join(map(str, c)))
def test_indexer_select_config(benchmark, measure, cfg):
    """The radix selection alone at T = 64K (the exact plan's fp32 chunks) under each pinned launch."""
    from dsv4cp.kernels.select_top_triton import SelectConfig

    _time_selection(benchmark, measure, "64k", "radix", SelectConfig(*cfg), "indexer.select.config.64k")
    benchmark.extra_info.update(config=list(cfg))


BOUNDED_SELECT_SWEEP = [(1024, 5, 4, 2), (2048, 8, 4, 2), (1024, 8, 4, 2), (2048, 8, 8, 2), (2048, 6, 4, 2),
                        (1024, 6, 4, 2), (2048, 5, 4, 2), (1024, 10, 4, 2), (4096, 8, 8, 2), (1024, 4, 4, 2),
                        (1024, 3, 4, 2), (1024, 5, 2, 2), (1024, 4, 2, 2), (1024, 5, 8, 2), (1024, 5, 4, 1)]
"""Launches of the ``bounded`` radix select timed by ``test_indexer_select_bounded_config`` (``block_n,
radix_bits, num_warps, num_stages``; the first is the ladder's default, the second the default before it).
Its histograms run over the ``block_n`` lane maxima and the short candidate list, not the row, so the step
sets both the register use (programs per SM) and how tight the lower bound is (keys listed per row, for
independent scores at ``keep`` = 512: ~589 at 2048 lanes, ~710 at 1024, of the 768 the list holds; ~547 at
4096), and narrower digits (Triton 3.6's histogram costs per bin) may pay until the passes multiply; warps
and stages around the default complete it. Registers per thread (sm_90a, Triton 3.9): 2048 x 8 x 4: 166,
1024 x 8 x 4: 72, 2048 x 8 x 8: 102, 2048 x 6 x 4: 160, 1024 x 6 x 4: 80, 2048 x 5 x 4: 166, 1024 x 5 x 4: 72
(96 with the H200's Triton 3.6, ncu), 1024 x 10 x 4: 96, 4096 x 8 x 8: 190 (1024-column steps keep 8 bytes
of stack, no spill elsewhere)."""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="config sweep needs CUDA")
@pytest.mark.parametrize("cfg", BOUNDED_SELECT_SWEEP, ids=lambda c: "x".join(map(str, c)))
def test_indexer_select_bounded_config(benchmark, measure, cfg):
    """The ``bounded`` radix selection alone at T = 64K (the static plan's fp32 chunks and row limits, as
    the layer runs it) under each pinned launch."""
    from dsv4cp.kernels.select_top_triton import SelectConfig

    _time_selection(benchmark, measure, "64k", "radix-static-bounded", SelectConfig(*cfg),
                    "indexer.select.bounded.config.64k")
    benchmark.extra_info.update(config=list(cfg))


_SCORES_PARAMS = [pytest.param("tiny", id="tiny")] + [
    pytest.param(name, id=name, marks=GPU_ONLY) for name in ("8k", "32k", "64k")
]

try:
    from dsv4cp.kernels.indexer_scores_triton import GATHER_BWD_CONFIGS as _BWD_TILES
    from dsv4cp.kernels.indexer_scores_triton import KEYS_ON_M_BWD_CONFIGS as _KEYS_ON_M_TILES
except ImportError:  # pragma: no cover - no triton: only the torch backend runs
    _BWD_TILES, _KEYS_ON_M_TILES = [], []
_BWD_PINS = {"triton-acqrel": "64,8,2,0"} | {
    "triton-bwd-" + "x".join(map(str, tile)): ",".join(map(str, tile)) + ",1" for tile in _BWD_TILES
}
"""Backward pins (:data:`dsv4cp.kernels.indexer_scores_triton.BWD_CONFIG_ENV`): the original kernel
(acq_rel atomics, its 64 x 8 x 2 tile) and every tile of the ladder with relaxed atomics."""

_LAYOUTS = {"triton-heads-on-m": "heads_on_m", "triton-keys-on-m": "keys_on_m", "triton-keys-on-m-in-step": "keys_on_m"}
"""The backward kernel's layout per backend (the kernel option ``triton_scores_bwd_layout``; the heads-on-M
pins of ``_BWD_PINS`` run the heads-on-M kernel, the others the default); ``triton-keys-on-m-in-step`` loads
each step's indices in the step (``triton_scores_bwd_index_ahead=0``)."""

_SCORES_BACKENDS = ["torch", "triton", "triton-deterministic", "triton-acqrel", *_LAYOUTS] + [
    pytest.param(name, marks=GPU_ONLY) for name in _BWD_PINS if name != "triton-acqrel"
]


def _selection(shape: Shape, entry: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(idx, grad, valid slots)`` of the scores benchmarks: up to K random entries among each query's
    visible ones (``-1`` beyond), and a random upstream gradient, zero at the empty slots."""
    device = entry["q"].device
    g = torch.Generator(device=device).manual_seed(99)
    limit = entry["query_limit"].clamp_max(shape.n_compressed)
    slots = torch.arange(shape.topk, device=device)
    idx = (torch.rand(shape.tokens, shape.topk, device=device, generator=g) * limit[:, None]).long()
    idx = torch.where(slots[None, :] < limit[:, None], idx, -1)
    grad = torch.randn(idx.shape, device=device, generator=g) * (idx >= 0)
    return idx, grad, int((idx >= 0).sum().item())


def _triton_selection(shape_name: str) -> tuple[Shape, dict, torch.Tensor, torch.Tensor, int]:
    """``(shape, inputs, idx, grad, valid slots)`` of a scores benchmark of the Triton kernels alone
    (:func:`_inputs`, :func:`_selection`); skips where triton cannot run on the inputs' device."""
    from dsv4cp.kernels import triton_available

    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    if not triton_available(entry["q"].device):
        pytest.skip(f"triton cannot run on {entry['q'].device} here")
    return (shape, entry, *_selection(shape, entry))


@pytest.mark.parametrize("backend", _SCORES_BACKENDS)
@pytest.mark.parametrize("shape_name", _SCORES_PARAMS)
def test_indexer_scores_fwd_bwd(benchmark, measure, shape_name, backend, monkeypatch):
    """``triton`` (the defaults: relaxed fp32 atomics for the key gradients) against ``triton-acqrel``
    (the original kernel: acq_rel atomics), ``triton-deterministic`` (per-slot contributions summed per key
    row after a stable sort, no atomics) and the two backward layouts at their ladders' first tiles
    (``triton-heads-on-m``, ``triton-keys-on-m``, and ``triton-keys-on-m-in-step`` without the indices
    ahead); ``triton-bwd-KxWxS``: the heads-on-M backward pinned to
    each of its ladder's tiles (GPU only). One forward + backward each, side by side."""
    from dsv4cp import kernels
    from dsv4cp.ops.indexer import indexer_scores

    if backend == "triton-deterministic":
        monkeypatch.setattr(kernels, "_DETERMINISTIC", True)
    if backend in _BWD_PINS:
        from dsv4cp.kernels.indexer_scores_triton import BWD_CONFIG_ENV

        monkeypatch.setenv(BWD_CONFIG_ENV, _BWD_PINS[backend])
    layout = _LAYOUTS.get(backend, "heads_on_m" if backend in _BWD_PINS else None)
    if layout is not None:
        monkeypatch.setenv(OPTIONS["triton_scores_bwd_layout"].env, layout)
    if backend == "triton-keys-on-m-in-step":
        monkeypatch.setenv(OPTIONS["triton_scores_bwd_index_ahead"].env, "0")

    shape = SHAPES[shape_name]
    entry = _inputs(shape)
    q, w, keys = entry["q"], entry["w"], entry["keys"]
    if backend.startswith("triton"):
        from dsv4cp.kernels import triton_available

        if not triton_available(q.device):
            pytest.skip(f"triton cannot run on {q.device} here")
        from dsv4cp.kernels.indexer_scores_triton import indexer_scores_triton as fn
    else:
        fn = indexer_scores
    idx, grad, valid = _selection(shape, entry)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, w, keys)]

    settings = scores_backward_keywords(KernelOptions.resolve())  # the pin this benchmark sets, read once

    def step():
        for x in leaves:
            x.grad = None
        out = fn(*leaves, idx, **settings) if backend.startswith("triton") else fn(*leaves, idx)
        out.backward(grad)
        return out

    step()
    benchmark.group = f"indexer.scores.fwd_bwd.{shape.name}"
    peak = _peak_extra_bytes(step)
    benchmark.extra_info.update(backend=backend, shape=shape.name, T=shape.tokens, Hi=shape.heads,
                                Di=shape.dim, K=shape.topk, valid_slots=valid, dtype=str(q.dtype),
                                bwd_config=_BWD_PINS.get(backend), layout=settings["layout"],
                                index_ahead=settings["index_ahead"],
                                peak_extra_bytes=peak, peak_extra_gib=None if peak is None else peak / 2**30)
    rounds, warmup = _rounds(shape)
    out = measure(step, None, flops=3 * 2.0 * shape.heads * shape.dim * valid, bytes_moved=_bytes(shape, entry),
                  rounds=rounds, warmup_rounds=warmup, device=q.device)
    assert out.shape == idx.shape


_REDUCE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("64k", id="64k", marks=GPU_ONLY)]


@pytest.mark.parametrize("part", ["fwd_bwd", "bwd"])
@pytest.mark.parametrize("reduce", ["atomic", "sorted", "sorted-bf16"])
@pytest.mark.parametrize("shape_name", _REDUCE_PARAMS)
def test_indexer_scores_reduce(benchmark, measure, shape_name, reduce, part):
    """The key-gradient reductions side by side (``reduce=`` of
    :func:`~dsv4cp.kernels.indexer_scores_triton.indexer_scores_triton`, the kernel option
    ``triton_scores_bwd_reduce``): fp32 atomics, and per-slot fp32 / bf16 contributions stored in key-row
    order and summed per key row (the sort, the backward kernel and the segment sums). ``fwd_bwd``: one
    forward + backward; ``bwd``: the backward alone, of one saved forward (FLOPs: the backward's ``dq``
    and ``dkeys`` products, ``2 * 2 * Hi * Di`` per valid slot; the recompute of ``s`` is not counted)."""
    shape, entry, idx, grad, valid = _triton_selection(shape_name)
    from dsv4cp.kernels.indexer_scores_triton import indexer_scores_triton

    leaves = [entry[name].detach().clone().requires_grad_(True) for name in ("q", "w", "keys")]
    if part == "fwd_bwd":
        def step():
            out = indexer_scores_triton(*leaves, idx, reduce=reduce)
            torch.autograd.grad(out, leaves, grad)
            return out
        flops = 3 * 2.0 * shape.heads * shape.dim * valid
    else:
        saved = indexer_scores_triton(*leaves, idx, reduce=reduce)

        def step():
            return torch.autograd.grad(saved, leaves, grad, retain_graph=True)[2]
        flops = 2 * 2.0 * shape.heads * shape.dim * valid

    step()
    benchmark.group = f"indexer.scores.reduce.{part}.{shape.name}"
    peak = _peak_extra_bytes(step)
    benchmark.extra_info.update(reduce=reduce, part=part, shape=shape.name, T=shape.tokens, Hi=shape.heads,
                                Di=shape.dim, K=shape.topk, valid_slots=valid, dtype=str(leaves[0].dtype),
                                peak_extra_bytes=peak, peak_extra_gib=None if peak is None else peak / 2**30)
    rounds, warmup = _rounds(shape)
    measure(step, None, flops=flops, bytes_moved=_bytes(shape, entry), rounds=rounds, warmup_rounds=warmup,
            device=leaves[0].device)


_PARTS = [("atomic", "kernel"), ("atomic", "forward")] + [
    (reduce, part) for reduce in ("sorted", "sorted-bf16") for part in ("destinations", "kernel", "reduce")]


@pytest.mark.parametrize("reduce,part", _PARTS, ids=lambda v: v)
@pytest.mark.parametrize("shape_name", _REDUCE_PARAMS)
def test_indexer_scores_reduce_parts(benchmark, measure, shape_name, reduce, part):
    """Where a backward's time goes, each part alone over all of its chunks
    (:class:`~dsv4cp.kernels.indexer_scores_triton.BackwardPlan`): ``destinations`` (per chunk the
    stable sort of its slots by key row, the segments and the inverse permutation), ``kernel``
    (``_gather_bwd_kernel``: the products, dq and dw, and the key gradients' atomics or scattered row
    stores, with the destinations built beforehand), ``reduce`` (``_segment_reduce_kernel``: the
    contributions' streaming sums per key row); ``atomic`` / ``forward``: the forward kernel, which
    gathers the same key rows for one product (what the backward's gathers alone cost)."""
    shape, entry, idx, grad, valid = _triton_selection(shape_name)
    q, w, keys = entry["q"], entry["w"], entry["keys"]
    from dsv4cp.kernels import indexer_scores_triton as ist

    grad = grad.float().contiguous()
    plan = ist.BackwardPlan.new(q.contiguous(), w.contiguous(), keys.contiguous(), idx, grad, reduce)
    starts = list(plan.starts())
    if part == "forward":
        def step():
            return ist._gather_forward(plan.q, plan.w, plan.keys, idx)
    elif part == "destinations":
        def step():
            return [plan.destinations(t0) for t0 in starts]
    else:
        built = [plan.destinations(t0) for t0 in starts] if reduce != "atomic" else [(None, None)] * len(starts)
        if part == "kernel":
            def step():
                for t0, (dest, _) in zip(starts, built):
                    plan.run_kernel(t0, dest)
        else:
            plan.contrib.zero_()  # finite values: the sums' speed must not depend on leftover bits

            def step():
                for _, seg in built:
                    plan.reduce(seg)

    step()
    benchmark.group = f"indexer.scores.reduce.parts.{shape.name}"
    benchmark.extra_info.update(reduce=reduce, part=part, shape=shape.name, T=shape.tokens, Hi=shape.heads,
                                Di=shape.dim, K=shape.topk, valid_slots=valid, chunks=len(starts),
                                chunk_rows=plan.chunk, dtype=str(q.dtype))
    rounds, warmup = _rounds(shape)
    products = {"forward": 1, "kernel": 3}.get(part, 0)
    measure(step, None, flops=products * 2.0 * shape.heads * shape.dim * valid, bytes_moved=_bytes(shape, entry),
            rounds=rounds, warmup_rounds=warmup, device=q.device)


_KERNEL_TILES = ([("heads_on_m", tile, False) for tile in _BWD_TILES[:1]]
                 + [("keys_on_m", tile, True) for tile in _KEYS_ON_M_TILES]
                 + [("keys_on_m", tile, False) for tile in _KEYS_ON_M_TILES[:1]])


def _kernel_id(value) -> str:
    if isinstance(value, bool):
        return "ahead" if value else "in-step"
    return value if isinstance(value, str) else "x".join(map(str, value))


@pytest.mark.parametrize("layout,tile,ahead", _KERNEL_TILES, ids=_kernel_id)
@pytest.mark.parametrize("shape_name", _REDUCE_PARAMS)
def test_indexer_scores_backward_kernel(benchmark, measure, shape_name, layout, tile, ahead):
    """The scores backward's kernel alone (fp32 atomics into the key gradient; no forward, no reduction
    beyond the atomics) under each layout (the kernel option ``triton_scores_bwd_layout``) and tile, side by
    side: the heads-on-M kernel at its default tile against the keys-on-M kernel at every tile of its ladder
    with its indices a step ahead, and at its first tile without (``triton_scores_bwd_index_ahead``; FLOPs:
    the three products, ``3 * 2 * Hi * Di`` per valid slot). On CPU every tile runs the interpreter's one."""
    from dsv4cp.kernels import interpreted

    shape, entry, idx, grad, valid = _triton_selection(shape_name)
    q, w, keys = entry["q"], entry["w"], entry["keys"]
    from dsv4cp.kernels import indexer_scores_triton as ist

    config = None if interpreted(q.device) else ist.GatherBwdConfig(*tile)
    plan = ist.BackwardPlan.new(q.contiguous(), w.contiguous(), keys.contiguous(), idx, grad.float().contiguous(),
                                "atomic", config, layout=layout, index_ahead=ahead)

    def step():
        plan.run_kernel(0)

    step()
    benchmark.group = f"indexer.scores.bwd_kernel.{shape.name}"
    benchmark.extra_info.update(layout=layout, tile=list(tile), index_ahead=ahead, shape=shape.name, T=shape.tokens,
                                Hi=shape.heads,
                                Di=shape.dim, K=shape.topk, valid_slots=valid, dtype=str(q.dtype))
    rounds, warmup = _rounds(shape)
    measure(step, None, flops=3 * 2.0 * shape.heads * shape.dim * valid, bytes_moved=_bytes(shape, entry),
            rounds=rounds, warmup_rounds=warmup, device=q.device)
