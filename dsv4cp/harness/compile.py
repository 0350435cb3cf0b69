"""A point's layer step under ``torch.compile``: the compiling first step timed apart from the timed steps."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from dsv4cp.harness.build import LayerStep
from dsv4cp.profiling.compilation import check_compile_backend


@dataclass(frozen=True)
class CompiledStep:
    seconds: float
    """Wall time of the first step: Dynamo's tracing, the backend's compilation and one run."""
    graph_breaks: int
    """Graph breaks Dynamo counted while compiling the step."""


def compile_step(step: LayerStep, backend: str, device: torch.device) -> CompiledStep:
    """Replace ``step``'s layer by ``torch.compile(layer, backend=backend)`` and run the step once (it
    compiles then; its gradients accumulate like a warm-up step's). Later calls run the compiled graphs."""
    check_compile_backend(backend)
    torch._dynamo.reset()  # a point's compile time must not include or reuse another point's graphs
    counters.clear()
    step.layer = torch.compile(step.layer, backend=backend)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return CompiledStep(seconds, int(sum(counters["graph_break"].values())))
