"""``torch.compile`` of a layer step: the backends offered, and where and why Dynamo breaks the graph.

A graph break splits the step into several compiled graphs with eager Python between them: each break
costs a return to the interpreter and stops fusion across it. :func:`explain_breaks` runs the function
once under ``torch._dynamo.explain`` and names each break's reason and the line of dsv4cp (or torch)
code it happened at, so a report can say which part does not compile and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4cp.choices import COMPILE_BACKENDS  # the backends' names: checked without torch

UNPLACED = "no line reported: a frame Dynamo skipped"


@dataclass(frozen=True)
class GraphBreak:
    reason: str
    """The first line of Dynamo's reason, e.g. ``Unsupported Tensor.item() call ...``."""
    where: str
    """``file:line in function`` of the innermost frame of user code at the break."""
    count: int


def check_compile_backend(name: str, field: str = "compile") -> None:
    """``ValueError`` naming ``field`` unless ``name`` is one of :data:`COMPILE_BACKENDS`."""
    if name not in COMPILE_BACKENDS:
        raise ValueError(f"{field}: must be one of {COMPILE_BACKENDS}, got {name!r}")


@dataclass(frozen=True)
class Explanation:
    graphs: int
    """Graphs Dynamo compiled for one call."""
    breaks: int
    """Graph breaks Dynamo counted (a break in a function it then skips may make several graphs)."""
    reasons: list[GraphBreak]
    """Each distinct (reason, place) of a break with how often it occurred, most frequent first."""

    def lines(self) -> list[str]:
        """A header line and one line per distinct break (for reports)."""
        head = f"torch.compile: {self.graphs} graph(s), {self.breaks} graph break(s)"
        return [head] + [f"  {b.count} x {b.reason} (at {_short(b.where)})" for b in self.reasons]


def explain_breaks(fn: Callable, *args, **kwargs) -> Explanation:
    """What Dynamo made of one call of ``fn(*args, **kwargs)`` under ``torch._dynamo.explain``."""
    from torch._dynamo.utils import counters  # Dynamo's import costs seconds: only where something compiles

    counters.clear()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    counted: dict[tuple[str, str], int] = {}
    for item in explained.break_reasons:
        frame = item.user_stack[-1] if item.user_stack else None
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "unknown"
        key = (item.reason.strip().splitlines()[0], where)
        counted[key] = counted.get(key, 0) + 1
    placed = {reason for reason, _ in counted}
    for text, n in counters["graph_break"].items():  # breaks in frames Dynamo then skipped: no place given
        reason = text.strip().splitlines()[0]
        if reason not in placed:
            counted[(reason, UNPLACED)] = counted.get((reason, UNPLACED), 0) + n
    reasons = [GraphBreak(reason, where, n) for (reason, where), n in counted.items()]
    return Explanation(explained.graph_count, explained.graph_break_count,
                       sorted(reasons, key=lambda b: (-b.count, b.where)))


def _short(where: str) -> str:
    """Paths from the package (``dsv4cp/...``) or torch on, not the machine's install prefix."""
    for marker in ("/dsv4cp/", "/torch/"):
        if marker in where:
            return where[where.rindex(marker) + 1 :]
    return where
