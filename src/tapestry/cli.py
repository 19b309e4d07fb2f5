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


# Packages only the optimiser and the pictures need. A machine that only runs saved plans (a GPU node) may lack
# them: the commands that need one are left out there, and `--help` says which and why.
OPTIONAL_PACKAGES = frozenset({"egglog", "islpy", "ortools", "graphviz"})


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tapestry",
        description="Shard, fuse and substitute tensor block programs, then run them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    missing = {}
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in OPTIONAL_PACKAGES:
                raise
            missing[name] = err.name
            continue
        module.register(sub)
    if missing:
        parser.epilog = "left out here, for want of a package: " + ", ".join(
            f"{name.removeprefix('tapestry.').removesuffix('.command')} commands ({package})"
            for name, package in missing.items())
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
