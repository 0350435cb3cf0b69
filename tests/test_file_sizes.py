"""No Python file of the project's code, benchmarks, sweeps, CI or tests is over 800 lines (a file that
long holds more than one concern: split it by concern). ``results/`` is left out: its scripts are
committed records of what ran, kept as they ran."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 800
CHECKED_FOLDERS = ("dsv4cp", "bench", "sweeps", ".ci", "tests")


def files_over(limit: int, root: Path, folders: tuple[str, ...]) -> dict[str, int]:
    """Path (relative to ``root``) -> line count of every ``.py`` file under ``folders`` longer than ``limit``."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            count = len(path.read_bytes().splitlines())
            if count > limit:
                found[path.relative_to(root).as_posix()] = count
    return found


def test_no_python_file_is_over_800_lines():
    assert all((ROOT / folder).is_dir() for folder in CHECKED_FOLDERS)
    over = files_over(MAX_LINES, ROOT, CHECKED_FOLDERS)
    assert not over, f"over {MAX_LINES} lines (split by concern): {over}"


def test_a_file_one_line_over_the_limit_is_named(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "at_limit.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "sub" / "over.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "pkg" / "notes.txt").write_text("x\n" * (MAX_LINES + 1))  # not Python: not checked
    assert files_over(MAX_LINES, tmp_path, ("pkg",)) == {"pkg/sub/over.py": MAX_LINES + 1}
