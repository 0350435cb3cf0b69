"""The package's import layering (``[tool.importlinter]`` in pyproject.toml) holds: ``lint-imports``
passes, so no lower layer imports a higher one and model code reaches kernels only through ``dsv4cp.ops``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    command = shutil.which("lint-imports")
    if command is None:
        pytest.skip("lint-imports is not installed (pip install import-linter)")
    # Run from the repository root: lint-imports reads the contracts from ./pyproject.toml.
    result = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"import contracts broken:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout, result.stdout
