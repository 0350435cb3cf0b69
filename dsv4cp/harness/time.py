"""Timed pass: the layer step of a Case timed, then measured apart (docs/design.md §5).

:func:`time_case` is called by every rank of the Case's CP group (or by one process without
torch.distributed for CP = 1), with the Case's deterministic mode in force (its kernel options travel in
the Case: the layer holds them, the model's bound is priced under them). It builds
the Case's seeded step (:func:`dsv4cp.harness.build.build_step`: the layer and this rank's rows), times
it with :func:`dsv4cp.profiling.timing.benchmark`, measures one more step's peak memory, computes the
model's FLOPs and bound, and optionally records a Kineto trace and its tables (:mod:`.trace`), runs
steps inside an nsys capture range, and checks parity of the same Case against the fp64 reference layer
(:mod:`dsv4cp.harness.parity`). Timing, tracing and nsys are separate passes: no profiler is attached
while timing.

``cuda_graph`` times replays of the step captured once in a CUDA graph: the kernels' time without Python
and launch overhead. Only the timing changes: the peak memory, memory phases, traces and nsys steps are
eager steps, measured after the graph (and its memory pool) is released.

The steps run on the Case's one batch, whose layout the layer builds once and then reuses: the step of a
layer of a deep model. With ``fresh_batches`` N >= 2 every step (warm-up, timed, memory, traced, nsys)
runs on the next of N batches built before timing and builds its layout again: the step of a one-layer
model fed a new batch every step (:mod:`dsv4cp.harness.fresh_batches`). The N batches stay allocated
throughout, so the peak memory counts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dsv4cp import kernel_options
from dsv4cp.cp.emulate import emulated_rank
from dsv4cp.environment import deterministic_algorithms
from dsv4cp.harness.build import build_step
from dsv4cp.harness.case import Case
from dsv4cp.harness.compile import compile_step
from dsv4cp.harness.fresh_batches import fresh_batches
from dsv4cp.harness.parity import merge_ranks, run_rank
from dsv4cp.harness.trace import TraceTables, trace_step
from dsv4cp.layer import AttentionOutput
from dsv4cp.model import Machine, estimate
from dsv4cp.model.machine import CPU_ESTIMATE, physical_limits
from dsv4cp.ops.sparse_attention import resolve_backend
from dsv4cp.profiling.memory import record_phase_memory, track_memory
from dsv4cp.profiling.memory_snapshot import check_snapshot_device, record_memory_snapshot, snapshot_name
from dsv4cp.profiling.nvtx import capture_range, nvtx_range
from dsv4cp.profiling.timing import benchmark, graph_replay


@dataclass(frozen=True)
class Measurement:
    """What :func:`time_case` returns on every rank (complete on the group's rank 0)."""

    metrics: dict
    """``dsv4cp.records.METRICS`` name -> value."""
    resolved_backends: dict
    """Which kernels ``kernel_backend`` resolved to on this device, e.g. ``{"sparse_attention": "triton"}``."""
    overlap: pd.DataFrame | None = None
    """The per-phase overlap table (per step) when traced, on the group's rank 0."""
    attribution: pd.DataFrame | None = None
    """Per rank, the step's unattributed and idle time (per step) when traced, on the group's rank 0."""
    kernel_options: dict = field(default_factory=dict)
    """Every kernel option's value as the point ran (:func:`dsv4cp.kernel_options.resolved`)."""
    backends: dict = field(default_factory=dict)
    """What ran per op and direction in the warm-up and timed steps, and the launches' tile configs
    (:func:`dsv4cp.kernel_options.backends_ran`; on this rank)."""


_GRADIENTS_NAMED = 3
"""Non-finite gradients named in the message; the rest are counted."""


class NonFiniteResult(RuntimeError):
    """A measured step's output, indexer loss or gradients hold NaN or infinity: its timing measured a
    broken computation. Raised on every rank of the group at once (no rank is left in a collective)."""


def nonfinite_parts(result: AttentionOutput, x: torch.Tensor, layer: torch.nn.Module) -> list[str]:
    """What of one step's results is not finite: ``"output"``, ``"indexer loss"``, ``"gradients of
    x, wq_a.weight, ..."`` (``x``'s and the parameters' accumulated ``.grad``); empty when all are.
    One host read after the device-side checks; called after timing, never inside the timed loop."""
    named = [("output", result.out), ("indexer loss", result.indexer_loss), ("x", x.grad)]
    named += [(name, prm.grad) for name, prm in layer.named_parameters()]
    named = [(name, t) for name, t in named if t is not None]
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).tolist()
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    results = [name for name in bad if name in ("output", "indexer loss")]
    grads = [name for name in bad if name not in results]
    if len(grads) > _GRADIENTS_NAMED:
        grads = grads[:_GRADIENTS_NAMED] + [f"{len(grads) - _GRADIENTS_NAMED} more"]
    return results + ([f"gradients of {', '.join(grads)}"] if grads else [])


class _RankClock:
    """Wraps a step and times every call on this rank alone (CUDA events, else ``perf_counter``):
    ``benchmark`` keeps only the max over ranks, the imbalance needs each rank's own times. For a
    CUDA-graph point it wraps the graph's replay, so its events are recorded outside the capture."""

    def __init__(self, step, device: torch.device):
        self.step, self.on_gpu = step, device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds: list[float] = []

    def __call__(self) -> None:
        if self.on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.step()
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            self.step()
            self.seconds.append(time.perf_counter() - t0)

    def last_ms(self, count: int) -> list[float]:
        """Times of the last ``count`` calls, in milliseconds."""
        if self.on_gpu:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.events[-count:]]
        return [s * 1e3 for s in self.seconds[-count:]]


class TimingSettings(Protocol):
    """How many steps each part of the pass runs (a sweep's ``run`` options,
    :class:`dsv4cp.sweeps.spec.RunOptions`)."""

    warmup: int
    reps: int
    l2_flush: bool
    nsys_steps: int
    trace_steps: int


def _gather(value, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``value``, rank-major; an emulated rank knows only its own (None elsewhere)."""
    if group is None:
        return [value]
    if emulated_rank(group) is not None:
        out = [None] * group.size()
        out[group.rank()] = value
        return out
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def time_case(
    case: Case, group: dist.ProcessGroup | None, device: torch.device, run: TimingSettings, *,
    machine: Machine | None, calibration_label: str | None = None,
    trace_dir: str | Path | None = None, nsys: bool = False, check: bool = False,
    on_step: Callable[[str], object] | None = None, memory_phases: bool = False, memory_snapshot: bool = False,
    trace_point: Mapping | None = None,
) -> Measurement:
    """Time ``case`` on this rank of ``group`` (the Case's CP group; None: one process), then measure it
    apart (module docstring).

    ``machine``: the ceilings of the model bound and MFU (None: no bound: ``bound_ms``,
    ``measured_over_bound``, ``bound_measured_ms``, ``measured_over_measured_bound`` and ``bound_machine``
    stay None; ``bound_ms`` is at the machine's physical limits, :func:`~dsv4cp.model.machine.physical_limits`,
    ``bound_measured_ms`` at its own ceilings); MFU is left None off GPU, where that ceiling
    means nothing. ``calibration_label``: the phase factors the split was computed with (metric
    ``calibration``). The Case's ``cuda_graph``: time graph replays (the step runs ``run.warmup`` times
    eagerly, at least once, is captured once, then ``run.warmup`` untimed and ``run.reps`` timed replays
    follow; gradients accumulate across replays as across eager steps). Its ``fresh_batches``: N >= 2
    batches, every step on the next one (module docstring). ``trace_dir``: write a Kineto trace per rank
    under it and fill the overlap metrics (:mod:`.trace`; with ``trace_point``, the point's axes, beside
    it: a calibration from the trace checks it). ``nsys``: also run ``run.nsys_steps`` steps inside
    ``cudaProfilerStart/Stop``. ``check``: compare the Case with the fp64 reference layer (metric
    ``parity``). ``on_step``: called after each warm-up and timed step. ``memory_phases``: one more step
    recording each phase's memory.
    ``memory_snapshot``: one more step recording the CUDA allocator's history, dumped beside the traces
    (``trace_dir/memory_snapshot_rank<r>.pickle``); CUDA only.

    Raises ``ValueError`` before any work for a memory snapshot it cannot take, :class:`NonFiniteResult`
    on every rank when the peak-memory step's output, indexer loss or gradients are not finite on any rank
    (checked once, after timing), and whatever the step raises (``torch.OutOfMemoryError``, ...).
    """
    if memory_snapshot:
        check_snapshot_device(device)
        if trace_dir is None:
            raise ValueError("memory_snapshot: the snapshot is written beside the traces: give a trace_dir")
    with deterministic_algorithms(case.deterministic):  # the kernel options travel in the Case, as arguments
        return _time(case, group, device, run, machine=machine, calibration_label=calibration_label,
                     trace_dir=trace_dir, nsys=nsys, check=check, on_step=on_step, memory_phases=memory_phases,
                     memory_snapshot=memory_snapshot, trace_point=trace_point)


def _time(
    case: Case, group: dist.ProcessGroup | None, device: torch.device, run: TimingSettings, *,
    machine: Machine | None, calibration_label: str | None,
    trace_dir: str | Path | None, nsys: bool, check: bool, on_step: Callable[[str], object] | None,
    memory_phases: bool, memory_snapshot: bool, trace_point: Mapping | None,
) -> Measurement:
    """:func:`time_case` with the Case's deterministic mode in force."""
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    emulated = emulated_rank(group)
    cfg, packed, split = case.cfg, case.packed(), case.row_split(cp)
    # the model FLOPs do not depend on the ceilings: without a machine any one gives them, its bound unused
    options = case.kernel_options
    bound = estimate(cfg, case.ratio, packed, cp, machine or CPU_ESTIMATE, split=split,
                     kernel_options=options).summary(case.direction)
    physical = None if machine is None else estimate(cfg, case.ratio, packed, cp, physical_limits(machine),
                                                     split=split, kernel_options=options).summary(case.direction)
    resolved = {"sparse_attention": resolve_backend(case.backend, device, head_dim=cfg.head_dim).name}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # device_used_bytes must not count blocks cached for an earlier point

    step = build_step(case, cp_group=group, device=device)
    compiled = compile_step(step, case.compile, device) if case.compile is not None else None
    batches = fresh_batches(step, case.fresh_batches, case.seed) if case.fresh_batches else None
    run_step = batches if batches is not None else step  # what every step below runs

    kernel_options.reset_backends_ran()  # what ran in the warm-up and timed steps, nothing from before
    timed = run_step
    if case.cuda_graph:
        with torch.cuda.device(device):
            timed = graph_replay(step, run.warmup, on_step=on_step)  # the eager warm-up steps, then the capture
    clock = _RankClock(timed, device)
    timing = benchmark(clock, warmup=run.warmup, reps=run.reps, group=group, l2_flush=run.l2_flush, device=device,
                       on_step=on_step)
    backends = kernel_options.backends_ran()
    rank_median = float(np.median(clock.last_ms(run.reps)))
    if case.cuda_graph:
        del clock, timed  # the last references to the graph: its memory pool is released ...
        torch.cuda.empty_cache()  # ... and handed back, so the eager steps below measure their own memory
    with track_memory(device) as tracker:
        result = run_step()
    sample = tracker.result
    peak = sample.peak_allocated_bytes if device.type == "cuda" else sample.host_peak_rss_bytes
    ran = batches.last if batches is not None else step  # the batch whose gradients the check reads
    per_rank = _gather((rank_median, peak, sample.device_used_bytes, nonfinite_parts(result, ran.x, ran.layer)),
                       group)
    del result
    _raise_if_nonfinite([r[3] if r is not None else [] for r in per_rank])

    seconds = timing.median_ms / 1e3
    tflops = bound.model_tflops_per_gpu(seconds)
    medians = [r[0] for r in per_rank if r is not None]
    per_rank = [r or (None, None, None, None) for r in per_rank]  # an emulated rank: its peers unmeasured
    metrics = {
        "time_ms_median": timing.median_ms, "time_ms_p20": timing.p20_ms, "time_ms_p80": timing.p80_ms,
        "time_ms_samples": timing.times_ms,
        "rank_time_ms_median": [r[0] for r in per_rank],
        "imbalance_max_over_mean": max(medians) / (sum(medians) / len(medians)) if emulated is None else None,
        "tokens_per_s": case.rows() / seconds, "tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / machine.peak_flops if device.type == "cuda" and machine is not None else None,
        "split": list(split.bounds),
        "calibration": calibration_label,
        "model_flops": bound.model_flops, "bound_machine": None if machine is None else machine.name,
        "bound_ms": None if physical is None else physical.bound_overlap_s * 1e3,
        "measured_over_bound": _over(seconds, physical),
        "bound_measured_ms": None if machine is None else bound.bound_overlap_s * 1e3,
        "measured_over_measured_bound": _over(seconds, bound if machine is not None else None),
        "peak_allocated_bytes": [r[1] for r in per_rank], "device_used_bytes": [r[2] for r in per_rank],
        "compile_s": compiled.seconds if compiled else None,
        "graph_breaks": compiled.graph_breaks if compiled else None,
    }

    if memory_phases:  # a step of its own: the recorder resets the allocator peak at every phase edge
        with record_phase_memory(device) as recorder:
            run_step()
        mine = None if recorder is None else {
            "rows": [row.to_dict() for row in recorder.rows], "peak_bytes": recorder.step_peak_bytes,
            "peak_stack": list(recorder.peak_stack)}
        metrics["memory_phases"] = _gather(mine, group)

    if memory_snapshot:  # a step of its own: recording every allocation's stack slows the step
        with record_memory_snapshot(Path(trace_dir) / snapshot_name(rank), device):
            run_step()

    if nsys:
        with capture_range():
            for _ in range(run.nsys_steps):
                with nvtx_range("step"):
                    run_step()

    traced = TraceTables()
    if trace_dir is not None:
        traced = trace_step(run_step, trace_dir, steps=run.trace_steps, group=group, trace_point=trace_point)
        metrics.update(traced.metrics)

    if check:  # the timed Case itself: its weights, its inputs, its kernels
        mine = run_rank(rank, cp, device, case, group)
        metrics["parity"] = [asdict(c) for c in merge_ranks(_gather(mine, group))]
    return Measurement(metrics, resolved, traced.overlap, traced.attribution,
                       kernel_options=case.kernel_options.texts(), backends=backends)


def _raise_if_nonfinite(per_rank: list[list[str]]) -> None:
    """:class:`NonFiniteResult` naming the first rank's non-finite parts (and which ranks had any)."""
    ranks = [rank for rank, parts in enumerate(per_rank) if parts]
    if ranks:
        where = f"rank {ranks[0]}" + (f" (and ranks {', '.join(map(str, ranks[1:]))})" if ranks[1:] else "")
        raise NonFiniteResult(f"non-finite {', '.join(per_rank[ranks[0]])} on {where}")


def _over(seconds: float, bound) -> float | None:
    """A measured time over a bound's (a :class:`~dsv4cp.model.DirectionSummary`'s), None without one."""
    return seconds / bound.bound_overlap_s if bound is not None and bound.bound_overlap_s > 0 else None
