"""The package's module graph: no import circle anywhere in dsv4cp (function-level imports included),
the top-k's host planning imports no triton, and no kernel or op reads the environment (the kernel
options registry, :mod:`dsv4cp.kernel_options`, is the one place that does)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds an import circle)."""
    adjacency = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in adjacency.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in adjacency:
        if module not in order:
            visit(module)
    return cycles


def test_cycle_finder_finds_a_circle():
    class Graph:  # a -> b -> c -> a, and d -> a outside the circle
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert import_cycles(Graph()) == [["a", "b", "c"]]


def test_no_import_circle_in_dsv4cp():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("dsv4cp")
    assert "dsv4cp.kernels.indexer_plan" in graph.modules
    assert import_cycles(graph) == []


def test_host_planning_imports_no_triton():
    code = ("import sys, dsv4cp.kernels.indexer_plan, dsv4cp.kernel_options, dsv4cp.ops.indexer; "
            "print('triton' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_kernels_and_ops_read_no_environment():
    pattern = re.compile(r"os\.environ|getenv")
    hits = [f"{path.relative_to(ROOT)}:{n}" for folder in ("dsv4cp/kernels", "dsv4cp/ops")
            for path in sorted((ROOT / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
