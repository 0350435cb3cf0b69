"""Registers, spills and shared memory of the Triton sparse-attention kernels on sm_90, without a GPU.

For each candidate of ``bench/sweep_sparse_attention_configs.py`` (``--match``, a regular expression
on their names, narrows them) at the
benchmark shapes, runs the kernel module's own wrapper on small CPU tensors of the shape's heads, head
dim, slots and kv rows (the launch's integers and strides are the GPU run's; only the query count is
small) with every launch captured instead of run, then compiles each captured launch for
``cuda:90`` (Hopper) with the runtime's specialisation (16-byte aligned pointers and integers divisible
by 16 marked, integers equal to 1 made constants) and reads the binary with the ``cuobjdump`` that ships
with triton: registers per thread, stack bytes (spills), shared memory, wgmma instructions (``HGMMA``)
and mma.sync ones (``HMMA``). These are the figures docs/kernels.md quotes.

Run it from the repository root on any machine with triton (no ``TRITON_INTERPRET``)::

    python -m bench.sparse_attention_resources --shapes flash --match one-product
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass
from unittest import mock

import torch

from bench.cubin_resources import cuobjdump
from bench.sweep_sparse_attention_configs import CANDIDATES, Candidate, bwd_call, fwd_call
from bench.test_bench_sparse_attention import SHAPES, Shape

QUERIES = 4
"""Queries of the captured launches: the grid is not compiled in, so a few stand for the shape's T."""
TARGET = ("cuda", 90, 32)


@dataclass
class Launch:
    """One captured launch: the kernel's name, its positional arguments and its keyword ones."""

    name: str
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands for a built kernel: ``kernel[grid](*args, **kwargs)`` appends a :class:`Launch`."""

    def __init__(self, name: str, launches: list[Launch]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.name, args, kwargs))


def capture(cand: Candidate, shape: Shape) -> list[Launch]:
    """The launches the wrapper makes for ``cand`` at ``shape`` (bf16, ``QUERIES`` queries), captured."""
    from dsv4cp.kernels import sparse_attention_bwd_triton, sparse_attention_fwd_triton

    g = torch.Generator().manual_seed(0)
    n = shape.tokens + shape.n_compressed
    q = torch.randn(QUERIES, shape.heads, shape.dim, generator=g).bfloat16()
    kv = torch.randn(n, shape.dim, generator=g).bfloat16()
    idx = torch.randint(0, n, (QUERIES, shape.kt), generator=g, dtype=torch.int32)
    sink, scale = torch.zeros(shape.heads), shape.dim**-0.5
    launches: list[Launch] = []
    with contextlib.ExitStack() as patches:
        # compiled, not interpreted, launches: the GPU's build and matrix-unit precision
        for module in (sparse_attention_fwd_triton, sparse_attention_bwd_triton):
            patches.enter_context(mock.patch.object(module, "_build", lambda name, device: _Recorder(name, launches)))
            patches.enter_context(mock.patch.object(module, "_dot_f32", lambda q: False))
            patches.enter_context(mock.patch.object(module, "_precision", lambda q: "tf32"))
        if cand.direction == "fwd":
            fwd_call(cand, q, kv, idx, sink, scale)
        else:
            out, lse = torch.zeros_like(q), torch.zeros(QUERIES, shape.heads)
            bwd_call(cand, torch.zeros_like(q), q, kv, idx, sink, scale, out, lse)
    return launches


def compile_launch(launch: Launch) -> dict[str, int]:
    """Compile ``launch`` for sm_90 as the runtime would specialise it; its resources from cuobjdump."""
    import triton
    from triton.backends.compiler import GPUTarget

    from dsv4cp.kernels import sparse_attention_launch, sparse_attention_triton  # noqa: F401  (registers the bodies)

    fn = triton.jit(sparse_attention_launch._BODIES[launch.name])
    options = {k: launch.kwargs.pop(k) for k in ("num_warps", "num_stages")}
    signature, constexprs, attrs = {}, dict(launch.kwargs), {}
    for i, (name, value) in enumerate(zip(fn.arg_names, launch.args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
                                     torch.int64: "i64", torch.float16: "fp16"}[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    target = GPUTarget(*TARGET)
    backend = triton.compiler.make_backend(target)
    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=backend.parse_options(options).__dict__)
    usage, sass = cuobjdump(compiled, "-res-usage", "-sass")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)),
            "shared_kb": compiled.metadata.shared / 1024, "wgmma": len(re.findall(r"\bHGMMA", sass)),
            "mma_sync": len(re.findall(r"\bHMMA", sass))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flash,pro", help="comma-separated: flash, pro")
    parser.add_argument("--match", default="", help="only candidates whose name matches this regular expression")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in shapes:
        if name not in ("flash", "pro"):
            parser.error(f"--shapes: unknown shape {name!r} (flash, pro)")
    from dsv4cp.kernels import triton_interpreting

    if triton_interpreting():
        print("sparse_attention_resources: unset TRITON_INTERPRET (it compiles for the GPU)", file=sys.stderr)
        return 2
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for cand in CANDIDATES:
            if shape.heads not in cand.heads or not re.search(args.match, cand.name):
                continue
            for launch in capture(cand, shape):
                if launch.name == "_bwd_preprocess_kernel":
                    continue
                try:
                    res = compile_launch(launch)
                    text = (f"{res['registers']:3d} regs {res['stack_bytes']:4d} B stack {res['shared_kb']:6.1f} KB "
                            f"{res['wgmma']:3d} wgmma {res['mma_sync']:3d} mma.sync")
                except Exception as exc:  # noqa: BLE001 - one candidate over the limits must not end the list
                    text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                print(f"{shape_name:5s} {cand.direction} {cand.name:52s} {launch.name:16s} {text}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
