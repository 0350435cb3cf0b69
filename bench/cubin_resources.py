"""What the ``cuobjdump`` that ships with triton reads off a kernel compiled for the GPU (``triton.compile``
for sm_90 runs on any machine): its resource usage (``-res-usage``: registers per thread, stack and local
bytes) and its instructions (``-sass``). Shared by the scripts that print sm_90 resources without a GPU,
with the command line those scripts have in common (:func:`heads_parser`,
:func:`parse_heads_and_print_target`)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile


def cuobjdump(compiled, *flags: str) -> list[str]:
    """The output of ``cuobjdump FLAG`` on ``compiled``'s cubin (a ``triton.compile`` result), one per flag."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return [subprocess.run([tool, flag, cubin.name], capture_output=True, text=True, check=True).stdout
                for flag in flags]


def resource_usage(compiled) -> dict[str, int]:
    """``cuobjdump -res-usage``'s ``REG`` (registers per thread), ``STACK`` and ``LOCAL`` (bytes per thread)
    of ``compiled``'s kernel."""
    (usage,) = cuobjdump(compiled, "-res-usage")
    return {name: int(value) for name, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}


def heads_parser(doc: str, heads_help: str = "query heads (64 flash, 128 pro)") -> argparse.ArgumentParser:
    """The command line of an sm_90 resources script: its description (the first paragraph of ``doc``, the
    script's docstring) and ``--heads`` (default 64); the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=64, help=heads_help)
    return parser


def parse_heads_and_print_target(parser: argparse.ArgumentParser, argv: list[str] | None,
                                 dim: int) -> argparse.Namespace:
    """``parser``'s arguments, ``--heads`` checked positive, and the line every such script prints first
    (triton's version, the target, the heads and head dim ``dim``)."""
    import triton  # lazy, as in cuobjdump: importing this module needs no triton

    args = parser.parse_args(argv)
    if args.heads < 1:
        parser.error(f"--heads: must be positive, got {args.heads}")
    print(f"triton {triton.__version__}, sm_90, bf16, H={args.heads}, D={dim}")
    return args
