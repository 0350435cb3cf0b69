"""Stop signals taken down the interrupt's path: SIGTERM (a job scheduler's stop, ``kill``) and SIGHUP (a
closed terminal) end a command the way Ctrl-C does. The signal becomes :class:`Stopped`, a
``KeyboardInterrupt``, so every clean-up written for an interrupt runs for them too: a sweep keeps every
recorded point and does not count the point in flight as a crash, spawned ranks are told to stop, and the
command exits ``128 + signal number`` (130 SIGINT, 143 SIGTERM, 129 SIGHUP), as a shell reports a process
that signal ended. Standard library only: commands that never import torch install it too."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a command cleanly."""


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(int(signum))  # the number in args: a rank's Stopped unpickles in its spawner
        self.signum = int(signum)

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def exit_code(stop: KeyboardInterrupt) -> int:
    """The exit status of a command ended by ``stop``: ``128 +`` its signal (a plain interrupt: SIGINT's)."""
    return 128 + getattr(stop, "signum", signal.SIGINT)


def signal_name(stop: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(stop, "signum", signal.SIGINT)).name


def _stop_once(signum: int, frame: object) -> None:
    """The first stop signal raises :class:`Stopped`; later ones (a terminal's and a spawner's forwarded
    copy both arrive, or a scheduler repeating its SIGTERM) are ignored so that they cannot break the
    clean-up the first one started."""
    for each in STOP_SIGNALS:
        signal.signal(each, signal.SIG_IGN)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """Make every stop signal raise :class:`Stopped` in this process (its main thread)."""
    for each in STOP_SIGNALS:
        signal.signal(each, _stop_once)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """:func:`stop_on_signals` for the duration of the block, the previous handlers restored after it; a
    no-op off the main thread (Python runs signal handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {each: signal.getsignal(each) for each in STOP_SIGNALS}
    stop_on_signals()
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
