"""The `tapestry` command line.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers)``; this file only lists them, so adding a command never
means editing another command's code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES: tuple[str, ...] = (
    "tapestry.graph.command",
    "tapestry.extract.command",
    "tapestry.cost.command",
    "tapestry.plan.command",
    "tapestry.testing.command",
    "tapestry.egraph.command",
    "tapestry.runtime.command",
)


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tapestry",
        description="Shard, fuse and substitute tensor block programs, then run them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as err:
        print(f"tapestry {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
