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

from dsv4cp.cli.common import EXIT_CODES_HELP, HelpFormatter, run_command

# Sub-command name -> module under dsv4cp.cli defining ``HELP``, ``add_arguments(parser)`` and
# ``run(args) -> int``. Modules are imported when the parser is built, in this order.
COMMANDS: dict[str, str] = {
    "env": "env",
    "layer": "layer",
    "check-cp": "check_cp",
    "check-determinism": "check_determinism",
    "profile": "profile",
    "overlap": "overlap",
    "model": "model",
    "sweep": "sweep",
    "report": "report",
    "compare": "compare",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4cp", description=__doc__, epilog=EXIT_CODES_HELP,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"dsv4cp.cli.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.__doc__, epilog=EXIT_CODES_HELP,
                             formatter_class=HelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code.

    Usage errors exit through argparse (code 2); see :data:`EXIT_CODES_HELP` for the others.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv  # a command that re-runs itself in a fresh process (check-determinism) passes these on
    return run_command(args.command, lambda: args._run(args))


if __name__ == "__main__":
    sys.exit(main())
