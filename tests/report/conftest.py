"""Fixtures of the report tests: synthetic run directories (see ``report_helpers``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so the tests can `import report_helpers`
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "profiling"))  # and the trace builders `prof_helpers`

from report_helpers import SCALING_POINTS, write_run  # noqa: E402


@pytest.fixture
def scaling_run(tmp_path: Path, seed: int) -> Path:
    """A strong-scaling run on "2xNVIDIA H200" whose last point ran out of memory."""
    return write_run(tmp_path / "scaling", SCALING_POINTS, seed=seed, statuses={len(SCALING_POINTS) - 1: "oom"})
