"""Record every read of tensor data by the host during a block of code.

On CUDA each of these makes the CPU wait for the device (a synchronisation): ``.item()``, ``int()`` /
``float()`` / ``bool()`` of a tensor, ``.tolist()``, ``.numpy()``, and the ops whose output size
depends on tensor values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``). Recording them on CPU tensors finds the code that
would synchronise on a GPU, without one (copies to the host are no-ops on CPU and are not seen: the
GPU test under ``torch.cuda.set_sync_debug_mode("error")`` covers them).

Usage::

    with HostReads() as reads:
        run()
    assert not reads.events, reads.report()

Code that reads on purpose only for CPU tensors (e.g. an input check that becomes an asynchronous device
assertion on CUDA) is excused by naming its function: ``reads.outside(("ops/x.py", "_check"))``.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_DEPENDENT = {
    "_local_scalar_dense",  # item(), int(), float(), bool() of a tensor
    "is_nonzero",
    "equal",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
}
_PATCHED = ("tolist", "numpy", "__array__")  # read the data without the dispatcher on CPU tensors
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Read:
    """One host read: what read the data, and the calling frames outside torch and this module."""

    what: str
    frames: tuple[traceback.FrameSummary, ...]

    @property
    def where(self) -> str:
        return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(self.frames[-6:]))

    def made_in(self, path_suffix: str, function: str) -> bool:
        """Whether the innermost calling frame of the package is ``function`` in a file ending ``path_suffix``."""
        inner = [f for f in self.frames if f"{os.sep}dsv4cp{os.sep}" in f.filename]
        return bool(inner) and inner[-1].filename.endswith(path_suffix) and inner[-1].name == function


class HostReads(TorchDispatchMode):
    """Context manager; ``events`` lists one :class:`Read` per host read of tensor data."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Read] = []
        self._saved: dict[str, object] = {}

    def _record(self, what: str) -> None:
        frames = tuple(f for f in traceback.extract_stack()
                       if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__)
        self.events.append(Read(what, frames))

    def outside(self, *excused: tuple[str, str]) -> list[Read]:
        """The reads not made in one of the ``(path suffix, function)`` pairs."""
        return [r for r in self.events if not any(r.made_in(path, fn) for path, fn in excused)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _VALUE_DEPENDENT:
            self._record(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self._record(name)
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self._record("index with a boolean mask")
        return func(*args, **kwargs)

    def __enter__(self):
        for attr in _PATCHED:
            original = getattr(torch.Tensor, attr)
            self._saved[attr] = original

            def patched(tensor, *a, _original=original, _attr=attr, **kw):
                self._record(_attr)
                return _original(tensor, *a, **kw)

            setattr(torch.Tensor, attr, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, original in self._saved.items():
            setattr(torch.Tensor, attr, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def report(self, reads: list[Read] | None = None) -> str:
        return "\n".join(f"{r.what}: {r.where}" for r in (self.events if reads is None else reads))

