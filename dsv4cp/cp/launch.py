"""Run a function on ``world`` local ranks: spawned processes (CPU tests, the CLI) or torchrun's.

One process per rank, each with its own process group. When a rank raises, the spawner terminates
the others, so no rank waits forever on a collective its peer will never issue. When the spawner
itself dies (even by SIGKILL, which runs no clean-up), the kernel kills its ranks (Linux's
parent-death signal), so none is left running, measuring and writing; :func:`parent_alive` lets a rank
check before it writes anything, for the moment between the parent's death and its own.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4cp.cp.torchrun import under_torchrun  # noqa: F401  (where the launchers' callers look for it)

TIMEOUT = datetime.timedelta(seconds=300)

PARENT_PID_ENV = "DSV4CP_SPAWN_PARENT_PID"
"""Set in every rank :func:`spawn` starts: the pid of the process that spawned it."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_for(backend: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL (never assumes one node), else CPU."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_from_env(backend: str) -> torch.device:
    """Join the process group torchrun (or :func:`spawn`) described in the environment."""
    device = device_for(backend)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=TIMEOUT, **kwargs)
    return device


def parent_alive() -> bool:
    """False in a rank started by :func:`spawn` whose spawner is gone; True in any other process (one
    torchrun started, whose agent stops its workers itself, or a process that is no rank)."""
    parent = os.environ.get(PARENT_PID_ENV)
    return parent is None or os.getppid() == int(parent)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``),
    then exit at once if the parent died before the request took effect."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os._exit(1)  # orphaned already: nothing to report to, nothing to run


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, results,
            parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **{PARENT_PID_ENV: str(parent_pid)},
    )
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        device = init_from_env(backend)
        # Serialised by torch.save: tensors must not travel as shared-memory handles that vanish with
        # this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world, device, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as err:  # report the failure to the parent, then fail this rank
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world, device, *args)`` on ``world`` new processes; return each rank's result.

    ``fn`` must be importable (a module-level function). A failing rank raises ``RuntimeError``
    here with its message and traceback, after the other ranks are stopped. The ranks die with this
    process; call it from the main thread (Linux sends the parent-death signal when the thread that
    started a child ends).
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    collected: dict[int, Any] = {}
    errors: list[str] = []

    def drain() -> None:  # read as results arrive: a large result would otherwise fill the pipe
        while not results.empty():
            rank, status, payload = results.get()
            if status == "ok":
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}: {payload}")

    context = mp.start_processes(_worker, args=(world, port, backend, fn, args, results, os.getpid()), nprocs=world,
                                 join=False, start_method="spawn")
    try:
        while not context.join(timeout=0.05):
            drain()
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass  # the failing rank's own message is in the queue; the others were terminated by join()
    drain()
    if errors or len(collected) != world:
        raise RuntimeError("distributed run failed:\n" + ("\n".join(errors) or "a rank exited without a result"))
    return [collected[r] for r in range(world)]
