"""The saturation driver: alternate rule-file rulesets with generation passes, under hard budgets."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from tapestry.egraph.generate import Generator, View
from tapestry.egraph.rules import Rule, RuleFile
from tapestry.egraph.session import Session
from tapestry.graph import Graph
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class Budget:
    """Saturation stops at the first budget reached; the result says which."""

    nodes: int = 200_000
    seconds: float = 30.0
    iterations: int = 20


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    enodes: int
    eclasses: int
    new_logical_nodes: int
    matches: dict[str, int]  # rule (file:line) -> matches
    seconds: float


@dataclass(frozen=True)
class SaturationStats:
    iterations: tuple[IterationStats, ...]
    stopped_by: str  # "fixpoint", "nodes", "seconds" or "iterations"
    seconds: float
    ill_typed: dict[str, str] = field(default_factory=dict)

    @property
    def enodes(self) -> int:
        return self.iterations[-1].enodes if self.iterations else 0

    @property
    def eclasses(self) -> int:
        return self.iterations[-1].eclasses if self.iterations else 0

    def to_json(self) -> dict:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _rule_index(files: Sequence[RuleFile]) -> dict[str, Rule]:
    """Each rule under the names egglog's run report counts its matches by (file:line, see Rule.report_keys)."""
    return {key: rule for f in files for rule in f.rules for key in rule.report_keys}


def saturate(
    graph: Graph,
    mesh: Mesh,
    rule_files: Sequence[RuleFile],
    budget: Budget = Budget(),
    progress: Callable[[IterationStats], None] | None = None,
) -> tuple[Generator, View, SaturationStats]:
    graph.check_plannable()
    started = time.perf_counter()
    session = Session(rule_files)
    gen = Generator(session, graph, mesh)
    gen.encode()
    rules = _rule_index(rule_files)
    history: list[IterationStats] = []
    fired: list[Rule] = []
    stopped_by, changed = "iterations", True
    for iteration in range(budget.iterations + 1):
        tick = time.perf_counter()
        view, new_nodes = gen.refresh(fired, iteration)
        size = session.size()
        matches: dict[str, int] = {}
        stop = _stop_reason(budget, started, size, iteration, new_nodes or changed)
        if stop is None:
            changed = False
            for f in rule_files:
                if f.iterations is not None and iteration >= f.iterations:
                    continue  # a bounded ruleset (merges, algebra) has had its rounds
                found, updated = session.run_ruleset(f.name)
                matches.update(found)
                changed |= updated
            fired = list(dict.fromkeys(rules[k] for k, n in matches.items() if n and k in rules))
        stats = IterationStats(
            iteration, size, len(view.handles) + len(view.at_classes), new_nodes,
            {rules[k].where: n for k, n in matches.items() if k in rules and n}, time.perf_counter() - tick,
        )
        history.append(stats)
        if progress:
            progress(stats)
        if stop is not None:
            stopped_by = stop
            break
    return gen, view, SaturationStats(tuple(history), stopped_by, time.perf_counter() - started, dict(gen.ill_typed))


def _stop_reason(budget: Budget, started: float, size: int, iteration: int, growing: bool) -> str | None:
    if not growing:
        return "fixpoint"
    if size >= budget.nodes:
        return "nodes"
    if time.perf_counter() - started >= budget.seconds:
        return "seconds"
    if iteration >= budget.iterations:
        return "iterations"
    return None
