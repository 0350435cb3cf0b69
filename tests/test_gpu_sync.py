"""No host synchronisation in a training step of the layer.

A read of device data by the host stalls the CPU until the device has caught up (behind the index-key
all-gather, on every C-layer forward) and makes CUDA-graph capture fail.

CPU (always run): :class:`host_reads.HostReads` records every host read of tensor data during one
forward + backward of W, C (both indexer-loss variants, with and without recompute) and H layers on
the torch backend at CP = 1, and of C and H layers over 2 gloo ranks: there must be none except in
:data:`CPU_ONLY_READS`, checks that read only CPU tensors (on CUDA they are asynchronous device
assertions). The layer's CPU path read nothing before this change either; the Triton top-k planning
that did (CUDA only) is tested under the interpreter in ``tests/kernels/test_indexer_static_plan.py``.

GPU (marked ``gpu``, skipped without CUDA):

* one forward + backward of a C layer under ``torch.cuda.set_sync_debug_mode("error")`` raises
  nothing: CP = 1 on one GPU, and CP = 2 on two NCCL ranks spawned by the test (needs 2 GPUs);
* one training step of a CP = 1 C layer (bf16, flash-like widths, backend auto, deterministic
  kernels) captured in a CUDA graph and replayed gives outputs and gradients bitwise identical to
  eager, also after new inputs and a new packing of the same sizes are copied into the captured
  tensors (the top-k chunk plan depends on sizes only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import TINY_C, cfg_for, make_layer, packed
from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn
from dsv4cp.harness.build import randomize_
from dsv4cp.kernels import set_deterministic
from host_reads import HostReads

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# (ratio, indexer-loss variant, recompute): W, C sparse, C dense, C with recompute, H
CPU_LAYERS = [(0, "sparse", False), (4, "sparse", False), (4, "dense", False), (4, "sparse", True),
              (8, "sparse", False)]
LENGTHS, TOTAL = (13, 22, 9, 0, 5), 60  # several documents, an empty one and tail padding

CPU_ONLY_READS = (("dsv4cp/ops/sparse_attention.py", "_require"),)
"""``(file, function)`` of the reads excused on CPU: the sparse-attention op's index check, a host check
for CPU tensors and ``torch._assert_async`` (no synchronisation) for CUDA ones."""


# ------------------------------------------------------------------------------------------ CPU
def _step(layer: DSv4Attention, x: torch.Tensor, pk: PackedSeqs, weight: torch.Tensor, group=None) -> None:
    res = layer(x, pk, cp_group=group)
    loss = (res.out * weight).sum()
    if res.indexer_loss is not None:
        loss = loss + res.indexer_loss
    loss.backward()


def _layer_and_inputs(ratio: int, loss: str, recompute: bool, seed: int):
    cfg = cfg_for(ratio, TINY_C, indexer_loss=loss)
    layer = make_layer(cfg, ratio, seed, torch.float32)
    layer.recompute = recompute
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOTAL, cfg.hidden, generator=gen)
    weight = torch.randn(TOTAL, cfg.hidden, generator=gen)
    return layer, x, weight


def test_host_reads_records_every_kind_of_read():
    """The recorder is not blind: each kind of read it must catch is caught."""
    t = torch.arange(6.0)
    mask = t > 2
    reads = [lambda: t[0].item(), lambda: float(t[1]), lambda: bool(t[1]), lambda: t.tolist(), lambda: t.numpy(),
             lambda: t[mask], lambda: mask.nonzero(), lambda: torch.unique(t), lambda: t.repeat_interleave(mask.long())]
    for i, read in enumerate(reads):
        with HostReads() as rec:
            read()
        assert rec.events, f"read {i} went unseen"
    with HostReads() as rec:  # device-side work: nothing
        torch.searchsorted(torch.where(mask, t, 0).cumsum(0), t).max()
    assert not rec.events, rec.report()


@pytest.mark.parametrize("ratio,loss,recompute", CPU_LAYERS)
def test_layer_step_reads_no_tensor_data_on_the_host(ratio, loss, recompute, seed):
    layer, x, weight = _layer_and_inputs(ratio, loss, recompute, seed)
    pk = packed(LENGTHS, tail=TOTAL - sum(LENGTHS))
    x.requires_grad_(True)
    with HostReads() as rec:
        _step(layer, x, pk, weight)
    assert x.grad is not None and x.grad.abs().sum() > 0
    unexpected = rec.outside(*CPU_ONLY_READS)
    assert not unexpected, f"host reads during a {ratio=} {loss=} {recompute=} step:\n{rec.report(unexpected)}"


CP2_LAYERS = [(4, "sparse", False), (8, "sparse", False)]
"""The layers with gathers (C with its index keys and top-k, H); one spawn of 2 ranks for both."""


def _cp_host_reads(rank: int, world: int, device: torch.device, seed: int) -> list[str]:
    """The CP2_LAYERS cases on this rank's rows; the host reads seen (``what: where``)."""
    seen = []
    for ratio, loss, recompute in CP2_LAYERS:
        layer, x, weight = _layer_and_inputs(ratio, loss, recompute, seed)
        pk = packed(LENGTHS, tail=TOTAL - sum(LENGTHS))
        rows = slice(rank * TOTAL // world, (rank + 1) * TOTAL // world)
        x_local = x[rows].clone().requires_grad_(True)
        with HostReads() as rec:
            _step(layer, x_local, pk, weight[rows], dist.group.WORLD)
        seen += [f"{ratio=} {loss=} {recompute=} {r.what}: {r.where}" for r in rec.outside(*CPU_ONLY_READS)]
    return seen


def test_cp2_layer_step_reads_no_tensor_data_on_the_host(seed):
    for rank, seen in enumerate(spawn(_cp_host_reads, 2, seed)):
        assert not seen, f"rank {rank}:\n" + "\n".join(seen)


# ------------------------------------------------------------------------------------------ GPU
def _gpu_c_layer(seed: int, device: torch.device, cfg: DSv4Config, backend: str = "auto") -> DSv4Attention:
    layer = DSv4Attention(cfg, 4, backend=backend)
    randomize_(layer, torch.Generator().manual_seed(seed))
    return layer.to(device=device, dtype=torch.bfloat16)


def _gpu_inputs(seed: int, total: int, hidden: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(total, hidden, generator=gen).to(device, torch.bfloat16)
    weight = torch.randn(total, hidden, generator=gen).to(device, torch.bfloat16)
    return x, weight


GPU_CFG = DSv4Config.preset("flash", index_topk=128)
"""Flash widths; a top-k below the entries the later queries see (so the selection is real)."""
GPU_LENGTHS, GPU_TOTAL = (1500, 2000, 596), 4096


def _sync_free_step(rank: int, world: int, device: torch.device, seed: int) -> None:
    """Warm up (Triton compiles and picks its tiles), then one step with synchronisation as an error."""
    layer = _gpu_c_layer(seed, device, GPU_CFG)
    pk = PackedSeqs.from_lengths(GPU_LENGTHS, total=GPU_TOTAL, device=device)
    x, weight = _gpu_inputs(seed, GPU_TOTAL, GPU_CFG.hidden, device)
    rows = slice(rank * GPU_TOTAL // world, (rank + 1) * GPU_TOTAL // world)
    group = dist.group.WORLD if world > 1 else None
    x_local, w_local = x[rows].clone().requires_grad_(True), weight[rows].float()
    _step(layer, x_local, pk, w_local, group)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(layer, x_local, pk, w_local, group)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)


@pytest.mark.gpu
@needs_cuda
def test_cp1_c_layer_step_never_synchronises(seed):
    _sync_free_step(0, 1, torch.device("cuda", torch.cuda.current_device()), seed)


@pytest.mark.gpu
@needs_two_gpus
def test_cp2_c_layer_step_never_synchronises(seed):
    spawn(_sync_free_step, 2, seed, backend="nccl")


def _graph_step(layer: DSv4Attention, x: torch.Tensor, pk: PackedSeqs, weight: torch.Tensor):
    """One training step: outputs and the gradients of x and every parameter (fresh tensors)."""
    params = [p for _, p in sorted(layer.named_parameters())]
    res = layer(x, pk)
    loss = (res.out.float() * weight).sum() + res.indexer_loss
    grads = torch.autograd.grad(loss, [x, *params])
    return (res.out, res.indexer_loss, *grads)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_of_a_training_step_replays_eager_results(seed):
    device = torch.device("cuda", torch.cuda.current_device())
    set_deterministic(True)  # atomics would make eager and replay differ in the last bits
    try:
        layer = _gpu_c_layer(seed, device, GPU_CFG)
        x, weight = _gpu_inputs(seed, GPU_TOTAL, GPU_CFG.hidden, device)
        x.requires_grad_(True)
        weight = weight.float()
        pk = PackedSeqs.from_lengths(GPU_LENGTHS, total=GPU_TOTAL, device=device)

        side = torch.cuda.Stream(device)  # warm-up on a side stream, as torch.cuda.graph requires
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                _graph_step(layer, x, pk, weight)
        torch.cuda.current_stream(device).wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _graph_step(layer, x, pk, weight)

        # Same sizes, new values: inputs, and documents in another order (same count, total, real
        # tokens and longest document, the host-side facts the layer reads) copied into the captured tensors.
        gen = torch.Generator().manual_seed(seed + 7)
        reordered = PackedSeqs.from_lengths(GPU_LENGTHS[::-1], total=GPU_TOTAL, device=device)
        for new_x, new_pk in ((x.detach().clone(), pk), (torch.randn(x.shape, generator=gen), reordered)):
            with torch.no_grad():
                x.copy_(new_x)
                pk.cu_seqlens.copy_(new_pk.cu_seqlens)
                pk.cu_seqlens_padded.copy_(new_pk.cu_seqlens_padded)
            graph.replay()
            replayed = [t.clone() for t in captured]
            eager, again = _graph_step(layer, x, new_pk, weight), _graph_step(layer, x, new_pk, weight)
            names = ["out", "indexer_loss", "x", *(n for n, _ in sorted(layer.named_parameters()))]
            for name, got, want, want2 in zip(names, replayed, eager, again):
                _assert_replays_eager(name, got, want, want2)
    finally:
        set_deterministic(False)


def _assert_replays_eager(name: str, got: torch.Tensor, want: torch.Tensor, want2: torch.Tensor) -> None:
    """Bitwise equal to eager where two eager runs are bitwise equal (every kernel deterministic);
    otherwise (a library kernel reducing in a run-dependent order) within twice their spread."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    spread = (want.double() - want2.double()).abs().max().item()
    if spread == 0:
        assert torch.equal(got, want), f"{name}: the graph replay differs from eager (which is reproducible)"
    else:
        err = (got.double() - want.double()).abs().max().item()
        assert err <= 2 * spread, f"{name}: replay error {err:.3e} beyond twice eager's spread {spread:.3e}"
