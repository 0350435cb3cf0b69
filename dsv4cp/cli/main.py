"""The ``dsv4cp`` command: one sub-command per module of this package (``dsv4cp <cmd> --help``)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command name -> module under dsv4cp.cli defining ``add_arguments(parser)`` and ``run(args) -> int``.
# Modules are imported lazily so that ``dsv4cp env`` works even when a heavy optional import fails.
COMMANDS: dict[str, str] = {
    "env": "env",
    "layer": "layer",
    "check-cp": "check_cp",
    "profile": "profile",
    "overlap": "overlap",
    "model": "model",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4cp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"dsv4cp.cli.{module_name}")
        cmd = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"dsv4cp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
