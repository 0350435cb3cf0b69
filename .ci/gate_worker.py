"""One side of the CI gate's A/B comparison: a long-lived process that builds every case of a sweep spec
once, then times single steps on request (``.ci/gate.py`` starts one per side and alternates them).

Run with ``PYTHONPATH`` set to the tree whose ``dsv4cp`` it measures (the base commit's worktree, or the
head); it uses only interfaces both have. The protocol, one JSON object a line: the worker first writes
``{"cases": [...]}`` (per case: its label, counters, CPU ms of a step and of its sparse_attn phase, and
the share of the step that ``inject_slowdown`` at fraction 1 adds, measured with
``--calibrate-injection``, else None), then
answers each ``{"time": I, "inject": FRACTION|null, "repeat": N}`` with ``{"ms": [CPU_MS, ...]}`` (N steps
run back to back; ``repeat`` defaults to 1) and ends on ``{"quit": true}``.
Anything the library prints goes to stderr.

A case is the point's step as the sweep builds it (:func:`dsv4cp.sweeps.measure.point_step`), on one
intra-op thread; a CP = 2 point runs as its emulated rank 0 (a fake process group: its collectives move
nothing), so its time is that rank's compute, without communication. A time is the step's process CPU
time, not wall time: another job taking the core does not count (a wait does not either).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path


def _tensor_bytes(value: object) -> int:
    """The largest tensor among ``value`` (a tensor or nested lists of them), in bytes."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return max((_tensor_bytes(item) for item in value), default=0)
    return 0


def _count_step(step) -> dict[str, int]:
    """What one step dispatches: aten ops (the kernels it launches), host syncs (reads of a tensor's
    value: ``_local_scalar_dense``), collectives and their bytes (each collective's largest buffer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            counts["ops_per_step"] += 1
            if name == "aten._local_scalar_dense":
                counts["host_syncs_per_step"] += 1
            if name.startswith("c10d."):
                counts["collectives_per_step"] += 1
                counts["collective_bytes_per_step"] += _tensor_bytes(list(args))
            return func(*args, **(kwargs or {}))

    with Counting():
        step()
    return {name: int(counts[name]) for name in
            ("ops_per_step", "host_syncs_per_step", "collectives_per_step", "collective_bytes_per_step")}


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null: Kineto writes two log lines per capture straight to it (no
    setting turns them off), 240 lines of noise in the gate's log."""
    saved = os.dup(2)
    with open(os.devnull, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _peak_step_bytes(step) -> int:
    """The most bytes the step holds allocated at once beyond what it started with: the allocator's
    events (``profile_memory``) of one profiled step, summed in time order. The same program allocates
    the same sizes in the same order, so unlike the process's RSS this does not drift between runs."""
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        step()
    live = peak = 0
    for _, size in sorted((e.start_ns(), e.nbytes()) for e in trace.profiler.kineto_results.events()
                          if e.name() == "[memory]"):
        live += size
        peak = max(peak, live)
    return peak


class _PhaseClock:
    """CPU seconds spent inside the sparse_attn phase (forward and backward ranges)."""

    def __init__(self) -> None:
        self.seconds, self._open = 0.0, {}

    def enter(self, phase: str) -> None:
        if phase.startswith("sparse_attn."):
            self._open[phase] = time.process_time()

    def exit(self, phase: str) -> None:
        if phase in self._open:
            self.seconds += time.process_time() - self._open.pop(phase)


def _point_step(point, cfg, lengths, packed, split, device, group):
    """The point's step as the sweep builds it: through its harness Case where the tree has one, else
    (an older base) through ``point_step``."""
    from dsv4cp.sweeps import measure

    if hasattr(measure, "point_case"):
        from dsv4cp.harness.build import build_step

        return build_step(measure.point_case(point, cfg, lengths, split, device), cp_group=group, device=device)
    return measure.point_step(point, cfg, packed, split, device, group)


def _cpu_ms(step) -> float:
    start = time.process_time()
    step()
    return (time.process_time() - start) * 1e3


class Case:
    def __init__(self, point, group, device, calibrate_injection: bool) -> None:

        from dsv4cp import kernel_options
        from dsv4cp.model import estimate
        from dsv4cp.model.machine import CPU_ESTIMATE
        from dsv4cp.packing import PackedSeqs
        from dsv4cp.profiling import nvtx
        from dsv4cp.sweeps.measure import point_split
        from dsv4cp.sweeps.spec import point_inputs

        self.point, self.options = point, dict(point.kernel_options or {})
        cfg, lengths = point_inputs(point)
        packed = PackedSeqs.from_lengths(lengths, total=point.tokens)
        split = point_split(point, cfg, lengths)
        with self._in_force(kernel_options):
            self.step = _point_step(point, cfg, lengths, packed, split, device, group if point.cp > 1 else None)
            for _ in range(2):  # warm-up: first-call allocations and caches
                self.step()
            clock = _PhaseClock()
            previous = nvtx.set_phase_listener(clock)
            steps, phases = [], []
            for _ in range(3):
                clock.seconds = 0.0
                steps.append(_cpu_ms(self.step))
                phases.append(clock.seconds * 1e3)
            nvtx.set_phase_listener(previous)
            self.counters = _count_step(self.step)
            self.counters["peak_step_bytes"] = _peak_step_bytes(self.step)
        table = estimate(cfg, point.ratio, packed, point.cp, CPU_ESTIMATE, split=split).records
        if point.direction != "fwd+bwd":
            table = table[table["direction"] == point.direction]
        self.counters.update(model_flops=float(table["flops"].sum()), model_hbm_bytes=float(table["hbm_bytes"].sum()),
                             model_comm_bytes=float(table["comm_bytes"].sum()))
        self.step_ms, self.phase_ms = sorted(steps)[1], sorted(phases)[1]
        self.injected_share = self._injected_share() if calibrate_injection and hasattr(
            getattr(self.step, "layer", None), "kernel_options") and hasattr(
            self.step.layer.kernel_options, "inject_slowdown") else None

    def _injected_share(self, pairs: int = 7, fraction: float = 4.0) -> float:
        """What ``inject_slowdown`` at fraction 1 adds to a step, as a share of the step: the median over
        ``pairs`` plain and slowed steps taken next to each other of (slowed - plain) / (fraction x plain).
        A ratio of neighbours, so the machine's speed at start-up (the other workers building) cancels; the
        busy loop spins over the backend's part of the phase only, so the phase's own time would overstate
        it. Fraction 4 puts the added time well above a step's noise."""
        shares = []
        for _ in range(pairs):
            plain = self.time_ms(None)
            shares.append((self.time_ms(fraction) - plain) / (fraction * plain))
        share = sorted(shares)[pairs // 2]
        if not share > 0:
            raise RuntimeError(f"{self.point.label()}: inject_slowdown at fraction {fraction} added nothing "
                               f"measurable to the step (shares {shares})")
        return share

    def _in_force(self, kernel_options):
        return kernel_options.overrides(self.options)

    def time_ms(self, inject: float | None) -> float:
        """One step's CPU ms; ``inject``: its sparse_attn phase that fraction slower (``inject_slowdown``,
        set on the layer's resolved options: the head's; a base without the option never gets one)."""
        import dataclasses

        from dsv4cp import kernel_options

        layer = self.step.layer
        plain = getattr(layer, "kernel_options", None)
        if inject is not None:
            layer.kernel_options = dataclasses.replace(plain, inject_slowdown=("sparse_attn", inject))
        try:
            with self._in_force(kernel_options):
                return _cpu_ms(self.step)
        finally:
            if inject is not None:
                layer.kernel_options = plain


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--tree", type=Path, required=True, help="the tree whose dsv4cp must be imported")
    parser.add_argument("--calibrate-injection", action="store_true",
                        help="measure each case's injected share (the worker that times injected steps)")
    args = parser.parse_args()
    protocol, sys.stdout = sys.stdout, sys.stderr  # library output must not break the protocol

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    import torch

    torch.set_num_threads(1)
    import dsv4cp
    from dsv4cp import kernel_options
    from dsv4cp.cp.emulate import init_emulated_group
    from dsv4cp.sweeps.spec import expand, load_spec

    imported = Path(dsv4cp.__file__).resolve().parent.parent
    if imported != args.tree.resolve():
        send({"error": f"imported dsv4cp from {imported}, not from {args.tree}: set PYTHONPATH"})
        return 2
    points = expand(load_spec(args.spec))
    device = torch.device("cpu")
    group = init_emulated_group(2, 0, seed=points[0].seed) if any(p.cp == 2 for p in points) else None
    bad = sorted({p.cp for p in points} - {1, 2})
    if bad:
        send({"error": f"cp: the gate measures CP = 1 and 2 (emulated rank 0), the spec has {bad}"})
        return 2
    cases = [Case(point, group, device, args.calibrate_injection) for point in points]
    send({"cases": [{"name": case.point.label(), "counters": case.counters, "step_ms": case.step_ms,
                     "phase_ms": case.phase_ms, "injected_share": case.injected_share} for case in cases],
          "defaults": kernel_options.resolved()})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        case = cases[request["time"]]
        send({"ms": [case.time_ms(request.get("inject")) for _ in range(request.get("repeat", 1))]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
