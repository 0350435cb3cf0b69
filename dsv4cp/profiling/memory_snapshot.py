"""A CUDA memory snapshot of one step: every allocation and free with its Python stack.

``torch.cuda.memory._record_memory_history`` makes the caching allocator keep a trace of its events
(allocations, frees, segment maps) with the stack that caused each; ``_dump_snapshot`` writes that
trace and the allocator's state as a pickle, the file PyTorch's memory visualiser
(https://pytorch.org/memory_viz) opens: its timeline shows which tensors are live at the peak and who
allocated them. Recording stacks slows every allocation, so the snapshot gets a step of its own.

    with record_memory_snapshot(trace_dir / snapshot_name(rank), device):
        step()

CUDA only: the CPU allocator keeps no such history, so asking for a snapshot there is bad input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

MAX_ENTRIES = 1_000_000
"""Allocator events kept (the oldest are dropped past it): a 128K-token fwd+bwd step makes ~1e4."""


def snapshot_name(rank: int) -> str:
    """The snapshot's file name for ``rank``, written beside that point's Kineto traces."""
    return f"memory_snapshot_rank{rank}.pickle"


def check_snapshot_device(device: torch.device | str, flag: str = "--memory-snapshot") -> None:
    """``ValueError`` naming ``flag`` unless ``device`` is a CUDA device (a snapshot is the CUDA
    allocator's history)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{flag}: a memory snapshot is the CUDA allocator's history; this run is on "
                         f"device {device.type}")


def check_snapshot_request(requested: bool, traced: bool, trace_flag: str, flag: str = "--memory-snapshot") -> None:
    """The command-line checks of a snapshot request, before any work or process starts: ``ValueError``
    naming ``flag`` on a machine without CUDA, or naming ``trace_flag`` when the run writes no traces
    (the snapshots go beside them); nothing when not ``requested``."""
    if not requested:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{flag}: a memory snapshot is the CUDA allocator's history; this machine has no "
                         "CUDA device")
    if not traced:
        raise ValueError(f"{flag}: snapshots are written beside the traces: give {trace_flag}")


@contextlib.contextmanager
def record_memory_snapshot(path: str | Path, device: torch.device | str,
                           max_entries: int = MAX_ENTRIES) -> Iterator[Path]:
    """Record the allocator's history on ``device`` during the region and dump it to ``path`` (parent
    created) when the region ends, also when it raised (an out-of-memory step's snapshot shows what
    filled the device); recording is switched off again either way."""
    check_snapshot_device(device, flag="device")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize(device)  # frees of earlier kernels land before the history starts
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=max_entries, device=device)
    try:
        yield path
    finally:
        try:
            torch.cuda.synchronize(device)
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)
