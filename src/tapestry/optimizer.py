"""`tapestry.optimize`: saturate, extract under a cost model, decode a plan. The scripting API.

One saturation can serve many extractions: `explore` returns the saturated
e-graph, and its `extract` and `pareto` price it under different objectives.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tapestry.cost import CostModel, DefaultCostModel, held_bytes, load_profile, peak_memory
from tapestry.egraph.decode import Decoder, distributed_nodes
from tapestry.egraph.driver import Budget, IterationStats, SaturationStats, saturate
from tapestry.egraph.rules import RuleFile, load_rules
from tapestry.extract import Selection, extract, validate
from tapestry.graph import Graph
from tapestry.plan import Plan, Step
from tapestry.plan.explain import explain as explain_plan
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.verify import CHECK_CELLS, cells, check_meaning


@dataclass(frozen=True)
class OptimizeResult:
    plan: Plan
    stats: SaturationStats
    selection: Selection
    rule_files: tuple[RuleFile, ...]
    egraph_json: dict[str, Any] = field(repr=False)

    @property
    def peak_memory(self) -> int:
        """Most bytes any one device holds at once."""
        return max(peak_memory(self.plan))

    def explain(self) -> str:
        """The plan step by step, each compute with the graph op or rule that produced its kernel."""
        head = [
            f"mesh {self.plan.mesh}: {len(self.plan.steps)} steps, predicted {self.plan.cost:.6g} s, "
            f"peak {self.peak_memory:,} bytes per device ({self.selection.extractor}, {self.selection.status})",
            f"saturation: {len(self.stats.iterations)} iterations, {self.stats.enodes} e-nodes, "
            f"stopped by {self.stats.stopped_by}",
        ]
        return "\n".join(head) + "\n" + explain_plan(self.plan)

    def render_egraph(self, path: str | Path, max_nodes: int = 400) -> Path:
        """An SVG/PNG of the e-graph, for small ones (a big one is unreadable and slow to lay out)."""
        from tapestry.egraph.render import egraph_to_dot
        from tapestry.graph.render import write_picture

        return write_picture(egraph_to_dot(self.egraph_json, max_nodes), path)


@dataclass(frozen=True)
class MemoryWeighted:
    """time + weight × bytes the step adds on its fullest device: a scalarisation of the two objectives."""

    base: CostModel
    weight: float

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        return self.base.step_cost(step, mesh) + self.weight * max(held_bytes(step), default=0)


def default_cost_model() -> CostModel:
    return DefaultCostModel(load_profile("cpu-gloo"))


@dataclass(frozen=True)
class Explored:
    """A saturated e-graph, ready to extract under any cost model."""

    graph: Graph
    mesh: Mesh
    decoder: Decoder
    roots: tuple[str, ...]
    names: dict[str, str]
    stats: SaturationStats
    rule_files: tuple[RuleFile, ...]
    data: dict[str, Any] = field(repr=False)

    def extract(self, cost_model: CostModel | None = None, extractor: str = "ilp",
                time_limit: float = 10.0) -> OptimizeResult:
        model = cost_model or default_cost_model()
        egraph = self.decoder.extraction_graph(list(self.roots), model)
        selection = extract(egraph, extractor, time_limit)
        problems = validate(egraph, selection)
        if problems:
            raise AssertionError(f"extractor {extractor} returned an invalid selection: {problems[0]}")
        plan = self.decoder.plan(egraph, selection, self.graph, self.names)
        validate_plan(plan)  # exact: partitions, covered reads, possible moves (islpy)
        if cells(self.graph) <= CHECK_CELLS:
            check_meaning(plan)  # a rule that passed check-rules can still be wrong where it was not drawn
        if isinstance(model, MemoryWeighted):  # report time, not the scalarised objective
            plan = Plan(plan.mesh, plan.graph, plan.steps, plan.outputs,
                        sum(model.base.step_cost(s, self.mesh) for s in plan.steps), plan.notes)
        return OptimizeResult(plan, self.stats, selection, self.rule_files, self.data)

    def pareto(self, cost_model: CostModel | None = None, extractor: str = "ilp", time_limit: float = 10.0,
               weights: Sequence[float] = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)) -> list[OptimizeResult]:
        """Plans not beaten on both predicted time and peak memory, fastest first.

        Weights are relative to the fastest plan's seconds per byte held. A weighted sum finds
        the points on the front's convex hull; points in its dents can be missed.
        """
        base = cost_model or default_cost_model()
        fastest = self.extract(base, extractor, time_limit)
        scale = (fastest.plan.cost or 1e-9) / max(fastest.peak_memory, 1)
        found = [fastest] + [self.extract(MemoryWeighted(base, w * scale), extractor, time_limit)
                             for w in weights if w > 0]
        front: list[OptimizeResult] = []
        for r in sorted(found, key=lambda r: (r.plan.cost, r.peak_memory)):
            if not front or r.peak_memory < front[-1].peak_memory:
                front.append(r)
        return front

    def fastest_within(self, memory_budget: int, cost_model: CostModel | None = None, extractor: str = "ilp",
                       time_limit: float = 10.0) -> OptimizeResult:
        """The fastest plan on the time/memory front that fits `memory_budget` bytes per device."""
        front = self.pareto(cost_model, extractor, time_limit)
        fitting = [r for r in front if r.peak_memory <= memory_budget]
        if not fitting:
            raise MemoryBudgetError(
                f"no plan fits {memory_budget:,} bytes per device; the leanest found needs {front[-1].peak_memory:,}"
            )
        return fitting[0]


class MemoryBudgetError(ValueError):
    """No plan found fits the per-device memory budget."""


def explore(graph: Graph, mesh: Mesh | int = 1, rules: Sequence[str | Path] | None = None,
            budget: Budget = Budget(), progress: Callable[[IterationStats], None] | None = None) -> Explored:
    """Saturate: every sharding, fusion and substitution the rules and signatures allow, in one e-graph."""
    mesh = Mesh(mesh) if isinstance(mesh, int) else mesh
    rule_files = load_rules(rules)
    gen, _, stats = saturate(graph, mesh, rule_files, budget, progress)
    data = gen.session.serialize()
    nodes, roots, names = distributed_nodes(data)
    return Explored(graph, mesh, Decoder(nodes, gen.interner, mesh), tuple(roots), names, stats,
                    tuple(rule_files), data)


def optimize(
    graph: Graph,
    mesh: Mesh | int = 1,
    rules: Sequence[str | Path] | None = None,
    budget: Budget = Budget(),
    cost_model: CostModel | None = None,
    extractor: str = "ilp",
    time_limit: float = 10.0,
    progress: Callable[[IterationStats], None] | None = None,
    memory_budget: int | None = None,
) -> OptimizeResult:
    """Find the cheapest plan for `graph` on `mesh` among everything the rules and sharding allow.

    `rules` are rule files or directories (default: the package's rules/). With `memory_budget`
    (bytes per device), the fastest plan on the time/memory front that fits is returned.
    """
    explored = explore(graph, mesh, rules, budget, progress)
    if memory_budget is None:
        return explored.extract(cost_model, extractor, time_limit)
    return explored.fastest_within(memory_budget, cost_model, extractor, time_limit)
