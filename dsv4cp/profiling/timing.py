"""Timing protocol of docs/design.md §5: warm up, barrier before each repetition, max over ranks.

``benchmark(fn)`` runs ``fn`` ``warmup`` times untimed, then ``reps`` timed repetitions. Before each
repetition every rank of the group meets at a barrier (so all ranks start together) and, when asked,
the L2 cache is flushed by zeroing a 256 MiB buffer. On GPU a repetition is timed by CUDA events on
the current stream; on CPU by ``time.perf_counter``. The per-repetition times of all ranks are
combined ONCE at the end by an all-reduce MAX (the step of a CP layer lasts as long as its slowest
rank), so the summary statistics describe the slowest rank of each repetition.

Never time with a profiler attached: ``benchmark`` refuses to run while torch.profiler records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 * 2**20
"""Size of the buffer zeroed between repetitions to evict the L2 cache (H200 L2: 60 MiB)."""


@dataclass(frozen=True)
class TimingResult:
    """Summary of the timed repetitions, in milliseconds; each time is the max over ranks."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    max_ms: float
    reps: int
    times_ms: list[float]
    """Per-repetition times (max over ranks), in the order they ran."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to synchronise over; None when running without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group: a process group was given but torch.distributed is not initialised")
        return None
    return group if group is not None else dist.group.WORLD


def _barrier(group: dist.ProcessGroup, device: torch.device) -> None:
    if dist.get_backend(group) == "nccl":
        # without device_ids NCCL guesses the device from the rank, which is wrong off rank-per-GPU layouts
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def graph_replay(
    fn: Callable[[], object], warmup: int, on_step: Callable[[str], object] | None = None,
) -> Callable[[], object]:
    """Capture ``fn`` into a CUDA graph on the current CUDA device and return its replay.

    ``fn`` first runs ``max(warmup, 1)`` times eagerly on a side stream (torch's capture rule: lazy
    initialisation, autotuning and allocator warm-up must not happen inside the capture), calling
    ``on_step("warmup")`` after each. The graph keeps its memory pool while the returned callable
    lives: drop it (and empty the allocator cache) before measuring memory. Each replay does the
    captured work on the captured tensors: inputs change by copying into them, and gradients
    accumulate into the ``.grad`` tensors that existed at capture, as in eager steps.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):  # capture needs one eager run for lazy initialisation
            fn()
            if on_step is not None:
                on_step("warmup")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def benchmark(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    reps: int = 20,
    group: dist.ProcessGroup | None = None,
    l2_flush: bool = False,
    device: torch.device | str | None = None,
    cuda_graph: bool = False,
    on_step: Callable[[str], object] | None = None,
) -> TimingResult:
    """Time ``fn()`` following docs/design.md §5 and return the max-over-ranks summary.

    Args:
        fn: the region to time; called with no arguments.
        warmup: untimed calls before timing (>= 0).
        reps: timed repetitions (>= 1).
        group: process group for barriers and the max; default: the world group when
            torch.distributed is initialised, otherwise none (single process).
        l2_flush: zero a 256 MiB buffer before each repetition (GPU only; ignored on CPU, whose
            caches are not what the suite measures).
        device: where ``fn`` runs; default: the current CUDA device, else CPU.
        cuda_graph: capture ``fn`` once into a CUDA graph (after ``warmup`` eager calls,
            :func:`graph_replay`) and time its replays, after ``warmup`` untimed ones (GPU only).
        on_step: called after each step with ``"warmup"`` or ``"timed"`` (e.g. a progress bar,
            :mod:`dsv4cp.profiling.progress`); outside the timed region.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    device = _resolve_device(device)
    on_gpu = device.type == "cuda"
    if cuda_graph and not on_gpu:
        raise ValueError(f"cuda_graph=True needs a CUDA device, got device={device}")
    if torch.autograd._profiler_enabled():
        raise RuntimeError("benchmark() must not run while torch.profiler records (docs/design.md §5)")
    group = _resolve_group(group)

    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        run = graph_replay(fn, warmup) if cuda_graph else fn
        for _ in range(warmup):
            run()
            if on_step is not None:
                on_step("warmup")
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if (l2_flush and on_gpu) else None
        times = _timed_reps(run, reps, group, device, flush, on_step)

    if group is not None:
        # one collective for all repetitions: per-rep barriers already align the ranks
        reduce_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        vector = torch.tensor(times, dtype=torch.float64, device=reduce_device)
        dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
        times = vector.cpu().tolist()
    return summarise(times)


def _timed_reps(
    run: Callable[[], object],
    reps: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    flush: torch.Tensor | None,
    on_step: Callable[[str], object] | None = None,
) -> list[float]:
    """Per-repetition times of this rank, in milliseconds."""
    times: list[float] = []
    on_gpu = device.type == "cuda"
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        if on_gpu:
            torch.cuda.synchronize(device)  # the flush and earlier work must not leak into the region
        if group is not None:
            _barrier(group, device)
        times.append(time_call(run, device)[1])
        if on_step is not None:
            on_step("timed")
    return times


def time_call(fn: Callable[[], object], device: torch.device | str) -> tuple[object, float]:
    """Run ``fn()`` once and return its result and its time in milliseconds: CUDA events on the current
    stream (waited for) on GPU, ``time.perf_counter`` on CPU. Synchronise before calling it when earlier
    work must not count."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    t0 = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - t0) * 1e3


def summarise(times: list[float]) -> TimingResult:
    """Median, p20, p80 (linear interpolation), min and max of per-repetition ``times`` (ms, at least one)."""
    if not times:
        raise ValueError("times: at least one repetition is needed, got none")
    values = np.asarray(times, dtype=np.float64)
    p20, median, p80 = np.percentile(values, [20.0, 50.0, 80.0])
    return TimingResult(
        median_ms=float(median),
        p20_ms=float(p20),
        p80_ms=float(p80),
        min_ms=float(values.min()),
        max_ms=float(values.max()),
        reps=len(times),
        times_ms=[float(t) for t in values],
    )
