"""The notebooks execute headless against the committed results and draw their plots."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _execute(name: str) -> list:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook.cells


def _images(cells) -> int:
    return sum("image/png" in out.get("data", {}) for cell in cells for out in cell.get("outputs", []))


@pytest.mark.parametrize(("name", "min_images"), [("01_overview.ipynb", 2), ("02_overlap.ipynb", 3),
                                                  ("03_packing.ipynb", 1)])
def test_notebook_executes_and_draws(name, min_images, monkeypatch):
    for variable in ("DSV4CP_RUNS", "DSV4CP_TRACE"):  # the committed defaults
        monkeypatch.delenv(variable, raising=False)
    cells = _execute(name)
    errors = [out for cell in cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
    assert _images(cells) >= min_images


def test_notebooks_are_committed_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        assert all(not cell.get("outputs") and cell.get("execution_count") is None
                   for cell in notebook.cells if cell.cell_type == "code"), path.name
