"""A thin wrapper over egglog's bindings: schema and rules as text, bulk facts as AST.

Bulk insertion builds bindings AST directly (no text parsing, which is
superlinear in program size) and sends it in chunks. Every egglog failure,
including Rust panics, surfaces as EgglogError rather than a raw panic.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from egglog import bindings as b

from tapestry.egraph.rules import RuleFile, rules_program
from tapestry.egraph.schema import schema_text

_SPAN = b.PanicSpan()
CHUNK = 200
Term = Any  # a bindings expression


class EgglogError(RuntimeError):
    """egglog refused a command: a Tapestry bug, never a user error (those are caught earlier)."""


def call(name: str, *args: Term) -> Term:
    return b.Call(_SPAN, name, list(args))


def lit(value: int | float | str) -> Term:
    if isinstance(value, str):
        return b.Lit(_SPAN, b.String(value))
    return b.Lit(_SPAN, b.Float(value) if isinstance(value, float) else b.Int(int(value)))


def union(a: Term, c: Term) -> Any:
    return b.ActionCommand(b.Union(_SPAN, a, c))


def add(term: Term) -> Any:
    """The action that adds `term` to the e-graph (its class, with no other member)."""
    return b.ActionCommand(b.Expr_(_SPAN, term))


def set_value(function: str, args: Sequence[Term], value: Term) -> Any:
    return b.ActionCommand(b.Set(_SPAN, function, list(args), value))


def _run(run: Callable[[], list[Any]]) -> list[Any]:
    try:
        return run()
    except BaseException as err:  # egglog's Rust panics derive from BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise EgglogError(" ".join(lines) or type(err).__name__) from err


class Session:
    def __init__(self, rule_files: Sequence[RuleFile]) -> None:
        self.egraph = b.EGraph()
        self.rule_files = tuple(rule_files)
        self._inserts = 0  # one-shot rulesets made by insert
        self.text(schema_text())
        self.text(rules_program(self.rule_files))

    def text(self, program: str) -> list[Any]:
        if not program.strip():
            return []
        return _run(lambda: self.egraph.run_program(*self.egraph.parse_program(program)))

    def insert(self, commands: Sequence[Any]) -> None:
        """Action commands (union, set), CHUNK at a time, each chunk as the actions of one rule with no premise,
        run once: 3-4 times faster than as top-level commands (egglog's per-command overhead)."""
        for i in range(0, len(commands), CHUNK):
            name = f"insert{self._inserts}"
            self._inserts += 1
            actions = [command.action for command in commands[i : i + CHUNK]]
            _run(lambda: self.egraph.run_program(
                b.AddRuleset(_SPAN, name), b.RuleCommand(b.Rule(_SPAN, actions, [], name, name)),
                b.RunSchedule(b.Repeat(_SPAN, 1, b.Run(_SPAN, b.RunConfig(name, None))))))

    def run_ruleset(self, name: str) -> tuple[dict[str, int], bool]:
        """One iteration of a ruleset: matches per rule (keyed by the rule's egglog text), and
        whether the e-graph changed."""
        (out,) = self.text(f"(run-schedule (run {name}))")
        return dict(out.report.num_matches_per_rule), bool(out.report.updated)

    def serialize(self) -> dict[str, Any]:
        return json.loads(self.egraph.serialize([]).to_json())

    def size(self) -> int:
        """Rows in every table: the e-node count budgets are measured in."""
        (out,) = self.text("(print-size)")
        return sum(n for _, n in out.sizes)
