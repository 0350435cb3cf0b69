"""Indexer-loss target microbenchmarks (DESIGN 1.6, 5): the head-summed attention probabilities of the
scored entries, torch (chunked fp32 gathers, the ``indexer.loss.fwd`` phase's cost before the kernels)
against Triton (:mod:`dsv4cp.kernels.attention_probs_triton`).

Shapes (key buffer N = T + T/4 rows: T raw rows then T/4 compressed rows; ``idx`` per query = K distinct
random compressed rows, as the sparse loss scores the selected entries; the denominator is a random
finite ``[T, H]`` log-normaliser):

* ``flash``: T = 32768, H = 64, D = 512, K = 512 (GPU only; one rank's rows of the flash preset)
* ``tiny``:  T = 8,     H = 4,  D = 32,  K = 16  (CPU and GPU)
* ``pro``:   T = 16384, H = 128, D = 512, K = 512 (GPU only; ``test_head_summed_probs_pro_kernel``)

FLOPs: ``2 D`` per (query, head, valid slot) for the logits (the exp and the head sum not counted).
Bytes: q, idx, the denominator, the output and every valid gathered key row once per query. bf16 on GPU,
fp32 on CPU. ``test_head_summed_probs_config`` times the Triton kernel per launch configuration at the
flash shape (which tile is fastest on the H200); ``test_head_summed_probs_kernel`` times the ``whole_d``
kernel (its default tile) next to every ``d_chunks`` variant of :data:`CHUNK_VARIANTS` at the flash shape
(T = 32768), each checked against the ``whole_d`` result first; ``test_logsumexp_kernel`` does the same
for the log-sum-exp kernels (:data:`LSE_CHUNK_VARIANTS`, same inputs and byte count, no denominator);
``test_head_summed_probs_index_dtype`` times the default ``d_chunks`` launch with int64 and int32 indices.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import GPU_ONLY, HAS_CUDA, Shape, bench_device, bench_dtype, one_shape_at_a_time
from dsv4cp.ops.attention_probs import head_summed_probs_torch

# d_chunks launches (block_h, block_k, block_d, num_warps, num_stages, slots_on_m, programs_per_sm) timed
# side by side with the whole_d kernel; resources on sm_90: python -m bench.compile_attention_probs_sm90.
# Plain tuples: this module must import without triton (the kernel module's ChunkConfig takes them).
CHUNK_VARIANTS = [
    # first round on an H200 (T = 32768; whole_d 4.73 ms): 4.67, 4.86, 4.35, 3.96 (the default since),
    # 5.48, 6.41, 5.31, 5.25, 5.96, 5.13, 5.45, 5.17 ms in this order
    (64, 512, 32, 8, 7, 1, 1),  # every slot of a query in one item: q read once; 4 gathered buffers
    (64, 512, 32, 8, 9, 1, 1),  # the same with 5 buffers
    (64, 512, 64, 8, 5, 1, 1),  # 128-byte row pieces (whole L2 lines), 3 buffers: 226 KB of shared memory
    (64, 512, 64, 16, 5, 1, 1),  # the same over four warpgroups: 128 registers, more warps to hide latency
    (64, 256, 64, 8, 7, 1, 1),  # 128-byte row pieces, 4 buffers, q read twice
    (64, 256, 32, 8, 7, 1, 1),  # q read twice
    (64, 256, 64, 8, 5, 0, 1),  # heads on M: m64n128 per warpgroup, the head sum crosses warps
    (64, 128, 64, 8, 5, 1, 2),  # two programs per multiprocessor
    (64, 128, 64, 8, 5, 1, 0),  # the same, one program per (query, slot block): no persistent loop
    (64, 128, 64, 4, 7, 1, 2),  # one warpgroup, 4 gathered buffers, two programs per multiprocessor
    (64, 128, 64, 4, 7, 0, 2),  # the same with heads on M: one wgmma m64n128 per k-step
    (64, 64, 64, 4, 5, 1, 4),  # small tiles, four programs per multiprocessor
    # second round: the trend of the first (q read once, 128-byte pieces, more warps)
    (64, 512, 64, 16, 4, 1, 1),  # 2 gathered buffers (150 KB)
    (64, 512, 64, 16, 6, 1, 1),  # 3 buffers like num_stages 5, another stage split of index load / gather
    (64, 512, 32, 16, 7, 1, 1),  # 64-byte pieces, 4 buffers, 16 warps (24 bytes of spill)
    (64, 512, 32, 16, 9, 1, 1),  # 5 buffers (88 bytes of spill)
    (64, 512, 64, 32, 5, 1, 1),  # eight warpgroups: 64 registers a thread (80 bytes of spill)
    (64, 256, 64, 16, 7, 1, 1),  # q read twice, but 4 buffers of 128-byte pieces over 16 warps (167 KB)
]
# d_chunks log-sum-exp launches (block_h, block_k, block_d, num_warps, num_stages, programs_per_sm)
LSE_CHUNK_VARIANTS = [
    (64, 256, 64, 16, 7, 1),  # the ladder's first: q read twice per query, 128-byte pieces, 16 warps
    (64, 512, 64, 16, 5, 1),  # q read once (16 bytes of spill)
    (64, 512, 64, 8, 5, 1),
    (64, 256, 32, 8, 7, 1),
    (64, 128, 64, 4, 7, 2),  # 4 gathered buffers, two programs per multiprocessor
    (64, 512, 32, 8, 7, 1),  # every slot in one step: q read once per query
    (64, 64, 64, 4, 5, 2),
]


SHAPES = {
    "tiny": Shape("tiny", 8, 4, 32, 16),
    "flash": Shape("flash", 32768, 64, 512, 512),
    "pro": Shape("pro", 16384, 128, 512, 512),  # the pro preset's 128 heads (its K is 1024; 512 here)
}
SHAPE_PARAMS = [pytest.param("tiny", id="tiny"), pytest.param("flash", id="flash", marks=GPU_ONLY)]


def _triton():
    pytest.importorskip("triton")
    from dsv4cp.kernels import triton_available

    if not triton_available(bench_device()):
        pytest.skip("triton cannot run here (CPU needs TRITON_INTERPRET=1 before triton's import)")
    from dsv4cp.kernels.attention_probs_triton import head_summed_probs_triton

    return head_summed_probs_triton


def _triton_lse():
    _triton()
    from dsv4cp.kernels.attention_probs_triton import logsumexp_over_triton

    return logsumexp_over_triton


@one_shape_at_a_time
def _inputs(shape: Shape):
    """Cached ``(q, keys, idx, scale, log_denominator)`` and the valid-slot count for the shape."""
    device, dtype = bench_device(), bench_dtype()
    g = torch.Generator(device=device).manual_seed(1234)
    t, h, d = shape.tokens, shape.heads, shape.dim
    q = torch.randn(t, h, d, device=device, generator=g)
    q = (q * d**0.5 / q.norm(dim=-1, keepdim=True)).to(dtype)  # per-head RMS-normalised, as in the model
    keys = torch.randn(t + shape.n_compressed, d, device=device, generator=g).to(dtype)
    idx = torch.empty(t, shape.topk, dtype=torch.int64, device=device)
    step = max(1, 2**28 // (4 * shape.n_compressed))  # random scores in blocks of <= 256 MiB
    for s in range(0, t, step):
        e = min(s + step, t)
        scores = torch.rand(e - s, shape.n_compressed, device=device, generator=g)
        idx[s:e] = scores.topk(shape.topk, dim=1).indices + t
    lden = torch.randn(t, h, device=device, generator=g) + 8.0
    entry = {"args": (q, keys, idx, d**-0.5, lden), "valid": int((idx >= 0).sum().item())}
    return entry


def _flops(shape: Shape, valid: int) -> float:
    return 2.0 * shape.dim * shape.heads * valid


def _bytes(shape: Shape, valid: int) -> float:
    el = torch.finfo(bench_dtype()).bits // 8
    t, h, k = shape.tokens, shape.heads, shape.topk
    return t * h * shape.dim * el + t * k * 8 + t * h * 4 + t * k * 4 + valid * shape.dim * el


def _rounds() -> tuple[int, int]:
    return (5, 2) if HAS_CUDA else (2, 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_head_summed_probs(benchmark, measure, shape_name, backend):
    shape = SHAPES[shape_name]
    fn = head_summed_probs_torch if backend == "torch" else _triton()
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    benchmark.group = f"indexer_loss.head_summed_probs.{shape.name}"
    benchmark.extra_info.update(backend=backend, shape=shape.name, T=shape.tokens, H=shape.heads, D=shape.dim,
                                K=shape.topk, valid_slots=entry["valid"], dtype=str(q.dtype))
    fn(q, keys, idx, scale, lden)  # compile / first-call costs outside the timing
    rounds, warmup = _rounds()
    out = measure(lambda: fn(q, keys, idx, scale, lden), None, flops=_flops(shape, entry["valid"]),
                  bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup,
                  device=q.device)
    assert out.shape == idx.shape and out.dtype == torch.float32


_CONFIGS = [(64, 64, 4, 2), (64, 32, 4, 3), (64, 16, 4, 3), (64, 32, 4, 2), (64, 64, 8, 2), (64, 128, 8, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("config", _CONFIGS, ids=lambda c: "bh{}-bk{}-w{}-s{}".format(*c))
def test_head_summed_probs_config(benchmark, measure, config):
    fn = _triton()
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    bh, bk, warps, stages = config
    kw = {"block_h": bh, "block_k": bk, "num_warps": warps, "num_stages": stages, "kernel": "whole_d"}
    benchmark.group = "indexer_loss.head_summed_probs.flash.config"
    benchmark.extra_info.update(backend="triton", shape=shape.name, block_h=bh, block_k=bk, num_warps=warps,
                                num_stages=stages, dtype=str(q.dtype))
    try:
        fn(q, keys, idx, scale, lden, **kw)
    except Exception as exc:  # OutOfResources: this tile does not fit the device
        if type(exc).__name__ != "OutOfResources":
            raise
        pytest.skip(f"{config}: {exc}")
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, lden, **kw), None, flops=_flops(shape, entry["valid"]),
            bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup, device=q.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("slots_on_m", ["0", "1"], ids=["heads-on-m", "slots-on-m"])
def test_head_summed_probs_layout(benchmark, measure, slots_on_m, monkeypatch):
    """The Triton kernel at the flash shape with its default tile, logits as ``q @ keys^T`` (heads on the
    matrix unit's M: the head sum crosses warps; ``DSV4CP_TRITON_PROBS_SLOTS_ON_M=0``) or ``keys @ q^T``
    (slots on M, the default since an H200 measured it 1.22x faster)."""
    from dsv4cp.kernel_options import KernelOptions
    from dsv4cp.kernels.attention_probs_triton import SLOTS_ON_M_ENV

    monkeypatch.setenv(SLOTS_ON_M_ENV, slots_on_m)
    fn = _triton()
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    benchmark.group = "indexer_loss.head_summed_probs.flash.layout"
    benchmark.extra_info.update(backend="triton", shape=shape.name, slots_on_m=slots_on_m == "1", dtype=str(q.dtype))
    on_m = KernelOptions.resolve().triton_probs_slots_on_m
    fn(q, keys, idx, scale, lden, kernel="whole_d", slots_on_m=on_m)
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, lden, kernel="whole_d", slots_on_m=on_m), None,
            flops=_flops(shape, entry["valid"]), bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds,
            warmup_rounds=warmup, device=q.device)


def _kernel_id(variant) -> str:
    return "whole_d" if variant is None else "d_chunks-bh{}-bk{}-bd{}-w{}-s{}-m{}-p{}".format(*variant)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("variant", [None, *CHUNK_VARIANTS], ids=_kernel_id)
def test_head_summed_probs_kernel(benchmark, measure, variant):
    """The ``whole_d`` kernel (default tile) and each ``d_chunks`` variant at the flash shape; a variant
    must match the ``whole_d`` result (relative Frobenius error < 1e-3: same bf16 products, fp32 sums in
    another order) before it is timed."""
    from dsv4cp.kernels.attention_probs_triton import ChunkConfig

    fn = _triton()
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    kw = {"kernel": "whole_d"} if variant is None else {"kernel": "d_chunks", "chunk_config": ChunkConfig(*variant)}
    benchmark.group = "indexer_loss.head_summed_probs.flash.kernel"
    benchmark.extra_info.update(backend="triton", shape=shape.name, kernel=_kernel_id(variant), dtype=str(q.dtype))
    out = fn(q, keys, idx, scale, lden, **kw)
    if variant is not None:
        ref = fn(q, keys, idx, scale, lden, kernel="whole_d").double()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-3, f"{_kernel_id(variant)}: relative error {err:.2e} against whole_d"
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, lden, **kw), None, flops=_flops(shape, entry["valid"]),
            bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup, device=q.device)


def _lse_kernel_id(variant) -> str:
    return "whole_d" if variant is None else "d_chunks-bh{}-bk{}-bd{}-w{}-s{}-p{}".format(*variant)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("variant", [None, *LSE_CHUNK_VARIANTS], ids=_lse_kernel_id)
def test_logsumexp_kernel(benchmark, measure, variant):
    """The ``whole_d`` log-sum-exp kernel (default tile) and each ``d_chunks`` variant at the flash shape;
    a variant must match the ``whole_d`` result (relative Frobenius error < 1e-4) before it is timed."""
    from dsv4cp.kernels.attention_probs_triton import LseChunkConfig

    fn = _triton_lse()
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    q, keys, idx, scale, _ = entry["args"]
    kw = {"kernel": "whole_d"} if variant is None else {"kernel": "d_chunks", "chunk_config": LseChunkConfig(*variant)}
    benchmark.group = "indexer_loss.logsumexp.flash.kernel"
    benchmark.extra_info.update(backend="triton", shape=shape.name, kernel=_lse_kernel_id(variant), dtype=str(q.dtype))
    out = fn(q, keys, idx, scale, **kw)
    if variant is not None:
        ref = fn(q, keys, idx, scale, kernel="whole_d").double()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{_lse_kernel_id(variant)}: relative error {err:.2e} against whole_d"
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, **kw), None, flops=_flops(shape, entry["valid"]),
            bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup, device=q.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=["idx64", "idx32"])
def test_head_summed_probs_index_dtype(benchmark, measure, idx_dtype):
    """The default ``d_chunks`` launch with int64 (what the loss passes) or int32 indices (converted
    before the timing): what re-reading the slot block's indices in every step costs."""
    fn = _triton()
    shape = SHAPES["flash"]
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    idx = idx.to(idx_dtype)
    benchmark.group = "indexer_loss.head_summed_probs.flash.index_dtype"
    benchmark.extra_info.update(backend="triton", shape=shape.name, kernel="d_chunks", idx_dtype=str(idx_dtype))
    fn(q, keys, idx, scale, lden, kernel="d_chunks")
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, lden, kernel="d_chunks"), None, flops=_flops(shape, entry["valid"]),
            bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup, device=q.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU-size shape needs CUDA")
@pytest.mark.parametrize("variant", [None, "ladder", (64, 512, 64, 16, 5, 1, 1)],
                         ids=lambda v: "d_chunks-ladder" if v == "ladder" else _kernel_id(v))
def test_head_summed_probs_pro_kernel(benchmark, measure, variant):
    """128 heads: the ``whole_d`` kernel, the ``d_chunks`` ladder (128 heads a step: rows gathered once)
    and the flash default (64-head blocks: rows gathered once per head block), checked as above."""
    from dsv4cp.kernels.attention_probs_triton import ChunkConfig

    fn = _triton()
    shape = SHAPES["pro"]
    entry = _inputs(shape)
    q, keys, idx, scale, lden = entry["args"]
    if variant is None:
        kw = {"kernel": "whole_d"}
    else:
        kw = {"kernel": "d_chunks", "chunk_config": None if variant == "ladder" else ChunkConfig(*variant)}
    benchmark.group = "indexer_loss.head_summed_probs.pro.kernel"
    benchmark.extra_info.update(backend="triton", shape=shape.name, kernel=str(variant), dtype=str(q.dtype))
    out = fn(q, keys, idx, scale, lden, **kw)
    if variant is not None:
        ref = fn(q, keys, idx, scale, lden, kernel="whole_d").double()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-3, f"{variant}: relative error {err:.2e} against whole_d"
    rounds, warmup = _rounds()
    measure(lambda: fn(q, keys, idx, scale, lden, **kw), None, flops=_flops(shape, entry["valid"]),
            bytes_moved=_bytes(shape, entry["valid"]), rounds=rounds, warmup_rounds=warmup, device=q.device)
