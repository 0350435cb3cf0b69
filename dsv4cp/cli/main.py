"""Microbenchmarks and profiling of context-parallel DeepSeek-V4 attention.

Run 'dsv4cp COMMAND --help' for a command's options. Examples:

  dsv4cp env
  dsv4cp layer --preset tiny --ratio 4 --tokens 4096 --backward
  dsv4cp check-cp --cp 2 --lengths 5,127,0,300
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile --preset flash --tokens 65536 --backward
  dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from typing import NoReturn

from dsv4cp.cli.common import EXIT_CODES_HELP, EXIT_USAGE, HelpFormatter, kernel_options_in_force, run_command

# Sub-command name -> module under dsv4cp.cli defining ``HELP``, ``add_arguments(parser)`` and
# ``run(args) -> int``. Modules are imported when the parser is built, in this order: only the named
# command's when a command is named (most import torch, which ``sweep --dry-run`` never needs).
COMMANDS: dict[str, str] = {
    "env": "env",
    "layer": "layer",
    "check-cp": "check_cp",
    "check-determinism": "check_determinism",
    "profile": "profile",
    "overlap": "overlap",
    "model": "model",
    "predict": "predict",
    "sweep": "sweep",
    "report": "report",
    "compare": "compare",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors follow the exit-code contract: one line on stderr,
    ``dsv4cp CMD: error: <message> (see 'dsv4cp CMD --help')``, exit code 2 (argparse itself prints
    the whole usage first). Sub-command parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(commands: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The parser of ``commands`` (names of :data:`COMMANDS`; default: all of them)."""
    parser = OneLineErrorParser(prog="dsv4cp", description=__doc__, epilog=EXIT_CODES_HELP,
                                formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in commands:
        module = importlib.import_module(f"dsv4cp.cli.{COMMANDS[name]}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.__doc__, epilog=EXIT_CODES_HELP,
                             formatter_class=HelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run, _parser=cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code.

    Usage errors exit through argparse (code 2, one line: :class:`OneLineErrorParser`); see
    :data:`EXIT_CODES_HELP` for the others.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    named = argv[:1] if argv and argv[0] in COMMANDS else COMMANDS  # anything else: the full list, in help or error
    args, unknown = build_parser(named).parse_known_args(argv)
    if unknown:  # named by the sub-command they were given to, not by the top-level parser
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args._argv = argv  # a command that re-runs itself in a fresh process (check-determinism) passes these on
    return run_command(args.command, lambda: _run_with_kernel_options(args))


def _run_with_kernel_options(args: argparse.Namespace) -> int | None:
    with kernel_options_in_force(args):  # the --kernel-option values, checked before the command starts
        return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
