"""Equivalence by saturation: do two programs compute the same outputs under the rule files?

Both graphs go into one e-graph over their shared inputs, the rule files saturate it, and a pair of
same-named outputs is proven equal when it ends in one e-class. This is how Tensat checks its rules against
its axioms, and a symbolic second opinion beside check-rules' random tests: a proof holds for every input,
and a failure means only that the rules (within the budget) did not find a derivation.

    result = tapestry.equivalent(a, b)          # truthy when every output pair is proven
    result.rules                                # the rules that fired, round by round
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tapestry.egraph.driver import Budget, saturate
from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR, load_rules
from tapestry.graph import Graph, GraphError, load_graph
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class Equivalence:
    outputs: dict[str, bool]  # output name -> proven equal
    rounds: int
    rules: tuple[tuple[str, ...], ...]  # per round, the rules (file:line) that fired
    stopped_by: str

    @property
    def proven(self) -> bool:
        return all(self.outputs.values())

    def __bool__(self) -> bool:
        return self.proven

    def __str__(self) -> str:
        lines = [f"{name}: {'proven equal' if ok else 'not proven'}" for name, ok in self.outputs.items()]
        fired = [f"  round {i}: {', '.join(r)}" for i, r in enumerate(self.rules) if r]
        return "\n".join([*lines, f"{self.rounds} rounds, stopped by {self.stopped_by}",
                          *(["rules that fired:", *fired] if fired else [])])


def _check_same_interface(a: Graph, b: Graph) -> None:
    ins = {(n.name, n.shape, n.dtype) for n in a.inputs}, {(n.name, n.shape, n.dtype) for n in b.inputs}
    if ins[0] != ins[1]:
        raise GraphError(f"the graphs' inputs differ: only in the first {sorted(ins[0] - ins[1])}, "
                         f"only in the second {sorted(ins[1] - ins[0])}")
    if set(a.outputs) != set(b.outputs):
        raise GraphError(f"the graphs' outputs differ: {sorted(a.outputs)} and {sorted(b.outputs)}")
    if not a.outputs:
        raise GraphError("the graphs have no outputs to compare")


def _same_input(a: Graph, b: Graph, name: str) -> bool:
    """One leaf for both programs only when the input means the same in both: a free input in both, or a constant
    with the same values in both (a constant's value is part of the program: x + [1, 2, 3] is not x + [4, 5, 6])."""
    ca, cb = a.constants.get(name), b.constants.get(name)
    if ca is None or cb is None:
        return ca is None and cb is None
    return ca.dtype == cb.dtype and np.array_equal(ca, cb, equal_nan=ca.dtype.kind == "f")


def _joined(a: Graph, b: Graph) -> Graph:
    """One graph holding both programs over the shared inputs; ops and outputs prefixed a. and b., and so are the
    inputs that mean different things in the two (constants with different values: leaves the rules cannot equate)."""
    joined = Graph()
    shared = [n.name for n in a.inputs if _same_input(a, b, n.name)]  # in the graph's order: no hash-seed order
    for name in shared:
        joined.input(name, a[name].shape, a[name].dtype)
    for prefix, graph in (("a", a), ("b", b)):
        rename = {n.name: n.name if n.name in shared else f"{prefix}.{n.name}" for n in graph.inputs}
        for node in graph.inputs:
            if node.name not in shared:
                joined.input(rename[node.name], node.shape, node.dtype)
        rename |= {n.name: f"{prefix}.{n.name}" for n in graph.ops}
        for node in graph.ops:
            joined.op(node.op, *(rename[x] for x in node.args), name=rename[node.name], **dict(node.params))
        for name, target in graph.outputs.items():
            joined.output(f"{prefix}.{name}", rename[target])
    return joined


PROOF_RULES = (BUILTIN_DIR, TASO_DIR)  # the default rules and TASO's algebra


def equivalent(a: Graph, b: Graph, rules: Sequence[str | Path] | None = None,
               budget: Budget = Budget(seconds=10, iterations=12)) -> Equivalence:
    """Saturate both graphs together with `rules` (default: PROOF_RULES, every shipped rule file) within
    `budget`."""
    _check_same_interface(a, b)
    generator, _, stats = saturate(_joined(a, b), Mesh(1), load_rules(PROOF_RULES if rules is None else rules),
                                   budget)
    handles = generator.output_handles
    outputs = {name: generator.find(handles[f"a.{name}"]) == generator.find(handles[f"b.{name}"])
               for name in a.outputs}
    fired = tuple(tuple(sorted(it.matches)) for it in stats.iterations)
    return Equivalence(outputs, len(stats.iterations), fired, stats.stopped_by)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prove", help="prove two graphs equal by saturating them together with the rule files")
    p.add_argument("first", type=Path, help="GRAPH.json")
    p.add_argument("second", type=Path, help="GRAPH.json with the same inputs and output names")
    p.add_argument("--rules", type=Path, action="append", help="rule file or directory (default: the shipped ones, rules/taso/ included)")
    p.add_argument("--budget-seconds", type=float, default=10.0)
    p.set_defaults(func=_prove)


def _prove(args: argparse.Namespace) -> int:
    result = equivalent(load_graph(args.first), load_graph(args.second), args.rules,
                        Budget(seconds=args.budget_seconds, iterations=12))
    print(result)
    print(json.dumps({"proven": result.proven, "outputs": result.outputs, "rounds": result.rounds}))
    return 0 if result.proven else 1
