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
"""

from __future__ import annotations

import traceback

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


class HostReads(TorchDispatchMode):
    """Context manager; ``events`` lists ``(what, where)`` per host read, ``where`` a short stack."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}

    def _record(self, what: str) -> None:
        stack = [f for f in traceback.extract_stack() if "/torch/" not in f.filename][:-1]  # minus _record
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(stack[-6:]))
        self.events.append((what, where))

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

    def report(self) -> str:
        return "\n".join(f"{what}: {where}" for what, where in self.events)

