"""Sparse-attention microbenchmarks (DESIGN 4.3, 5): forward and backward per backend and shape.

Shapes (kv rows N = T + T/4: T raw rows then T/4 compressed rows; ``idx`` per query = the previous
``window`` raw rows, -1 before the start, then ``selected`` distinct random compressed rows):

* ``flash``: T = 16384, H = 64,  D = 512, Kt = 640  = 128 + 512   (GPU only)
* ``pro``:   T = 16384, H = 128, D = 512, Kt = 1152 = 128 + 1024  (GPU only)
* ``tiny``:  T = 8,     H = 4,   D = 32,  Kt = 16   = 8 + 8, with max(T/4, 8) compressed rows (CPU and GPU)

FLOPs (DESIGN 4.3): forward ``4 D`` per (query, head, valid key); backward 2.5x forward. Bytes are the
op's logical traffic with each gathered kv row read once per query (see ``_bytes``). bf16 on GPU, fp32
on CPU. Every backend runs in the same session, so one ``--benchmark-json`` holds FlashMLA's forward beside
Triton's, cuDNN's DSA backward beside Triton's, and torch's: the one-sided libraries "flashmla" (forward
only) and "cudnn" (backward only) are timed alone, each where it is available (SM90+ and its package) and
at the head dims it supports (not ``tiny``); a direction a backend lacks is skipped.
Kernel variants of the triton backend are timed beside it (the same call with kernel options set):
``triton-duplicated-logits`` and ``triton-dq-in-dkv`` (the kernels before the variants below: forward
logits computed by both warpgroups; backward dq accumulated by the dkv kernel, two chained products),
``triton-split-logits`` (forward: the two warpgroups split the logits' slots,
``DSV4CP_TRITON_FWD_LOGITS=split``), ``triton-slots-on-m`` (forward: ``kv @ q^T``, 128 slots per step,
``DSV4CP_TRITON_FWD_LOGITS=slots_on_m``), ``triton-dkv-one-matmul`` (backward: the dkv kernel's
``ds^T q + p^T dO`` as one product, ``DSV4CP_TRITON_DKV_ONE_PRODUCT=1``), ``triton-index-ahead`` (each
direction's kernels load the next step's row indices one step ahead, ``DSV4CP_TRITON_FWD_INDEX_AHEAD=1`` /
``DSV4CP_TRITON_BWD_INDEX_AHEAD=1``), the two combined, and the forward's default at other tiles
(``triton-split-ahead-<tile>``), the default with its key loop warp-specialized (``triton-split-ahead-ws``,
``DSV4CP_TRITON_FWD_WARP_SPECIALIZE=1``, also at tiles: ``-ws-<tile>``), and ``triton-dkv-with-dq`` (the
backward before the one with its own dq pass: dq beside the kv gradients in the dkv kernel,
``DSV4CP_TRITON_BWD_DQ_PASS=0``; the others above set it too), and ``triton-kv-pass-4-blocks`` (the default
backward with each kv-pass program over four blocks of 128 columns, ``DSV4CP_TRITON_KV_PASS_CONFIG=64,128,8,3,4``;
the default's kv pass is ``64,128,8,3`` with one; a pinned tile the device cannot fit is skipped). The
current kernels against the new ones at the flash shape::

    pytest bench/test_bench_sparse_attention.py -m gpu -k "flash and triton and not deterministic"

``test_sparse_attention_backward_parts`` times each part of the triton backward alone (the preprocessing,
the scores kernel, the dkv kernel, and the deterministic mode's sort and sums): ``-k "flash and parts"``.

``bench/sweep_sparse_attention_configs.py`` sweeps all launch configurations.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, Shape, bench_device, bench_dtype, one_shape_at_a_time
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import cudnn_dsa, flashmla
from dsv4cp.ops.sparse_attention import SparseAttentionBackend, available_backend, backend_names, resolve_backend

BACKENDS = ["torch", "triton", "triton-deterministic", "cudnn", "flashmla"]
_BEFORE_FWD = {"triton_fwd_logits": "duplicated", "triton_fwd_index_ahead": "0", "triton_fwd_lazy_rescale": "0",
               "triton_fwd_warp_specialize": "0"}
_DEFAULT_FWD = _BEFORE_FWD | {"triton_fwd_logits": "split", "triton_fwd_index_ahead": "1"}
_BEFORE_BWD = {"triton_bwd_dq_pass": "0", "triton_dq_in_dkv": "1", "triton_dkv_one_product": "0",
               "triton_bwd_index_ahead": "0"}
FORWARD_VARIANTS = {
    "triton-duplicated-logits": _BEFORE_FWD,
    "triton-split-logits": _BEFORE_FWD | {"triton_fwd_logits": "split"},
    "triton-slots-on-m": _BEFORE_FWD | {"triton_fwd_logits": "slots_on_m"},
    "triton-index-ahead": _BEFORE_FWD | {"triton_fwd_index_ahead": "1"},
    "triton-split-logits-index-ahead": _BEFORE_FWD | {"triton_fwd_logits": "split", "triton_fwd_index_ahead": "1"},
    # the default (split logits, indices ahead) at other tiles: 32 slots a step with 3 or 4 buffers of rows
    # (prefetched 2 or 3 steps ahead), one stage, and the pipeliner's own index prefetch at 3 stages
    **{f"triton-split-ahead-{tile.replace(',', 'x')}": _BEFORE_FWD | {
        "triton_fwd_logits": "split", "triton_fwd_index_ahead": "1", "triton_fwd_config": tile}
       for tile in ("64,32,8,3", "64,32,8,4", "64,64,8,1")},
    "triton-split-64x64x8x3": _BEFORE_FWD | {"triton_fwd_logits": "split", "triton_fwd_config": "64,64,8,3"},
    "triton-split-ahead-lazy-rescale": _DEFAULT_FWD | {"triton_fwd_lazy_rescale": "1"},
    # the default with its key loop warp-specialized (on the ladder and at two tiles), and four warpgroups
    # (16 warps: [64, 128] of the accumulator each, logits [4, 4]) with and without
    "triton-split-ahead-ws": _DEFAULT_FWD | {"triton_fwd_warp_specialize": "1"},
    **{f"triton-split-ahead-ws-{tile.replace(',', 'x')}": _DEFAULT_FWD | {
        "triton_fwd_warp_specialize": "1", "triton_fwd_config": tile} for tile in ("64,32,8,3", "64,64,16,2")},
    **{f"triton-split-ahead-{tile.replace(',', 'x')}": _DEFAULT_FWD | {"triton_fwd_config": tile}
       for tile in ("64,64,16,2", "64,32,16,3")},
}
BACKWARD_VARIANTS = {
    "triton-dq-in-dkv": _BEFORE_BWD,
    "triton-dkv-one-matmul": _BEFORE_BWD | {"triton_dkv_one_product": "1"},
    "triton-index-ahead": _BEFORE_BWD | {"triton_bwd_index_ahead": "1"},
    "triton-dkv-one-matmul-index-ahead": _BEFORE_BWD | {"triton_dkv_one_product": "1", "triton_bwd_index_ahead": "1"},
    # the one-product dkv kernel small enough for 2 (128 columns, 4 warps, 112 KB) or 3 (64 columns, 64 KB)
    # programs per SM at H = 64, so that one's loads overlap another's products (64,128,4,2: the default
    # since), and the tile it replaced (64,256,8,2)
    **{f"triton-dkv-one-matmul-{tile.replace(',', 'x')}": _BEFORE_BWD | {
        "triton_dkv_one_product": "1", "triton_dkv_config": tile}
       for tile in ("64,128,4,2", "64,64,4,2", "64,256,8,2")},
    "triton-dkv-one-matmul-64x128x4x2-index-ahead": _BEFORE_BWD | {
        "triton_dkv_one_product": "1", "triton_dkv_config": "64,128,4,2", "triton_bwd_index_ahead": "1"},
    # the default before the backward with its own dq pass: dq beside the kv gradients in the dkv kernel
    "triton-dkv-with-dq": {"triton_bwd_dq_pass": "0"},
    # the default with kv-pass programs of four 128-column blocks (each slot step's [ds | p] tile read once
    # for all 512 columns; at H = 64 208 KB of shared memory with triton 3.6; at H = 128 it does not fit: skipped)
    "triton-kv-pass-4-blocks": {"triton_kv_pass_config": "64,128,8,3,4"},
}
"""Benchmarked beside the backends: the triton backend with these kernel options (name -> value) set,
every option of the direction named, so the kernels before the variants (``triton-duplicated-logits``,
``triton-dq-in-dkv``) are timed whatever the defaults are. No name holds ``pro`` or ``torch`` (the
selectors ``-k "not pro"`` / ``"not torch"`` would drop it)."""
LIBRARY_HEAD_DIMS = {flashmla.NAME: flashmla.SUPPORTED_HEAD_DIMS, cudnn_dsa.NAME: cudnn_dsa.SUPPORTED_HEAD_DIMS}


SHAPES = {
    "tiny": Shape("tiny", 8, 4, 32, 8, window=8),
    "flash": Shape("flash", 16384, 64, 512, 512, window=128),
    "pro": Shape("pro", 16384, 128, 512, 1024, window=128),
    "packed": Shape("packed", 16384, 64, 512, 512, window=128),
}
SHAPE_PARAMS = [
    pytest.param("tiny", id="tiny"),
    pytest.param("flash", id="flash", marks=GPU_ONLY),
    pytest.param("pro", id="pro", marks=GPU_ONLY),
]


def _backend(name: str, shape: Shape):
    """The registered backend ``name`` as it is (a one-sided library included), or a skip naming why it
    cannot run here or at ``shape``."""
    if name not in backend_names():
        pytest.skip(f"backend {name!r} is not registered")
    if shape.dim not in LIBRARY_HEAD_DIMS.get(name, (shape.dim,)):
        pytest.skip(f"{name}: head dim {shape.dim} is not in {LIBRARY_HEAD_DIMS[name]}")
    try:
        return available_backend(name, bench_device())
    except ValueError as exc:
        pytest.skip(str(exc))


def _impl(name: str, shape: Shape, variants: dict) -> tuple[SparseAttentionBackend, KernelOptions]:
    """The backend ``name`` and the kernel options it runs with (the environment's, resolved once), or for a
    variant the triton backend with the variant's options over them."""
    if name not in variants:
        return _backend(name, shape), KernelOptions.resolve()
    return _backend("triton", shape), KernelOptions.resolve(variants[name])


@one_shape_at_a_time
def _inputs(shape: Shape):
    """Cached (q, kv, idx, sink, scale, valid_keys) for the shape, plus (out, lse, dout) by the torch
    oracle for the backward benchmarks (made on first request)."""
    device, dtype = bench_device(), bench_dtype()
    g = torch.Generator(device=device).manual_seed(1234)
    t, h, d = shape.tokens, shape.heads, shape.dim
    n = t + shape.n_compressed
    q = torch.randn(t, h, d, device=device, generator=g)
    q = (q * d**0.5 / q.norm(dim=-1, keepdim=True)).to(dtype)  # per-head RMS-normalised, as in the model
    kv = torch.randn(n, d, device=device, generator=g).to(dtype)
    sink = torch.randn(h, device=device, generator=g)
    tok = torch.arange(t, device=device)
    window = tok[:, None] - torch.arange(shape.window, device=device)[None, :]
    window = torch.where(window >= 0, window, torch.full_like(window, -1))
    if shape.name == "packed":
        window, selected = _packed_slots(shape, device, g)
    else:
        scores = torch.rand(t, shape.n_compressed, device=device, generator=g)
        selected = scores.topk(shape.topk, dim=1).indices + t
        del scores
    idx = torch.cat([window, selected], dim=1).to(torch.int32).contiguous()
    valid = int((idx >= 0).sum().item())
    entry = {"args": (q, kv, idx, sink, d**-0.5), "valid": valid}
    return entry


def _packed_slots(shape: Shape, device, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Window and selected slots of packed documents (lengths log-uniform in 64 .. 8192, seeded), as the
    layer builds them: a query at position p of its document has min(p + 1, W) window keys and selects
    min(K, (p + 1) // 4) of its document's visible compressed entries (random ones), ``-1`` after them,
    so short documents leave most slots empty."""
    t = shape.tokens
    draws, lengths = torch.Generator().manual_seed(99), []
    while sum(lengths) < t:
        lengths.append(int(2 ** (6 + 7 * torch.rand((), generator=draws))))
    lengths[-1] -= sum(lengths) - t
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    tok = torch.arange(t, device=device)
    pos = tok - starts[doc]
    j = torch.arange(shape.window, device=device)[None, :]
    window = torch.where(j <= pos[:, None], tok[:, None] - j, -1)
    first_entry = (starts // 4)[doc]  # each document's compressed entries, contiguous after the t token rows
    visible = (pos + 1) // 4
    width = max(int(visible.max()), shape.topk)
    scores = torch.rand(t, width, device=device, generator=g)
    scores = scores.masked_fill(torch.arange(width, device=device)[None, :] >= visible[:, None], -1.0)
    top = scores.topk(shape.topk, dim=1)
    selected = torch.where(top.values >= 0, t + first_entry[:, None] + top.indices, -1)
    return window, selected


def _backward_inputs(shape: Shape, entry: dict):
    if "bwd" not in entry:
        q, kv, idx, sink, scale = entry["args"]
        out, lse = resolve_backend("torch", bench_device()).forward(q, kv, idx, sink, scale, None)
        g = torch.Generator(device=bench_device()).manual_seed(4321)
        dout = torch.randn(out.shape, device=bench_device(), generator=g).to(out.dtype)
        entry["bwd"] = (out, lse, dout)
    return entry["bwd"]


def _flops_forward(shape: Shape, valid: int) -> float:
    return 4.0 * shape.dim * shape.heads * valid


def _bytes(shape: Shape, valid: int, backward: bool) -> float:
    """Forward: q, out, idx, lse and every valid gathered kv row once per query. Backward: q, out, dout,
    dq, idx, lse, delta, the gathered kv rows and their fp32 gradient contributions."""
    el = torch.finfo(bench_dtype()).bits // 8
    thd = shape.tokens * shape.heads * shape.dim * el
    idx_bytes = shape.tokens * shape.kt * 4
    th = shape.tokens * shape.heads * 4
    gathered = valid * shape.dim * el
    if not backward:
        return 2 * thd + idx_bytes + th + gathered
    return 4 * thd + idx_bytes + 2 * th + gathered + valid * shape.dim * 4


def _rounds() -> tuple[int, int]:
    return (5, 2) if HAS_CUDA else (2, 1)


@pytest.mark.parametrize("backend", [*BACKENDS, *FORWARD_VARIANTS])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_sparse_attention_forward(benchmark, measure, shape_name, backend):
    shape = SHAPES[shape_name]
    impl, options = _impl(backend, shape, FORWARD_VARIANTS)
    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    benchmark.group = f"sparse_attention.fwd.{shape.name}"
    benchmark.extra_info.update(backend=backend, shape=shape.name, T=shape.tokens, H=shape.heads,
                                D=shape.dim, Kt=shape.kt, valid_keys=entry["valid"], dtype=str(q.dtype))
    if impl.forward is None:
        pytest.skip(f"{backend}: backward-only backend")
    try:
        impl.forward(q, kv, idx, sink, scale, None, options=options)  # compile / first-call costs outside the timing
    except NotImplementedError as exc:
        pytest.skip(f"{backend}: no forward ({exc})")
    rounds, warmup = _rounds()
    out, lse = measure(lambda: impl.forward(q, kv, idx, sink, scale, None, options=options), None,
                       flops=_flops_forward(shape, entry["valid"]), bytes_moved=_bytes(shape, entry["valid"], False),
                       rounds=rounds, warmup_rounds=warmup, device=q.device)
    assert out.shape == q.shape and lse.shape == q.shape[:2]


@pytest.mark.parametrize("backend", [*BACKENDS, *BACKWARD_VARIANTS])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_sparse_attention_backward(benchmark, measure, shape_name, backend):
    shape = SHAPES[shape_name]
    impl, options = _impl(backend, shape, BACKWARD_VARIANTS)
    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    out, lse, dout = _backward_inputs(shape, entry)
    benchmark.group = f"sparse_attention.bwd.{shape.name}"
    benchmark.extra_info.update(backend=backend, shape=shape.name, T=shape.tokens, H=shape.heads,
                                D=shape.dim, Kt=shape.kt, valid_keys=entry["valid"], dtype=str(q.dtype))

    if impl.backward is None:
        pytest.skip(f"{backend}: forward-only backend")

    def call():
        return impl.backward(dout, q, kv, idx, sink, scale, out, lse, None, options=options)

    try:
        call()
    except NotImplementedError as exc:
        pytest.skip(f"{backend}: no backward ({exc})")
    except Exception as exc:  # a variant's pinned tile over this device's shared memory or registers
        if type(exc).__name__ != "OutOfResources":
            raise
        pytest.skip(f"{backend}: its pinned tile does not fit this device ({str(exc).splitlines()[0]})")
    rounds, warmup = _rounds()
    dq, dkv, dsink = measure(call, None, flops=2.5 * _flops_forward(shape, entry["valid"]),
                             bytes_moved=_bytes(shape, entry["valid"], True), rounds=rounds,
                             warmup_rounds=warmup, device=q.device)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dsink.shape == sink.shape


_BACKWARD_PARTS = [(mode, part) for mode in ("atomic", "one-matmul") for part in ("delta", "scores", "kv-gradients")]
_BACKWARD_PARTS += [("deterministic", part) for part in ("kv-gradients", "destinations", "reduce")]
_PART_PRODUCTS = {"scores": 2, "kv-gradients": 3}
"""Matrix products per valid (query, head, key) of each part (2 D FLOPs each): the scores kernel's logits
and ``dO kv^T``; the dkv kernel's ``ds^T q``, ``p^T dO`` and, with dq accumulated there, ``ds kv``."""


def _part_bytes(shape: Shape, valid: int, part: str) -> float:
    """The part's logical traffic: what it reads and writes once (gathered kv rows once per query)."""
    el = torch.finfo(bench_dtype()).bits // 8
    thd, th = shape.tokens * shape.heads * shape.dim * el, shape.tokens * shape.heads * 4
    scratch = 2 * shape.tokens * shape.kt * shape.heads * el  # p and ds
    gathered, rows = valid * shape.dim * el, valid * shape.dim * 4
    return {"delta": 2 * thd + 3 * th, "scores": 2 * thd + 2 * th + gathered + scratch,
            "kv-gradients": 3 * thd + scratch + gathered + rows, "destinations": shape.tokens * shape.kt * 20,
            "reduce": rows + 2 * (shape.tokens + shape.n_compressed) * shape.dim * 4}[part]


@pytest.mark.parametrize("mode,part", _BACKWARD_PARTS, ids=lambda v: v)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_sparse_attention_backward_parts(benchmark, measure, shape_name, mode, part):
    """Where the triton backward's time goes, each part alone over all of its query chunks
    (:class:`~dsv4cp.kernels.sparse_attention_triton.BackwardPlan`, default kernel options): ``delta``
    (the preprocessing kernel: delta and the sink-gradient partials), ``scores`` (the first kernel: p and
    ds to scratch), ``kv-gradients`` (the dkv kernel: the kv rows' gradients as fp32 atomics, or in
    ``deterministic`` mode as stored contribution rows, and dq), and in deterministic mode
    ``destinations`` (the stable sort of each chunk's slot rows) and ``reduce`` (the per-row sums).
    ``one-matmul``: the dkv kernel's one product (``triton_dkv_one_product=1``). The kv-gradients and
    reduce parts run on the scratch the part before them left (the last chunk's p and ds; every chunk
    does the same work)."""
    shape = SHAPES[shape_name]
    _backend("triton", shape)  # skips where the triton backend cannot run
    from dsv4cp.kernels import sparse_attention_triton as sat

    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    out, lse, dout = _backward_inputs(shape, entry)
    plan = sat.backward_plan(dout, q, kv, idx, sink, scale, out, lse, deterministic=mode == "deterministic",
                             dkv_one_product=mode == "one-matmul")
    starts = list(plan.starts())
    plan.preprocess()
    for t0 in starts:  # every launch compiled, the scratch and the contributions filled once
        plan.scores(t0)
        plan.kv_gradients(t0)
    orders = [plan.destinations(t0) for t0 in starts] if mode == "deterministic" else []
    steps = {"delta": plan.preprocess,
             "scores": lambda: [plan.scores(t0) for t0 in starts],
             "kv-gradients": lambda: [plan.kv_gradients(t0) for t0 in starts],
             "destinations": lambda: [plan.destinations(t0) for t0 in starts],
             "reduce": lambda: [plan.reduce(order) for order in orders]}
    benchmark.group = f"sparse_attention.bwd.parts.{shape.name}"
    benchmark.extra_info.update(backend="triton", mode=mode, part=part, shape=shape.name, T=shape.tokens,
                                H=shape.heads, D=shape.dim, Kt=shape.kt, valid_keys=entry["valid"],
                                chunks=len(starts), chunk_rows=plan.chunk, dtype=str(q.dtype))
    rounds, warmup = _rounds()
    products = _PART_PRODUCTS.get(part, 0)
    measure(steps[part], None, flops=products * 2.0 * shape.dim * shape.heads * entry["valid"],
            bytes_moved=_part_bytes(shape, entry["valid"], part), rounds=rounds, warmup_rounds=warmup,
            device=q.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the libraries need CUDA")
@pytest.mark.parametrize("compact", ["compact", "as-is"])
@pytest.mark.parametrize("library", ["flashmla", "cudnn"])
@pytest.mark.parametrize("shape_name", ["flash", "packed"])
def test_library_slot_compaction(benchmark, measure, shape_name, library, compact):
    """FlashMLA's forward and cuDNN's backward handed each query's valid slots first with their count as
    ``topk_length`` (``compact``, the kernel option ``library_compact_slots=1``) or every slot as it is
    (``as-is``): on one document (``flash``: few empty slots) and on packed documents (``packed``: most
    slots of short documents empty)."""
    shape = SHAPES[shape_name]
    impl = _backend(library, shape)
    options = KernelOptions(library_compact_slots=compact == "compact")
    entry = _inputs(shape)
    q, kv, idx, sink, scale = entry["args"]
    if library == "flashmla":
        def call():
            return impl.forward(q, kv, idx, sink, scale, None, options=options)
        flops = _flops_forward(shape, entry["valid"])
    else:
        out, lse, dout = _backward_inputs(shape, entry)

        def call():
            return impl.backward(dout, q, kv, idx, sink, scale, out, lse, None)
        flops = 2.5 * _flops_forward(shape, entry["valid"])
    call()
    benchmark.group = f"sparse_attention.compaction.{shape.name}.{library}"
    benchmark.extra_info.update(backend=library, compact=compact, shape=shape.name, T=shape.tokens, Kt=shape.kt,
                                valid_keys=entry["valid"], dtype=str(q.dtype))
    rounds, warmup = _rounds()
    measure(call, None, flops=flops, bytes_moved=_bytes(shape, entry["valid"], library == "cudnn"), rounds=rounds,
            warmup_rounds=warmup, device=q.device)
