"""`tapestry check-rules [PATH ...]`: property-test rewrite rules before the optimiser trusts them."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR, RuleFileError, load_rules
from tapestry.testing.rulecheck import RuleVerdict, check_rules


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check-rules",
        help="check that every rewrite rule preserves values, on random well-typed inputs",
        description="Evaluate both sides of each rule on hypothesis-drawn shapes and data; report the shrunk "
        "counterexample of any rule that changes a value or its type. Exit 0: all pass, 1: a rule fails, "
        "2: a rule file cannot be loaded.",
    )
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                   help="rule files or directories of *.egg (default: the package's rules, rules/taso/ included)")
    p.add_argument("--examples", type=int, default=100, metavar="N", help="examples per rule direction (default 100)")
    p.set_defaults(func=run)


def verdict_table(verdicts: list[RuleVerdict]) -> Table:
    table = Table(title="rule checks")
    table.add_column("rule", no_wrap=True)
    table.add_column("rewrite")
    table.add_column("examples", justify="right")
    table.add_column("result")
    for v in verdicts:
        text = f"{v.rule} (both ways)" if v.rule.form == "birewrite" else str(v.rule)
        result = "[green]PASS[/]" if v.passed else "[red]FAIL[/]"
        table.add_row(escape(v.rule.short), escape(text), str(v.examples_run), result)
    return table


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.examples < 1:
        raise ValueError(f"--examples must be at least 1, got {args.examples}")
    try:
        files = load_rules(args.paths or [BUILTIN_DIR, TASO_DIR])
    except RuleFileError as err:
        console.print(f"[red]cannot load rules:[/] {escape(str(err))}", soft_wrap=True)
        return 2
    verdicts = check_rules(files, args.examples)
    if not verdicts:
        where = ", ".join(map(str, args.paths)) or "the package's rules"
        console.print(f"[red]no rules found[/] in {escape(where)}: nothing was checked", soft_wrap=True)
        return 1
    console.print(verdict_table(verdicts))
    failed = [v for v in verdicts if not v.passed]
    for v in failed:
        console.print(f"[red]FAIL[/] {escape(v.counterexample or '')}", soft_wrap=True)
    console.print(f"{len(verdicts) - len(failed)} of {len(verdicts)} rules pass")
    return 1 if failed else 0
