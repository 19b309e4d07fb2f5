"""Each distinct selection decoded once: its plan in the leaner of its two step orders (`budget.leaner`), the node
each step comes from and its exact peaks per device, and the plan's time under a cost model.

An extraction under a memory budget decodes every fit's selection and walks its ranks for the exact peak
(`Explored._unbound`, the memory-cut rounds), and prices the plan (plan_cost); its fits (the first, fused prices,
the overlap sweep's weights) can choose the same selection under other node costs, and their selections share most
of their steps, whose lowering was most of a peak's CPU (`cost.memory.Lowerings`, kept across the plans walked).
Node n is e-node n in every extraction graph of one decoder, so the roots and the chosen nodes name the plan
(as `FoldedCandidates.decode` keys its expansions).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tapestry.cost import CostModel, RankPeak, plan_cost
from tapestry.cost.memory import Lowerings
from tapestry.egraph.budget import chosen_floor, leaner
from tapestry.egraph.decode import Decoder
from tapestry.egraph.embed import hand_name
from tapestry.egraph.layered import Layered
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection
from tapestry.graph import Graph
from tapestry.plan import Plan

# plans kept: an extraction fits up to four objectives, each tried unbudgeted first and then under its budget
KEPT = 8

Decoded = tuple[Plan, list[int], list[RankPeak]]


def plan_key(egraph: ExtractGraph, selection: Selection) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What names a selection's plan among the decoder's extraction graphs: their roots and the chosen nodes."""
    return tuple(egraph.roots), tuple(sorted(selection.choice.values()))


@dataclass(eq=False)
class LeanPlans:
    """The last `kept` selections' decoded plans in their leaner order with their peaks, by `plan_key`, and the
    plan_cost of each plan's steps under each model asked. A plan is of `graph` (the decoder's, `names` its root
    e-classes' output names), or of the whole graph where `expand` (a folded graph's, `layered`) decodes it."""

    decoder: Decoder
    graph: Graph
    names: dict[str, str]
    layered: Layered | None = None
    expand: Callable[[ExtractGraph, Selection], tuple[Plan, list[int]]] | None = None
    kept: int = KEPT
    lowerings: Lowerings = field(default_factory=Lowerings, repr=False)  # plans' steps lowered (a fold's: shared)
    _made: dict[tuple, Decoded] = field(default_factory=dict, init=False, repr=False)
    _costs: dict[tuple[int, ...], tuple[Any, CostModel, float]] = field(default_factory=dict, init=False, repr=False)

    def decode(self, egraph: ExtractGraph, selection: Selection) -> tuple[Plan, list[int]]:
        """The selection's plan, and the node each step comes from (not kept: a plan without a budget is used as
        decoded, no peaks walked)."""
        if self.expand is not None:
            return self.expand(egraph, selection)
        return self.decoder.plan(egraph, selection, self.graph, self.names), self.decoder.step_nodes(egraph, selection)

    def floor(self, selection: Selection) -> list[int]:
        """Per device, a floor under the selection's peak in any step order (`budget.chosen_floor`), undecoded."""
        return chosen_floor(self.decoder, self.graph, self.layered, selection.choice)

    def leaner(self, egraph: ExtractGraph, selection: Selection) -> Decoded:
        """`budget.leaner` of the selection's decoded plan, decoded and walked once while kept; the plan's cost and
        notes are the selection's (its node-cost sum, extractor and status), as a fresh decode gives them."""
        key = plan_key(egraph, selection)
        made = self._made.pop(key, None)  # put back last: the least recently asked go first
        if made is None:
            made = leaner(*self.decode(egraph, selection), self.lowerings)
        self._made[key] = made
        while len(self._made) > self.kept:
            del self._made[next(iter(self._made))]
        plan, nodes, peaks = made
        return replace(plan, cost=selection.dag_cost, notes={**plan.notes, **Decoder.notes(selection)}), nodes, peaks

    def hand(self, egraph: ExtractGraph, selection: Selection, hands: Mapping[str, Plan]
             ) -> tuple[Plan, list[RankPeak]]:
        """`leaner`'s plan and peaks, or where the selection embeds one of `hands` (egraph.embed: extractor "hand
        plan (name)") that peaks lower as built (in its own step order, or `budget.leaner`'s), that plan: the
        decoder's order, each output's steps children first in turn, can hold a program's loss-sized values
        together (ZeRO-3 of a tiny LLaMA step on Mesh(2): 4.60 MB decoded, 3.85 MB in the program's order)."""
        plan, _, peaks = self.leaner(egraph, selection)
        built = hands.get(hand_name(selection.extractor) or "")
        if built is None:
            return plan, peaks
        own, _, own_peaks = leaner(built, list(range(len(built.steps))), self.lowerings)
        if max(p.bytes for p in own_peaks) >= max(p.bytes for p in peaks):
            return plan, peaks
        return replace(own, cost=selection.dag_cost, notes={**own.notes, **Decoder.notes(selection)}), own_peaks

    def cost(self, plan: Plan, model: CostModel) -> float:
        """plan_cost(plan, model), once per plan's steps, outputs, graph and model (all a plan_cost reads but the
        mesh, which one decoder's plans share; the plans `leaner` returns for one selection share them); what the
        key names is kept while its cost is, so its ids are not reused."""
        key = (id(plan.steps), id(plan.outputs), id(plan.graph), id(model))
        made = self._costs.get(key)
        if made is None:
            made = self._costs[key] = (plan.steps, plan.outputs, plan.graph), model, plan_cost(plan, model)
            while len(self._costs) > 2 * self.kept:
                del self._costs[next(iter(self._costs))]
        return made[2]
