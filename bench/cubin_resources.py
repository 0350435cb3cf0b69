"""What the ``cuobjdump`` that ships with triton reads off a kernel compiled for the GPU (``triton.compile``
for sm_90 runs on any machine): its resource usage (``-res-usage``: registers per thread, stack and local
bytes) and its instructions (``-sass``). Shared by the scripts that print sm_90 resources without a GPU."""

from __future__ import annotations

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
