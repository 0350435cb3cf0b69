"""What the kernels' ``torch.library`` custom ops share: the kernel options in force, as one argument, and
the notes of what ran.

An eager op reads its kernel options (:mod:`dsv4cp.kernel_options`) when it runs, inside the caller's
``overrides`` block. A compiled graph runs its custom ops later, outside any such block (Dynamo traces
the block's enter and exit as side effects, not as a scope around the op). So each op takes the
options in force where it was traced, as text (:func:`options_in_force`), and its implementation runs
under them again (:func:`options_from`): the compiled step launches the kernels the eager step would.

What ran (:func:`dsv4cp.kernel_options.note_backend`) is noted by the custom ops as they run. The ops'
dispatch notes through :func:`note_eager`, which writes nothing while Dynamo traces: Dynamo would replay a
traced write by rebuilding the registry's whole dict after the graph, over the custom ops' notes. Under
compile, code the compiler generated from a torch reference is noted by nothing (it is not that reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dsv4cp import kernel_options

__all__ = ["note_eager", "options_from", "options_in_force"]

_SEPARATOR = ";"  # a tile's value holds commas ("64,64,4,2"), never a semicolon


def options_in_force() -> str:
    """The kernel options whose current value differs from the default, as ``"name=value;..."``
    (sorted by name; ``""`` when every option has its default). Dynamo traces it (it sees the values of
    the ``overrides`` blocks it is tracing), and the graph holds the text as a constant."""
    values = kernel_options.non_default(kernel_options.resolved())
    return _SEPARATOR.join(f"{name}={value}" for name, value in values.items())


@contextlib.contextmanager
def options_from(text: str) -> Iterator[None]:
    """The options of ``text`` (:func:`options_in_force`'s form) in force for the block; ``ValueError``
    naming a bad one."""
    values = kernel_options.parse_assignments([item for item in text.split(_SEPARATOR) if item])
    with kernel_options.overrides(values):
        yield


def note_eager(key: str, value: str) -> None:
    """:func:`dsv4cp.kernel_options.note_backend`, except while Dynamo traces (module docs)."""
    if not torch.compiler.is_compiling():
        kernel_options.note_backend(key, value)
