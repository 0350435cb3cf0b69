"""The kernel guide's table of kernel options (docs/guide/kernels.md) is the registry's (a missing, extra
or changed option fails), and the user-facing docs name no kernel-option variable or ``--kernel-option``
name that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from dsv4cp.cli.env import options_markdown
from dsv4cp.kernel_options import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- kernel-options-table -->\n(.*?)\n<!-- /kernel-options-table -->", re.DOTALL)
OPTION_VARIABLE = re.compile(r"DSV4CP_(?:TOPK|TRITON)_[A-Z0-9_]+")
ASSIGNED_NAME = re.compile(r"--kernel-option[ =]([a-z0-9_]+)=")
TABLE_DOC = "docs/guide/kernels.md"
USER_DOCS = ["README.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*.md"))]


def test_guide_table_is_the_registry():
    tables = TABLE.findall((ROOT / TABLE_DOC).read_text())
    assert len(tables) == 1, f"{TABLE_DOC} must hold one kernel-options table between its markers"
    assert tables[0] == options_markdown(), (
        f"{TABLE_DOC}'s kernel-options table differs from the registry; regenerate it with "
        "python -c 'from dsv4cp.cli.env import options_markdown; print(options_markdown())'")
    for name in OPTIONS:
        assert f"| `{name}` |" in tables[0], name


def test_docs_name_only_existing_options():
    variables = {option.env for option in OPTIONS.values()}
    assert TABLE_DOC in USER_DOCS
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        unknown = sorted(set(OPTION_VARIABLE.findall(text)) - variables)
        assert unknown == [], f"{doc} names variables no kernel option honours: {unknown}"
        unknown = sorted(set(ASSIGNED_NAME.findall(text)) - set(OPTIONS))
        assert unknown == [], f"{doc} sets kernel options that do not exist: {unknown}"


def test_the_checks_catch_a_stale_table():
    stale = options_markdown().replace("| `topk_keys` |", "| `topk_buffer` |")
    assert stale != options_markdown()
    assert "DSV4CP_TOPK_BUFFER" not in {option.env for option in OPTIONS.values()}
    assert OPTION_VARIABLE.findall("set DSV4CP_TOPK_BUFFER=1") == ["DSV4CP_TOPK_BUFFER"]
