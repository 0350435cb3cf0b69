"""A progress bar with ETA for the warm-up and timed steps of long runs (tqdm, on stderr).

Shown only when asked: the commands pass ``enabled`` from ``--progress`` (``auto``: only on rank 0 and
only when stderr is a terminal, like tqdm's own default and pytest's live output; ``on``: always on
rank 0, e.g. in a CI log; ``off``: never). Non-zero ranks never draw, so ``torchrun`` output shows one
bar. The bar draws on stderr so stdout stays the command's result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from tqdm import tqdm

StepCallback = Callable[[str], None]
"""Called once after every step with the phase it belonged to (``"warmup"``, ``"timed"``, or any
label a command gives its extra steps, e.g. ``"memory"``)."""


@contextlib.contextmanager
def step_progress(
    warmup: int, reps: int, *, enabled: bool, desc: str = "steps", extra: int = 0,
) -> Iterator[StepCallback | None]:
    """Yield a :data:`StepCallback` advancing one bar over ``warmup + reps + extra`` steps (``extra``:
    steps a command runs after timing, e.g. one for the peak memory), or None when disabled.

    The postfix names the phase of the step just done; the ETA comes from the steps done so far
    (warm-up steps are usually slower, so the ETA improves once timing starts).
    """
    if not enabled:
        yield None
        return
    with tqdm(total=warmup + reps + extra, desc=desc, unit="step", dynamic_ncols=True, leave=False) as bar:

        def advance(phase: str) -> None:
            bar.set_postfix_str(phase, refresh=False)
            bar.update(1)

        yield advance
