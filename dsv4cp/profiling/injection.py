"""A known slowdown put into one phase on purpose (the ``inject_slowdown`` kernel option), for measuring
the CI gate's power: each call of the phase spins, after its work, for FRACTION x the host CPU time
that work took, so the phase runs (1 + FRACTION) x its own time whatever the machine's speed or load.
CPU time (not wall time): a loaded machine's stalls neither lengthen nor shorten the added work. Off by
default; never set in a measurement.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


@contextlib.contextmanager
def injected_slowdown(phase: str, setting: tuple[str, float] | None) -> Iterator[None]:
    """Run the block; when ``setting`` (the ``inject_slowdown`` option's value) names ``phase``, spin for
    its fraction of the block's CPU time."""
    if setting is None or setting[0] != phase:
        yield
        return
    start = time.process_time()
    yield
    until = time.process_time() + setting[1] * (time.process_time() - start)
    while time.process_time() < until:
        pass
