"""Host cost of one layer step per phase, measured on CPU at tiny sizes: where the GPU would wait.

On a GPU the device idles while the host prepares the next kernel: host reads of device data (each a
synchronisation), and Python and dispatcher time between kernels where kernels are short. At tiny sizes
on CPU every kernel is short, so what remains per phase is the host's own cost. For each phase of one
forward + backward of a C layer on a histogram-like packing (many short documents) this prints:

* ``ops``: aten ops dispatched (each is at least one kernel launch on CUDA, ~5-10 us of host time);
* ``triton``: Triton kernel launches (through :class:`dsv4cp.kernels._triton_launch.Kernels`);
* ``host_ms``: wall time inside the phase and outside its nested phases (kernels included: tiny here);
* every host read of tensor data (:class:`host_reads.HostReads`), with the calling frames.

``--triton`` runs the step on the CUDA code path (Triton top-k, indexer scores, target probabilities,
fused RoPE and pooling, the Triton sparse attention) on CPU tensors under Triton's interpreter, by
making the ops' "serves CUDA" predicates accept CPU tensors; the interpreter's own reads of tensor data
are left out. Host times then include the interpreter and mean nothing; ops and launches count.

    python -m bench.host_cost [--triton] [--docs 32] [--tokens 512] [--recompute]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from dsv4cp.config import DSv4Config  # noqa: E402
from dsv4cp.harness.build import build_step  # noqa: E402
from dsv4cp.harness.case import Case  # noqa: E402
from dsv4cp.packing import PackedSeqs  # noqa: E402
from dsv4cp.profiling import nvtx  # noqa: E402
from host_reads import HostReads  # noqa: E402  (tests/ helper, found through the path above)

CFG = DSv4Config.preset("tiny", hidden=64, n_heads=4, head_dim=32, rope_dim=16, index_n_heads=4,
                        index_head_dim=16, index_topk=16, window=16)
"""Tiny widths that are multiples of 16 (the Triton kernels' matrix-unit K)."""

_OUTSIDE = "(outside phases)"


class PhaseCost:
    """Phase listener and op counter: ops, Triton launches and exclusive wall time per innermost phase."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.names: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._since = time.perf_counter()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else _OUTSIDE

    def _charge(self) -> None:
        now = time.perf_counter()
        self.seconds[self.current] += now - self._since
        self._since = now

    def enter(self, phase: str) -> None:
        self._charge()
        self.stack.append(phase)

    def exit(self, phase: str) -> None:
        self._charge()
        if phase in self.stack:  # backward spans need not nest: remove the innermost of that name
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(phase)]

    def op(self, name: str) -> None:
        self.ops[self.current] += 1
        self.names[self.current][name] += 1

    def restart(self) -> None:
        self._since = time.perf_counter()

    def finish(self) -> None:
        self._charge()


_NO_KERNEL = {"empty", "empty_strided", "empty_like", "scalar_tensor", "promote_types", "result_type",
              "_record_function_enter_new", "_record_function_exit", "_local_scalar_dense", "is_nonzero"}
"""aten ops that launch no kernel on CUDA (allocations, host scalars, profiler marks); views neither."""


class _CountOps(TorchDispatchMode):
    """Counts the dispatched aten ops that launch a kernel on CUDA (``ops``) and the views (``views``)."""

    def __init__(self, cost: PhaseCost) -> None:
        super().__init__()
        self.cost = cost
        self.paused = 0  # > 0 inside an interpreted kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if self.paused:
            pass
        elif func.is_view:
            self.cost.views[self.cost.current] += 1
        elif name not in _NO_KERNEL:
            self.cost.op(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_triton_launches(cost: PhaseCost, ops: _CountOps) -> Iterator[None]:
    """Count interpreted Triton launches; the ops the interpreter itself dispatches are not counted."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        cost.launches[cost.current] += 1
        ops.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            ops.paused -= 1

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


@contextlib.contextmanager
def _cuda_path_on_cpu() -> Iterator[None]:
    """The ops' CUDA dispatch predicates accept CPU tensors (the kernels then run interpreted)."""
    from dsv4cp.kernels import norm_rope_triton
    from dsv4cp.ops import attention_probs, compress_pool, indexer, norm_rope

    def serves(x: torch.Tensor, *_args) -> bool:
        return x.dtype != torch.float64 and x.shape[-1] % 16 == 0

    def fused(x: torch.Tensor, freqs: torch.Tensor | None = None) -> bool:
        return (x.dim() == 3 and x.dtype in norm_rope_triton.SUPPORTED_DTYPES and x.shape[2] % 16 == 0
                and (freqs is None or 0 < 2 * freqs.numel() <= x.shape[2]))

    patches = [(indexer, "triton_serves", serves), (attention_probs, "triton_serves", serves),
               (compress_pool, "use_triton", serves), (norm_rope, "use_fused", fused)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _lengths(tokens: int, docs: int) -> list[int]:
    """``docs`` documents of uneven lengths filling ``tokens`` rows (short ones and one long one)."""
    weights = [1 + (7 * d) % 5 for d in range(docs - 1)] + [docs]
    scale = tokens / sum(weights)
    lengths = [max(1, int(w * scale)) for w in weights]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def measure(tokens: int, docs: int, triton: bool, recompute: bool, reps: int) -> tuple[PhaseCost, HostReads, dict]:
    """One counted step (ops, launches, host reads), then ``reps`` timed steps (median ms per phase)."""
    packed = PackedSeqs.from_lengths(_lengths(tokens, docs), total=tokens)
    backend = "triton" if triton else "torch"
    step = build_step(Case(cfg=CFG, ratio=4, lengths=tuple(packed.lengths()), total=tokens, seed=0, backend=backend,
                           recompute=recompute))
    paths = _cuda_path_on_cpu() if triton else contextlib.nullcontext()
    with paths:
        step()  # warm-up: kernels built, configurations chosen
        counted = PhaseCost()
        ops = _CountOps(counted)
        launches = _count_triton_launches(counted, ops) if triton else contextlib.nullcontext()
        with _listening(counted), launches, HostReads() as reads, ops:
            _run(step, counted)
        timed = []
        for _ in range(reps):
            cost = PhaseCost()
            with _listening(cost):
                _run(step, cost)
            timed.append(cost.seconds)
    phases = {p for t in timed for p in t}
    median_ms = {p: sorted(t.get(p, 0.0) for t in timed)[len(timed) // 2] * 1e3 for p in phases}
    return counted, reads, median_ms


@contextlib.contextmanager
def _listening(cost: PhaseCost) -> Iterator[None]:
    previous = nvtx.set_phase_listener(cost)
    try:
        yield
    finally:
        nvtx.set_phase_listener(previous)


def _run(step, cost: PhaseCost) -> None:
    cost.restart()
    with nvtx.nvtx_range("step"):
        step()
    cost.finish()


def _report(cost: PhaseCost, reads: HostReads, median_ms: dict, triton: bool) -> str:
    lines = [f"{'phase':24s} {'ops':>6s} {'views':>6s} {'triton':>6s} {'host_ms':>8s}  most frequent ops"]
    for phase in sorted(cost.ops.keys() | median_ms.keys(), key=lambda p: -cost.ops[p]):
        top = ", ".join(f"{n} {c}" for n, c in cost.names[phase].most_common(5))
        lines.append(f"{phase:24s} {cost.ops[phase]:6d} {cost.views[phase]:6d} {cost.launches[phase]:6d} "
                     f"{median_ms.get(phase, 0.0):8.2f}  {top}")
    lines.append(f"{'total':24s} {sum(cost.ops.values()):6d} {sum(cost.views.values()):6d} "
                 f"{sum(cost.launches.values()):6d} {sum(median_ms.values()):8.2f}")
    kept = [r for r in reads.events
            if not (triton and any(f"{os.sep}triton{os.sep}" in f.filename for f in r.frames))]
    lines.append(f"host reads of tensor data: {len(kept)}")
    lines += [f"  {r.what}: {r.where}" for r in kept]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", action="store_true", help="the CUDA code path, under Triton's interpreter")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--reps", type=int, default=5, help="timed steps (the median per phase is shown)")
    args = parser.parse_args(argv)
    if args.triton and os.environ.get("TRITON_INTERPRET") != "1":
        print("--triton: set TRITON_INTERPRET=1 (before triton's import)", file=sys.stderr)
        return 2
    cost, reads, median_ms = measure(args.tokens, args.docs, args.triton, args.recompute, args.reps)
    print(_report(cost, reads, median_ms, args.triton))
    return 0


if __name__ == "__main__":
    sys.exit(main())
