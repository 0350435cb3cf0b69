"""What the kernels' ``torch.library`` custom ops share: the notes of what ran.

The custom ops take the kernel options they need as typed inputs (each op's module says which), so a
compiled graph runs them with the options it was traced with, and their autograd hands the forward's to
the backward. What ran (:func:`dsv4cp.kernel_options.note_backend`, a recorder a record reads back) is
noted by the custom ops as they run. The ops' dispatch notes through :func:`note_eager`, which writes
nothing while Dynamo traces: Dynamo would replay a traced write by rebuilding the registry's whole dict
after the graph, over the custom ops' notes. Under compile, code the compiler generated from a torch
reference is noted by nothing (it is not that reference).
"""

from __future__ import annotations

import torch

from dsv4cp import kernel_options

__all__ = ["note_eager"]


def note_eager(key: str, value: str) -> None:
    """:func:`dsv4cp.kernel_options.note_backend`, except while Dynamo traces (module docs)."""
    if not torch.compiler.is_compiling():
        kernel_options.note_backend(key, value)
