"""The `tapestry` command line.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers)``. This file lists them with their one-line help, and
imports only the module of the command that runs: the command modules pull in
torch, egglog and ortools, which took `tapestry --help` 4 seconds.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """Where a subcommand is registered, its help line, and the optional packages its module imports."""

    module: str
    help: str
    needs: tuple[str, ...] = ()


# The help lines repeat the modules' own; tests/test_cli.py checks that they agree.
COMMANDS: dict[str, Command] = {
    "show": Command("tapestry.graph.command", "draw a graph or plan JSON as SVG/PNG/PDF (or .dot)", ("graphviz",)),
    "extract": Command("tapestry.extract.command",
                       "extract the cheapest acyclic selection from a serialized e-graph", ("ortools",)),
    "cost": Command("tapestry.cost.command", "show a kernel's FLOP and byte formulas and the predicted time of each "
                    "candidate partition"),
    "calibrate": Command("tapestry.cost.command", "measure this machine (one core per device, gloo on loopback; or GPUs and nccl) into a "
                      "profile JSON"),
    "explain": Command("tapestry.plan.command", "print a plan step by step: blocks, layouts, communication",
                       ("graphviz",)),
    "check-rules": Command("tapestry.testing.command",
                           "check that every rewrite rule preserves values, on random well-typed inputs"),
    "optimize": Command("tapestry.optimize_command", "find the cheapest plan for a graph on a mesh",
                        ("egglog", "graphviz")),
    "schema": Command("tapestry.optimize_command", "print the egglog schema generated from the kernel registry",
                      ("egglog", "graphviz")),
    "prove": Command("tapestry.prove", "prove two graphs equal by saturating them together with the rule files",
                     ("egglog",)),
    "run": Command("tapestry.runtime.command", "run a plan or a graph script on N ranks (gloo or nccl)"),
    "lower": Command("tapestry.runtime.command", "print the per-rank programs of a plan"),
    "import-report": Command("tapestry.importer.command", "report what importing a PyTorch model makes of it: "
                             "kernels, opaque ops and why, FLOPs that can shard"),
}

# The modules whose commands are offered (tests narrow it to the command they drive).
COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(command.module for command in COMMANDS.values()))


# Packages only the optimiser and the pictures need. A machine that only runs saved plans (a GPU node) may lack
# them: the commands that need one are left out there, and `--help` says which and why.
OPTIONAL_PACKAGES = frozenset({"egglog", "islpy", "ortools", "graphviz"})


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # an import hook that refuses it, or a half-installed package
        return False


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the chosen command's module registers its parsers, the others are help lines."""
    parser = argparse.ArgumentParser(
        prog="tapestry",
        description="Shard, fuse and substitute tensor block programs, then run them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((word for word in argv or () if not word.startswith("-")), None)
    offered = {name: command for name, command in COMMANDS.items() if command.module in COMMAND_MODULES}
    missing = {name: absent for name, command in offered.items()
               if (absent := next((p for p in command.needs if not _installed(p)), None)) is not None}
    if chosen in missing:
        parser.error(f"{chosen} needs the package {missing[chosen]}, which is not installed here")
    if chosen in offered:
        importlib.import_module(offered[chosen].module).register(sub)
    for name, command in offered.items():
        if name not in missing and name not in sub.choices:
            sub.add_parser(name, help=command.help)
    if missing:
        parser.epilog = "left out here, for want of a package: " + ", ".join(
            f"{name} ({package})" for name, package in missing.items())
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as err:
        print(f"tapestry {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
