"""``results/README.md`` is generated from the folders (``python -m bench.results_index``): the committed
index must be what the generator writes today, and the generator must see a new, renamed or retitled folder."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bench import results_index

ROOT = Path(__file__).resolve().parents[1]


def test_committed_index_is_current():
    assert results_index.main(["--check"]) == 0, "results/README.md is stale: run python -m bench.results_index"


def _tree(tmp_path: Path) -> Path:
    """A small results folder: one dated folder with a README, one with only a run.sh, one run directory."""
    results = tmp_path / "results"
    (results / "2026-12-02-h200-layer-defaults").mkdir(parents=True)
    (results / "2026-12-02-h200-layer-defaults" / "README.md").write_text("# One H200: the layer at its defaults\n")
    (results / "2026-12-02-h200-layer-defaults" / "run.sh").write_text("#!/usr/bin/env bash\n")
    (results / "2026-11-30-cpu-model").mkdir()
    (results / "2026-11-30-cpu-model" / "run.sh").write_text("#!/usr/bin/env bash\n# Model bounds at 64K\n")
    shutil.copytree(ROOT / "results" / "runs" / "cpu-smoke", results / "runs" / "cpu-smoke")
    results_index.main(["--results", str(results)])
    return results


def test_index_lists_every_folder_newest_first(tmp_path):
    text = (_tree(tmp_path) / "README.md").read_text()
    newer, older = text.index("2026-12-02-h200-layer-defaults"), text.index("2026-11-30-cpu-model")
    assert newer < older
    assert "| h200 | One H200: the layer at its defaults |" in text
    assert "| cpu | Model bounds at 64K |" in text  # no README: the run.sh's first comment line
    assert "[`runs/cpu-smoke/`](runs/cpu-smoke/) | `smoke` | CPU |" in text


@pytest.mark.parametrize("change", ["new folder", "retitled"])
def test_a_stale_index_is_caught(tmp_path, change):
    results = _tree(tmp_path)
    if change == "new folder":
        (results / "2026-12-03-h200x2-overlap").mkdir()
        (results / "2026-12-03-h200x2-overlap" / "README.md").write_text("# Two H200s: overlap\n")
    else:
        (results / "2026-12-02-h200-layer-defaults" / "README.md").write_text("# One H200: something else\n")
    assert results_index.main(["--check", "--results", str(results)]) == 1


def test_a_folder_named_by_sequence_is_refused(tmp_path):
    results = _tree(tmp_path)
    (results / "2026-12-03-speed7").mkdir()
    with pytest.raises(SystemExit, match="2026-12-03-speed7: a dated folder is named"):
        results_index.render(results)


ACCESS_WORDS = re.compile(r"\bdevice (call|time)s?\b|\blease\b|\bcarried\b|\bcarry:", re.IGNORECASE)
"""How a machine was reached (the tool that lent it, what travelled to it): not what was measured."""


def test_results_say_what_was_measured_not_how_the_machine_was_reached():
    """The prose and scripts we write (READMEs, run scripts); the tools' own outputs are left as they ran."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "results").rglob("*")) if path.suffix in (".md", ".sh")
             for number, line in enumerate(path.read_text().splitlines(), 1) if ACCESS_WORDS.search(line)]
    assert not found, "\n".join(found[:20])
