"""`tapestry.optimize`: saturate, extract under a cost model, decode a plan. The scripting API."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tapestry.cost import CostModel, DefaultCostModel, load_profile
from tapestry.egraph.decode import Decoder, distributed_nodes
from tapestry.egraph.driver import Budget, IterationStats, SaturationStats, saturate
from tapestry.egraph.rules import RuleFile, load_rules
from tapestry.extract import Selection, extract, validate
from tapestry.graph import Graph
from tapestry.plan import Plan
from tapestry.plan.explain import explain as explain_plan
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class OptimizeResult:
    plan: Plan
    stats: SaturationStats
    selection: Selection
    rule_files: tuple[RuleFile, ...]
    egraph_json: dict[str, Any] = field(repr=False)

    def explain(self) -> str:
        """The plan step by step, each compute with the graph op or rule that produced its kernel."""
        head = [
            f"mesh {self.plan.mesh}: {len(self.plan.steps)} steps, predicted {self.plan.cost:.6g} s "
            f"({self.selection.extractor}, {self.selection.status})",
            f"saturation: {len(self.stats.iterations)} iterations, {self.stats.enodes} e-nodes, "
            f"stopped by {self.stats.stopped_by}",
        ]
        return "\n".join(head) + "\n" + explain_plan(self.plan)

    def render_egraph(self, path: str | Path, max_nodes: int = 400) -> Path:
        """An SVG/PNG of the e-graph, for small ones (a big one is unreadable and slow to lay out)."""
        from tapestry.egraph.render import egraph_to_dot
        from tapestry.graph.render import write_picture

        return write_picture(egraph_to_dot(self.egraph_json, max_nodes), path)


def default_cost_model() -> CostModel:
    return DefaultCostModel(load_profile("cpu-gloo"))


def optimize(
    graph: Graph,
    mesh: Mesh | int = 1,
    rules: Sequence[str | Path] | None = None,
    budget: Budget = Budget(),
    cost_model: CostModel | None = None,
    extractor: str = "ilp",
    time_limit: float = 10.0,
    progress: Callable[[IterationStats], None] | None = None,
) -> OptimizeResult:
    """Find the cheapest plan for `graph` on `mesh` among everything the rules and sharding allow.

    `rules` are rule files or directories (default: the package's rules/).
    """
    mesh = Mesh(mesh) if isinstance(mesh, int) else mesh
    rule_files = load_rules(rules)
    gen, _, stats = saturate(graph, mesh, rule_files, budget, progress)
    data = gen.session.serialize()
    nodes, roots, names = distributed_nodes(data)
    decoder = Decoder(nodes, gen.interner, mesh)
    egraph = decoder.extraction_graph(roots, cost_model or default_cost_model())
    selection = extract(egraph, extractor, time_limit)
    problems = validate(egraph, selection)
    if problems:
        raise AssertionError(f"extractor {extractor} returned an invalid selection: {problems[0]}")
    plan = decoder.plan(egraph, selection, graph, names)
    return OptimizeResult(plan, stats, selection, tuple(rule_files), data)
