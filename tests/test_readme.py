"""The README and the docs under docs/ stand alone: the layer guide's program runs as written, every
``dsv4cp`` command the user-facing docs show parses with today's command line, the spec reference's example
is a valid spec, and nothing links to files a user cannot open."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv4cp.cli.main import build_parser
from dsv4cp.sweeps.spec import expand, parse_spec

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAYER_GUIDE = ROOT / "docs" / "guide" / "layer.md"
SPEC_REFERENCE = ROOT / "docs" / "spec.md"
# Markdown files a user reads for commands to copy; each must show only commands that parse today.
USER_DOCS = ("README.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*.md")))
COMMAND_DOCS = (*USER_DOCS, "results/README.md", "results/baselines/README.md", "results/runs/cpu-smoke/README.md")
README_MAX_LINES = 150
EXAMPLE_MARKER = re.compile(r"<!-- readme-example: (\S+) -->\n```python\n(.*?)```", re.DOTALL)
FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL_LANGUAGES = ("", "bash", "sh", "console", "shell")
COMMAND_SEPARATORS = ("&&", "||", "|", ";")
ENTRY_MODULES = ("dsv4cp", "dsv4cp.cli.main")  # python -m / torchrun -m targets of the CLI


def _example() -> tuple[str, str]:
    """(path the layer guide names, code) of the guide's runnable program."""
    found = EXAMPLE_MARKER.findall(LAYER_GUIDE.read_text())
    assert len(found) == 1, "docs/guide/layer.md must hold exactly one '<!-- readme-example: PATH -->' python block"
    return found[0]


def _shell_commands(markdown: str) -> list[list[str]]:
    """Every shell command (as argv) of the markdown's shell code blocks: continuation lines joined,
    comments dropped, ``a && b`` / ``a | b`` split into separate commands."""
    commands = []
    for language, body in FENCED_BLOCK.findall(markdown):
        if language not in SHELL_LANGUAGES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            current: list[str] = []
            for token in shlex.split(line, comments=True):
                if token in COMMAND_SEPARATORS:
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
            commands.append(current)
    return [command for command in commands if command]


def _cli_argv(command: list[str]) -> list[str] | None:
    """The arguments after ``dsv4cp`` / ``-m dsv4cp`` (``torchrun ... -m dsv4cp``, ``nsys ... python -m
    dsv4cp``), or None when the command does not run the CLI."""
    words = [word for word in command if "=" not in word or word.startswith("-")]  # drop VAR=value
    if words and words[0] == "dsv4cp":
        return words[1:]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] in ENTRY_MODULES:
            return words[i + 2:]
    return None


def test_cli_argv_extraction_finds_every_form():
    markdown = (
        "```bash\ndsv4cp env  # versions\nFOO=1 dsv4cp layer --ratio 0 && dsv4cp report runs/x\n"
        "torchrun --nproc-per-node 2 -m dsv4cp sweep s.yaml \\\n    --out runs/s\n"
        "python -m pytest -q\n```\n```python\ndsv4cp = 1\n```\n"
    )
    argvs = [_cli_argv(command) for command in _shell_commands(markdown)]
    assert argvs == [["env"], ["layer", "--ratio", "0"], ["report", "runs/x"],
                     ["sweep", "s.yaml", "--out", "runs/s"], None]


def _doc_argvs(doc: str) -> list[list[str]]:
    return [argv for command in _shell_commands((ROOT / doc).read_text()) if (argv := _cli_argv(command))]


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_every_shown_command_parses(doc):
    """A renamed or removed flag in any shown command fails here (argparse exits on it)."""
    bad = []
    for argv in _doc_argvs(doc):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_:
            bad.append(f"dsv4cp {shlex.join(argv)}  (argparse exit {exit_.code})")
    assert not bad, f"{doc} shows commands the CLI rejects:\n" + "\n".join(bad)


def test_the_docs_show_every_command():
    """The extraction must not silently find nothing: the README shows the main job on CPU and on GPUs,
    and the README with the guides shows every sub-command."""
    readme = _doc_argvs("README.md")
    assert ["sweep", "sweeps/smoke.yaml", "--out", "runs/smoke", "--profile"] in readme
    assert ["sweep", "sweeps/cp_scaling.yaml", "--out", "runs/cp_scaling"] in readme
    shown = {argv[0] for doc in USER_DOCS for argv in _doc_argvs(doc)}
    assert shown >= {"env", "layer", "check-cp", "check-determinism", "profile", "overlap", "model", "predict",
                     "sweep", "report", "compare"}


def test_readme_fits_two_screens():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def test_spec_reference_example_is_a_valid_spec():
    """The spec reference's example loads and expands: 3 ratios x 2 cp x 2 zipped (tokens, packing),
    less the 3 points with cp 1 and histogram packing."""
    blocks = [body for language, body in FENCED_BLOCK.findall(SPEC_REFERENCE.read_text()) if language == "yaml"]
    assert len(blocks) == 1
    points = expand(parse_spec(yaml.safe_load(blocks[0])))
    assert len(points) == 9
    assert not any(point.cp == 1 and point.packing == "histogram" for point in points)


def test_a_renamed_flag_is_caught():
    """The check above can fail: a flag renamed today is rejected by the parser."""
    argv = _cli_argv(shlex.split("dsv4cp check-cp --backend nccl"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


UNSHIPPED_REFERENCE = re.compile(r"\.\./shared|DESIGN(\.md| \d)")
"""The design notes the project grew from are not shipped: users get ``docs/design.md §n`` instead."""


@pytest.mark.parametrize("doc", USER_DOCS)
def test_docs_point_only_at_shipped_docs(doc):
    assert not UNSHIPPED_REFERENCE.search((ROOT / doc).read_text()), "refer to docs/design.md sections instead"


def test_package_messages_point_only_at_shipped_docs():
    """Error messages and docstrings a user meets (``help()``, tracebacks) name only shipped files."""
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sorted((ROOT / "dsv4cp").rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if UNSHIPPED_REFERENCE.search(line)]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_doc_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / doc).read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = target.split("#", 1)[0]
        assert ((ROOT / doc).parent / path).exists(), f"{doc} links to {target}, which does not exist"


def test_example_file_is_the_readme_block():
    path, code = _example()
    assert (ROOT / path).read_text() == code, f"{path} and docs/guide/layer.md's program differ"


def test_readme_example_runs_as_written(tmp_path):
    """The layer guide's block, run as a script without a launcher: it spawns 2 gloo ranks (tiny shapes on
    CPU) and rank 0 prints the output shape, the global indexer loss and the input-gradient norm."""
    _, code = _example()
    script = tmp_path / "use_layer.py"
    script.write_text(code)
    env = {key: value for key, value in os.environ.items()
           if key not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    match = re.search(r"cp=2 tiny: out \(4096, 64\) torch\.float32, indexer loss (\S+), \|dx\| (\S+)", done.stdout)
    assert match, done.stdout
    loss, grad_norm = float(match[1]), float(match[2])
    assert math.isfinite(loss) and loss > 0  # a KL divergence of two different distributions
    assert math.isfinite(grad_norm) and grad_norm > 0
