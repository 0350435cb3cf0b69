"""Whether this process is one of torchrun's ranks, read from its environment alone: a command asks it
before it knows whether it needs torch (``dsv4cp sweep --dry-run`` never does)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """True in a process torchrun started (its run id, or a rank and world size, are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
