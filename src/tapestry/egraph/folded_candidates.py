"""A folded graph's periodic candidates (egraph.layered) expanded onto every layer, ranked, priced, and fitted to a
memory budget: what `tapestry.optimizer.Explored` weighs where it folded the graph.

A candidate's time is its expanded plan's (plan_cost), which takes seconds for a deep model: each choice is
expanded and priced once, the expansions and prices kept by choice. Node n is e-node n in every extraction graph
of the decoder, so a choice names the same plan in the reweighted and pinned graphs too.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

from tapestry.cost import CostModel, DefaultCostModel, plan_cost
from tapestry.cost.memory import Lowerings
from tapestry.cost.model import from_costs, step_costs
from tapestry.cost.overlap import overlap
from tapestry.egraph.budget import MemoryBudgetError, held_at_peak, leaner
from tapestry.egraph.decode import Decoder
from tapestry.egraph.embed import embedded_plans
from tapestry.egraph.layered import Layered
from tapestry.egraph.pins import periodic_selections
from tapestry.extract import DeviceBudget, NoFiniteChoiceError, Selection, Ties, extract
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract.selection import dag_cost
from tapestry.graph import Graph
from tapestry.plan import Place, Plan, Reshard

# The budgeted fallback (`FoldedCandidates.within_budget`) prices memory at up to LEAN_ROUNDS prices, each
# LEAN_STEP times the last, from one at which a budget's worth of bytes costs as much as the cheapest plan's time
LEAN_ROUNDS = 6
LEAN_STEP = 4.0
LEAN_BELOW = 2  # prices tried below the first where that one fits already


def competes(peak: int, limit: int) -> bool:
    """Whether `FoldedCandidates.within_budget`'s rounds compete with a plan chosen without the budget whose exact
    `peak` fits `limit` (a priced round's greedy choice can be faster by plan_cost: the 70B step on 8x8 at 80 GB,
    603.14 ms priced against 635.7 plain, docs/benchmarks.md): where the plan holds more than LEAN_STEP **
    -LEAN_BELOW of the budget. The least price the rounds try where the budget binds charges a plan at the budget
    that share of its time; below it even their first price charges the plan's bytes less, a smaller change to its
    node costs than any the binding rounds make (a small model under 80 GB: the rounds not run)."""
    return peak * LEAN_STEP ** LEAN_BELOW > limit


# The periodic candidates expanded onto every layer and priced by plan_cost, of those the folded plan's estimate
# (`FoldedCandidates.folded_time`) ranks first: each expansion of the 32-layer 7B step and its pricing is seconds,
# and every fit made up to twelve (docs/benchmarks.md, "Ranking the folded candidates").
EXPANDED_CANDIDATES = 3
# a candidate whose `floor` is over the best expanded price so far by more than this share is not expanded: the
# floor and plan_cost sum the same step prices in other orders (rounding), and a tie keeps the earlier candidate
FLOOR_MARGIN = 1e-9
EXPANSIONS_KEPT = EXPANDED_CANDIDATES  # expanded plans `FoldedCandidates.decode` keeps for the fit that picks one
# folded plans kept by choice (`FoldedCandidates._folded_plan`): more than a fit ranks (up to twelve), so the
# expansions of its best ranked reuse them
FOLDED_PLANS_KEPT = 16


def chosen(selection: Selection) -> tuple[int, ...]:
    """The selection's choice as a key: its nodes (a node names its class)."""
    return tuple(sorted(selection.choice.values()))


@dataclass(eq=False)
class FoldedCandidates:
    """The folded graph (`graph`, the whole one's fold as `layered` holds it), and the caches of its candidates'
    expansions (the last EXPANSIONS_KEPT, by choice), prices (by what, model and choice) and lowered steps (their
    peaks walked: cost.memory.Lowerings)."""

    layered: Layered
    decoder: Decoder
    graph: Graph
    names: dict[str, str]  # root e-class -> graph output name, as the decoder takes them
    _expansions: dict[tuple[int, ...], tuple[Plan, list[int]]] = field(default_factory=dict, init=False, repr=False)
    _prices: dict[tuple[str, int, tuple[int, ...]], tuple[CostModel, Any]] = field(
        default_factory=dict, init=False, repr=False)
    _folded_plans: dict[tuple[int, ...], Plan] = field(default_factory=dict, init=False, repr=False)
    lowerings: Lowerings = field(default_factory=Lowerings, init=False, repr=False)  # steps lowered, by all fits

    def decode(self, egraph: ExtractGraph, selection: Selection) -> tuple[Plan, list[int]]:
        """The selection's plan expanded onto every layer of the whole graph, and the node each step comes from.
        The last EXPANSIONS_KEPT expansions are kept by choice: the fit's plan is the candidate its ranking
        expanded last."""
        key = chosen(selection)
        if key in self._expansions:
            plan, nodes = self._expansions[key]
            return replace(plan, cost=selection.dag_cost, notes={**plan.notes, **self.decoder.notes(selection)}), nodes
        plan, nodes = self.layered.expand(egraph, selection, self.names, self._folded_plan(egraph, selection).notes)
        self._expansions[key] = plan, nodes
        while len(self._expansions) > EXPANSIONS_KEPT:
            del self._expansions[next(iter(self._expansions))]
        return plan, nodes

    def cheapest(self, egraph: ExtractGraph, candidates: Sequence[Selection], model: CostModel) -> Selection:
        """The candidate whose expanded plan plan_cost prices cheapest, of the EXPANDED_CANDIDATES the folded plan's
        estimate ranks first (`folded_time`), each choice once (the fallback's pins often make the same one): the
        estimate ranks, the expanded plan decides (overlap and fusion across copies are only estimated). A ranked
        candidate whose `floor` is over the cheapest expanded price so far is not expanded: it cannot be cheaper."""
        unique: dict[tuple[int, ...], Selection] = {}
        for selection in candidates:
            unique.setdefault(chosen(selection), selection)
        ranked = sorted(unique.values(), key=lambda selection: self.folded_time(egraph, selection, model))
        best, least = ranked[0], self.expanded_time(egraph, ranked[0], model)
        for selection in ranked[1:EXPANDED_CANDIDATES]:  # the first of the cheapest, as min keeps it
            if self.floor(egraph, selection, model) > least * (1 + FLOOR_MARGIN):
                continue  # its expanded plan cannot be cheaper: not expanded
            time = self.expanded_time(egraph, selection, model)
            if time < least:
                best, least = selection, time
        return best

    def expanded_time(self, egraph: ExtractGraph, selection: Selection, model: CostModel) -> float:
        """plan_cost of the selection's plan of the whole graph."""
        return self._priced("plan_cost", selection, model, lambda: plan_cost(self.decode(egraph, selection)[0], model))

    def folded_time(self, egraph: ExtractGraph, selection: Selection, model: CostModel) -> float:
        """plan_cost of the selection's expanded plan, estimated on the folded plan (two layers, whatever the
        depth): each step priced once, copy 1's counted once per later copy (`Layered.runs`), its gradient
        reductions hidden behind its backward pass as cost.overlap hides them."""
        return self._folded_prices(egraph, selection, model)[0]

    def floor(self, egraph: ExtractGraph, selection: Selection, model: CostModel) -> float:
        """A lower bound of `expanded_time`, from the folded plan: its moves and placements (Reshard and Place
        steps, none prepared), copy 1's counted once per later copy. A bound: plan_cost is the steps' sum less
        min(reductions, backward), at most the backward pass's Compute steps, so every other step stays in it at
        its price, and fusion (DefaultCostModel's plan-wide pricing) reprices fusible Compute steps only. 0 under
        a model that prices steps together otherwise (it could reprice a move)."""
        return self._folded_prices(egraph, selection, model)[1]

    def _folded_prices(self, egraph: ExtractGraph, selection: Selection, model: CostModel) -> tuple[float, float]:
        """`folded_time` and `floor`, from one pricing of the folded plan, once per choice."""
        key = ("folded", id(model), chosen(selection))
        if key not in self._prices:
            self._prices[key] = (model, self._folded_estimate(egraph, selection, model))
        return self._prices[key][1]

    def _folded_plan(self, egraph: ExtractGraph, selection: Selection) -> Plan:
        """The selection's plan of the folded graph, decoded once per choice while among the last FOLDED_PLANS_KEPT:
        a fit's ranking (`folded_time`) decodes each of its candidates, then `decode` the ones it expands. Its steps
        are the choice's; its cost and notes the selection's (a choice comes from several extractors)."""
        key = chosen(selection)
        plan = self._folded_plans.pop(key, None)  # put back last: the least recently asked go first
        if plan is None:
            plan = self.decoder.plan(egraph, selection, self.graph, self.names)
        self._folded_plans[key] = plan
        while len(self._folded_plans) > FOLDED_PLANS_KEPT:
            del self._folded_plans[next(iter(self._folded_plans))]
        return replace(plan, cost=selection.dag_cost, notes={**plan.notes, **self.decoder.notes(selection)})

    def _folded_estimate(self, egraph: ExtractGraph, selection: Selection, model: CostModel) -> tuple[float, float]:
        plan = self._folded_plan(egraph, selection)
        costs = step_costs(plan, model)  # prepared steps left out
        nodes = self.decoder.step_nodes(egraph, selection)
        runs = {step.out: self.layered.runs(n) for step, n in zip(plan.steps, nodes)}
        weighted = {out: cost * runs[out] for out, cost in costs.items()}
        moves = sum(weighted[step.out] for step, n in zip(plan.steps, nodes) if isinstance(step, (Reshard, Place))
                    and step.out in weighted and not self.decoder.prepared(self.decoder.nodes[n])) \
            if getattr(type(model), "plan_step_costs", None) in (None, DefaultCostModel.plan_step_costs) else 0.0
        return sum(weighted.values()) - overlap(plan, from_costs(weighted)).hidden, moves

    def _priced(self, what: str, selection: Selection, model: CostModel, price: Callable[[], float]) -> float:
        """`price()`, `what` of `selection` under `model`, computed once per choice (the fits of a folded step
        rank and price alike candidates again)."""
        key = (what, id(model), chosen(selection))
        if key not in self._prices:
            self._prices[key] = (model, price())  # the model kept, so its id is not reused
        return self._prices[key][1]

    def within_budget(self, egraph: ExtractGraph, budget: DeviceBudget, ties: Ties, carried: Mapping[str, str],
                      hands: Mapping[str, Plan], held: Mapping[str, tuple[int, ...]],
                      select: Callable[[ExtractGraph], Selection], extractor: str, time_limit: float,
                      stop_gap: float | None = None, model: CostModel | None = None,
                      incumbent: tuple[Plan, Selection] | None = None,
                      rivals: Sequence[ExtractGraph] = ()) -> tuple[Plan, Selection]:
        """A plan within `budget`, the cheapest by plan_cost of the periodic candidates whose exact peak fits and
        of `incumbent` (the plan chosen without the budget, where it fits: `competes`; its cost its plan_cost under
        `model`, as the caller priced it): the hand plans of the folded graph (`hands`, made periodic), and
        `select`'s steady periodic selection (the caller's greedy-dag fallback) with memory priced, each node's
        bytes per device (`held`, copy 1's m - 1 times) at `price` seconds per byte added to its cost, the price
        raised LEAN_STEP-fold from one that makes a budget's worth of bytes cost the cheapest plan's time again,
        until a candidate fits, or lowered up to LEAN_BELOW times while it fits where the first did (a Lagrangian
        relaxation of the budget); a price whose selection is the incumbent's ends the descent (a lower one changes
        less). Each of `rivals` (the graph under other node costs: the plain sum of a weighted fit's, whose refit a
        binding budget leaves unmade) runs that ladder too, from its own greedy plan's time, and adds its candidates
        (the 70B step on 8x8x8 at 80 GB: the plain sum's 1983.7 ms plan, against 2271.8 of the weighted costs'
        ladder alone, docs/benchmarks.md). With `extractor` "ilp" and no incumbent (the ILP chose that without the
        budget, which does not bind it) the ILP then tries to better the kept one under the budget's constraints
        and the ties, starting from it. A hand plan or the ILP's choice whose `floor` is over a plan that fits
        already is not expanded (it cannot be cheaper). MemoryBudgetError where none fits, with the leanest
        candidate's peak, how many carried tensors it holds whole on every device, and how many prices left no
        steady selection (the 70B step on 8x8x8 ended in a 420 GB leanest plan: weights and Adam moments whole,
        docs/benchmarks.md, "Why the 70B step's candidates miss 80 GB")."""
        limit = budget.limit
        twins = set(self.layered.ties())
        steady = [t for t in ties if t not in twins]
        kept = [] if incumbent is None else [incumbent]
        handed: list[tuple[Plan, Selection]] = []  # the hand plans that fit
        priced: list[tuple[Plan, Selection]] = []  # the ladders' candidates that fit
        leanest: tuple[float, Selection | None] = (math.inf, None)  # least peak (or lower bound of it), for the error
        decoded: list[tuple[int, str]] = []  # the leanest decoded candidate's peak and what it holds then
        unsteady: list[int] = []  # the prices whose fallback found no steady selection
        seen: dict[tuple[int, tuple[int, ...]], bool] = {}  # each choice tried, by list: whether it fit

        def fitting(selection: Selection, how: str, into: list[tuple[Plan, Selection]]) -> bool:
            # a choice tried before is not decoded again: a hand plan mirrored either way, or a price selecting what
            # another did, is the same plan, its peak the same, and a repeat ties the earlier candidate (kept)
            key = (id(into), chosen(selection))
            if key not in seen:
                seen[key] = fits(selection, how, into)
            return seen[key]

        def fits(selection: Selection, how: str, into: list[tuple[Plan, Selection]]) -> bool:
            nonlocal leanest
            if not budget.fits(selection.choice):  # a lower bound of its peak is over: not decoded
                leanest = min(leanest, (max(budget.usage(selection.choice)), selection), key=lambda p: p[0])
                return False
            plan, _, peaks = leaner(*self.decode(egraph, selection), self.lowerings)
            peak = max(p.bytes for p in peaks)
            leanest = min(leanest, (peak, selection), key=lambda p: p[0])
            if not decoded or peak < decoded[0][0]:
                decoded[:] = [(peak, held_at_peak(plan, peaks))]
            if peak > limit:
                return False
            plan = replace(plan, cost=plan_cost(plan, model) if model is not None else selection.dag_cost,
                           notes={**plan.notes, "memory_budget": how})
            into.append((plan, replace(selection, dag_cost=dag_cost(egraph, selection.choice), status="feasible")))
            return True

        # a node's bytes per device at its worst device: what it adds to the memory a plan holds (copy 1's once
        # per later copy); summed over a plan, about its activations and state, which a training step holds at once
        made = self.layered.costs(egraph.with_costs([
            0.0 if node.op == "Deliver" or self.decoder.views(node) else float(max(held[node.eclass], default=0))
            for node in self.decoder.nodes])).node_cost
        ladders = [egraph, *(rival for rival in rivals if rival is not egraph)]
        for costs in ladders:
            self._priced_ladder(costs, made, limit, time_limit, select, incumbent,
                                lambda selection, how: fitting(selection, how, priced), unsteady)
        # the hand plans after the ladders, ranked before them (the first of equals kept): one whose `floor` is over
        # the cheapest plan that fits so far cannot be the cheapest, and is not expanded and walked for its peak (the
        # 70B step on 8x8x8 at 80 GB: FSDP's and DPxTP's, peaking at 229 and 98 GB)
        for _, embedded in embedded_plans(self.decoder, egraph, hands, steady):
            for selection in periodic_selections(self.layered, self.decoder, egraph, embedded, ties, carried):
                least = min((plan.cost for plan, _ in (*kept, *handed, *priced)), default=math.inf)
                if model is None or self.floor(egraph, selection, model) <= least * (1 + FLOOR_MARGIN):
                    fitting(selection, f"{embedded.extractor}, periodic", handed)
        found = [*kept, *handed, *priced]
        if not found:
            raise MemoryBudgetError(f"no plan fits {limit:,} bytes per device: of the periodic plans tried (the "
                                    f"folded graph's hand plans, greedy-dag with memory priced up to "
                                    f"{LEAN_STEP ** (LEAN_ROUNDS - 1):g} times a budget's worth of bytes per plan "
                                    f"time) the leanest needs {leanest[0]:,.0f}"
                                    + ("" if leanest[1] is None else f", {self._whole_state(leanest[1], carried)}")
                                    + "".join(f"; of those decoded, the leanest needs {peak:,}: {held}"
                                              for peak, held in decoded)
                                    + f"; {len(unsteady)} of the {LEAN_ROUNDS * len(ladders)} prices left no steady "
                                    f"selection")
        plan, selection = min(found, key=lambda f: f[0].cost)
        if extractor == "ilp" and incumbent is None:
            with suppress(NoFiniteChoiceError):  # the kept plan stands where the ILP finds nothing in time
                better = extract(egraph, "ilp", time_limit, budget, ties, stop_gap=stop_gap, start=selection)
                # a choice whose floor is over the kept plan's cost cannot be cheaper: not expanded and walked (the
                # 70B step on 8x8x8 at 80 GB: the ILP's choice priced 2291.2 ms against the kept 1796.7)
                if better.choice != selection.choice and (
                        model is None or self.floor(egraph, better, model) <= plan.cost * (1 + FLOOR_MARGIN)):
                    candidate, _, peaks = leaner(*self.decode(egraph, better), self.lowerings)
                    candidate = replace(candidate, cost=plan_cost(candidate, model) if model is not None
                                        else better.dag_cost, notes={**candidate.notes, "memory_budget": "ilp"})
                    if max(p.bytes for p in peaks) <= limit and candidate.cost < plan.cost:
                        plan, selection = candidate, better
        return plan, selection

    @staticmethod
    def _priced_ladder(costs: ExtractGraph, made: Sequence[float], limit: int, time_limit: float,
                       select: Callable[[ExtractGraph], Selection], incumbent: tuple[Plan, Selection] | None,
                       fitting: Callable[[Selection, str], bool], unsteady: list[int]) -> None:
        """`within_budget`'s ladder on node costs `costs`: `select`'s choice with each node's bytes `made` priced,
        from a price that makes a budget's worth of bytes cost the greedy plan's time, raised LEAN_STEP-fold until
        one fits (`fitting` keeps it), or lowered while it fits where the first did; a price whose selection is
        the incumbent's ends the descent. A price without a steady selection is added to `unsteady`."""
        base = extract(costs, "greedy-dag", time_limit).dag_cost / limit  # seconds per byte
        unchanged: list[int] = []  # the prices whose selection was the incumbent's

        def priced_fits(k: int) -> bool:
            price = base * LEAN_STEP ** k
            priced = costs.with_costs([c + price * b if math.isfinite(c) else c for c, b in zip(costs.node_cost, made)])
            try:
                selection = select(priced)
            except NoFiniteChoiceError:
                unsteady.append(k)
                return False
            if incumbent is not None and chosen(selection) == chosen(incumbent[1]):
                unchanged.append(k)
                return True  # fits: not decoded again
            return fitting(replace(selection, extractor="greedy-dag, memory priced"),
                           f"greedy-dag with memory priced at {price:.3g} s per byte")

        first = next((k for k in range(LEAN_ROUNDS) if priced_fits(k)), None)
        if first == 0:  # the first price fit: lower ones may fit too, and cost less time
            for k in range(-1, -1 - LEAN_BELOW, -1):
                if unchanged or not priced_fits(k):
                    break

    def _whole_state(self, selection: Selection, carried: Mapping[str, str]) -> str:
        """How many of the carried inputs (weights, optimizer state) `selection` places whole on every device, and
        the first of them by name: where the leanest candidate keeps them all whole, the sharded layouts were never a
        steady candidate; where it keeps a few, those are what to look at (70B on 8x8x8: one)."""
        layouts = self.decoder.interner.layouts
        state = set(carried.values())
        whole = {node.key: len(set(layouts[node.layout][1].blocks)) == 1 for node in
                 (self.decoder.nodes[n] for n in selection.choice.values()) if node.op == "Place" and node.key in state}
        named = sorted(name for name, held in whole.items() if held)
        which = f" ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''})" if named else ""
        return f"holding {len(named)} of its {len(whole)} carried inputs whole on every device{which}"
