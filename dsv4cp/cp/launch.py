"""Run a function on ``world`` local ranks: spawned processes (CPU tests, the CLI) or torchrun's.

One process per rank, each with its own process group. When a rank raises, the spawner terminates
the others, so no rank waits forever on a collective its peer will never issue. When the spawner
itself dies (even by SIGKILL, which runs no clean-up), the kernel kills its ranks (Linux's
parent-death signal), so none is left running, measuring and writing; :func:`parent_alive` lets a rank
check before it writes anything, for the moment between the parent's death and its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import io
import logging
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4cp.cp.torchrun import under_torchrun  # noqa: F401  (where the launchers' callers look for it)
from dsv4cp.stopping import stop_on_signals

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


class RankExited(RuntimeError):
    """A spawned rank ended without a result and without raising: killed by a signal, or exited."""


FORWARDED_ERRORS = (OSError, ValueError, KeyboardInterrupt)
"""What a rank raises that is no bug (a full disk, a bad value met late, an interrupt sent to the rank):
re-raised by :func:`spawn` as itself, so the command reports it in one line as it would from one process."""

INTERRUPT_GRACE_S = 30.0
"""After forwarding an interrupt, how long :func:`spawn` waits for its ranks to stop by themselves (they
stop between two operations) before it terminates them."""


def _forwardable(err: BaseException) -> BaseException | None:
    """``err`` when the spawner should re-raise it as is (:data:`FORWARDED_ERRORS`, picklable), else None."""
    if not isinstance(err, FORWARDED_ERRORS):
        return None
    try:
        pickle.dumps(err)
    except Exception:  # an exception holding what cannot travel: its text still does
        return None
    return err


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, results,
            parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    stop_on_signals()  # a stop signal sent to the whole group ends a rank like the forwarded interrupt
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
        results.put((rank, "error", (f"{type(err).__name__}: {err}\n{traceback.format_exc()}", _forwardable(err))))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world, device, *args)`` on ``world`` new processes; return each rank's result.

    ``fn`` must be importable (a module-level function). When a rank fails, the others are stopped, then:
    an error of :data:`FORWARDED_ERRORS` it raised is raised here as is; a rank killed by a signal (or
    exiting without a result) raises :class:`RankExited` naming the rank and the signal; anything else
    raises ``RuntimeError`` with every failing rank's message and traceback. An interrupt (SIGINT) of
    this process is forwarded to the ranks, which stop between two operations; they are terminated
    after :data:`INTERRUPT_GRACE_S`, then ``KeyboardInterrupt`` is raised here. The ranks die with this
    process; call it from the main thread (Linux sends the parent-death signal when the thread that
    started a child ends).
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    collected: dict[int, Any] = {}
    errors: list[tuple[int, str, BaseException | None]] = []

    def drain() -> None:  # read as results arrive: a large result would otherwise fill the pipe
        while not results.empty():
            rank, status, payload = results.get()
            if status == "ok":
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append((rank, *payload))

    context = mp.start_processes(_worker, args=(world, port, backend, fn, args, results, os.getpid()), nprocs=world,
                                 join=False, start_method="spawn")
    exited: mp.ProcessExitedException | None = None
    try:
        with _quiet_termination():
            while not context.join(timeout=0.05):
                drain()
    except mp.ProcessExitedException as err:  # a rank died without raising; the others were terminated
        exited = err
    except mp.ProcessRaisedException:
        pass  # the failing rank's own message is in the queue; the others were terminated by join()
    except KeyboardInterrupt:
        _stop_interrupted(context)
        raise
    drain()
    forwarded = [error for _, _, error in errors if error is not None]
    # A rank stopped by a signal (its own interrupt, or the SIGTERM with which the others are stopped once
    # one failed) is never the cause when another rank failed: its peer's error or death is.
    causes = [error for error in forwarded if not isinstance(error, KeyboardInterrupt)]
    if causes:  # the cause: a rank whose peer failed sees only a closed connection
        raise causes[0]
    if exited is not None:
        how = f"was killed by {exited.signal_name}" if exited.signal_name else f"exited with code {exited.exit_code}"
        raise RankExited(f"rank {exited.error_index} (pid {exited.error_pid}) {how}; the other ranks were stopped")
    if forwarded:
        raise forwarded[0]
    if errors or len(collected) != world:
        raise RuntimeError("distributed run failed:\n" + ("\n".join(f"rank {rank}: {text}" for rank, text, _ in errors)
                                                          or "a rank exited without a result"))
    return [collected[r] for r in range(world)]


@contextlib.contextmanager
def _quiet_termination() -> Iterator[None]:
    """Without torch's warning per rank it terminates after another failed: stopping them is the contract
    here, and the failure itself is reported in one line."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _stop_interrupted(context: mp.ProcessContext) -> None:
    """Forward an interrupt to every live rank, give them :data:`INTERRUPT_GRACE_S` to stop, then terminate
    (and kill) the rest, so that none goes on measuring after this process has exited."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second interrupt must not cut this clean-up short
    try:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        for process in context.processes:
            process.join(max(deadline - time.monotonic(), 0))
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
    finally:
        signal.signal(signal.SIGINT, previous)
