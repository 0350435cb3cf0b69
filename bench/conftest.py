"""pytest-benchmark support for dsv4cp's microbenchmarks (DESIGN 5).

* Without CUDA, ``TRITON_INTERPRET=1`` is set before anything imports triton so that the Triton
  backends run (slowly, at tiny sizes) on CPU and CI exercises every benchmark.
* The ``measure`` fixture wraps ``benchmark.pedantic``: each round calls ``setup`` (untimed: fresh
  arguments, optional L2 flush, a device synchronisation) then times ONE call of the target with the
  suite's timer (:func:`dsv4cp.profiling.timing.time_call`: CUDA events on GPU, ``time.perf_counter``
  on CPU). pytest-benchmark's own statistics are the wall time of the (synchronised) call;
  ``benchmark.extra_info`` holds the timer's median / p20 / p80 (:func:`dsv4cp.profiling.timing.summarise`)
  and the TFLOP/s and GB/s derived from the median.

Environment: ``DSV4CP_BENCH_FLUSH_L2=1`` zeroes a 256 MiB buffer before every timed round (GPU only).
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.common import HAS_CUDA
from dsv4cp.environment import machine_label
from dsv4cp.profiling.timing import L2_FLUSH_BYTES, summarise, time_call

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # registers the "triton" backends (a no-op once the op module imports it itself)
    import dsv4cp.kernels  # noqa: F401
except ImportError:  # pragma: no cover
    pass

_flush_buffer: torch.Tensor | None = None


def _flush_l2() -> None:
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()


@pytest.fixture
def measure(benchmark):
    """``measure(fn, setup=None, *, flops, bytes_moved, rounds, warmup_rounds, device)`` benchmarks
    ``fn(*setup())`` and records throughput in ``benchmark.extra_info``; returns the last result."""

    def run(fn, setup=None, *, flops: float, bytes_moved: float, rounds: int, warmup_rounds: int,
            device: torch.device):
        on_cuda = torch.device(device).type == "cuda"
        flush = on_cuda and os.environ.get("DSV4CP_BENCH_FLUSH_L2", "0") == "1"
        times_ms: list[float] = []
        last: dict = {}

        def target(*args):
            result, ms = time_call(lambda: fn(*args), device)
            times_ms.append(ms)
            last["result"] = result
            return result

        def round_setup():
            args = tuple(setup()) if setup is not None else ()
            if flush:
                _flush_l2()
            if on_cuda:
                torch.cuda.synchronize()
            return args, {}

        benchmark.pedantic(target, setup=round_setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
        timed = times_ms[warmup_rounds:] or times_ms[-1:]  # (--benchmark-disable runs the target once)
        summary = summarise(timed)
        seconds = summary.median_ms * 1e-3
        benchmark.extra_info.update(
            device=machine_label(device),
            timer="cuda_events" if on_cuda else "perf_counter",
            l2_flush=flush,
            rounds=len(timed),
            median_ms=summary.median_ms,
            p20_ms=summary.p20_ms,
            p80_ms=summary.p80_ms,
            flops=float(flops),
            bytes=float(bytes_moved),
            tflops=float(flops) / seconds / 1e12 if seconds > 0 else float("nan"),
            gbps=float(bytes_moved) / seconds / 1e9 if seconds > 0 else float("nan"),
        )
        return last.get("result")

    return run
