"""`tapestry.optimize`: saturate, extract under a cost model, decode a plan. The scripting API.

One saturation can serve many extractions: `explore` returns the saturated
e-graph, and its `extract` and `pareto` price it under different objectives.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import cache, cached_property, partial
from itertools import islice
from operator import attrgetter
from pathlib import Path
from typing import Any

from tapestry.clock import clock
from tapestry.collector import no_collections
from tapestry.cost import CostModel, default_cost_model, peak_memory, plan_cost
from tapestry.cost.floor import floor_parts, gap_to_floor, gaps_note
from tapestry.egraph.budget import (MemoryBudgetError, budget_error, device_budget, hand_within, held_bytes,
                                    inputs_floor, memory_cuts)
from tapestry.egraph.decode import Decoder
from tapestry.egraph.driver import (Budget, IterationStats, SaturationStats, make_reshards, moves_to_price, saturate,
                                    search_status)
from tapestry.egraph.embed import embedded_plans
from tapestry.egraph.extractor_pricing import FloorPriced
from tapestry.egraph.folded_candidates import FoldedCandidates, competes
from tapestry.egraph.fused_prices import fused_graph
from tapestry.egraph.layered import Layered, value_classes
from tapestry.egraph.lean_plans import LeanPlans
from tapestry.egraph.objective import StepObjective, overlap_split, unless_unselectable
from tapestry.egraph.plan_bound import PlanBound, lazy_bound, no_bound
from tapestry.egraph.pins import (
    Outputs,
    check_carried,
    delivered_layouts,
    pin_layouts,
    periodic_selections,
    placed_layouts,
    replicated_layouts,
    restrict_outputs,
    steady_picks,
    steady_ties,
)
from tapestry.egraph.repeat import find_repetition
from tapestry.egraph.rules import RuleFile, load_rules, only_builtin
from tapestry.extract import (
    EXTRACTORS,
    DeviceBudget,
    NoFiniteChoiceError,
    Repeated,
    Selection,
    Ties,
    extract,
    ties_hold,
    validate,
)
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract.ilp import models_in
from tapestry.extract.memo import PICKS_KEPT, SelectionMemo
from tapestry.extract.selection import dag_cost
from tapestry.graph import Graph
from tapestry.graph.layers import find_layers, fold
from tapestry.plan import Plan, steady_violations
from tapestry.plan.explain import explain as explain_plan, replicated_share
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.training import LR
from tapestry.training.plans import baselines
from tapestry.training.recompute import recomputed_baselines
from tapestry.verify import meaning_check


@dataclass(frozen=True)
class OptimizeResult:
    plan: Plan
    stats: SaturationStats
    selection: Selection
    rule_files: tuple[RuleFile, ...]
    egraph_json: dict[str, Any] = field(repr=False)
    floor: float | None = None  # seconds no plan of the graph on the mesh costs less (cost.floor.step_floor)
    bounded: Callable[[], PlanBound] = field(default=partial(no_bound, "not computed"), repr=False, compare=False)

    @property
    def peak_memory(self) -> int:
        """Most bytes any one device holds at once."""
        return max(peak_memory(self.plan))

    @property
    def meaning_check(self) -> str:
        """How the plan was checked against the graph's meaning (verify.meaning_check): "simulated on every
        device", "sampled: ...", or "NOT CHECKED: ..." (with a warning) when even one sampled cell was too big."""
        return str(self.plan.notes.get("meaning_check", "NOT CHECKED"))

    @property
    def status(self) -> str:
        """How the plan was found (`search_status`): "optimal" only if the search space was complete and the
        extractor proved its choice; "feasible" or "heuristic" when the space was complete but the choice not
        proven; "stopped by <phase> (<budget>)" when a budget cut the search space, every phase it cut named."""
        return self.selection.status

    @cached_property
    def bound(self) -> PlanBound:
        """Of plan.cost over the e-graph searched (egraph.plan_bound), made when asked: its LP takes seconds."""
        return self.bounded()

    @property
    def gap(self) -> float | None:
        """(plan.cost - bound) / plan.cost, `bound` a lower bound of `plan_cost` over every plan of the e-graph
        searched (egraph.plan_bound; a fold's: its periodic plans); None where none is known (`bound.why` says why).
        Cut or folded, it bounds nothing outside that space (`gap_to_floor` does); `selection.gap`: the extractor's."""
        return self.bound.gap(self.plan.cost)

    @property
    def gap_to_floor(self) -> float | None:
        """(cost - floor) / cost: how far the plan may be above the best plan of the whole space (cost.floor), what
        `gap` cannot say where the search was cut or the extractor greedy; None where the floor is unknown."""
        return gap_to_floor(self.plan.cost, self.floor)

    @property
    def replicated_share(self) -> float:
        """The share of the plan's compute steps that every device runs whole (1.0: nothing sharded)."""
        return replicated_share(self.plan)

    def explain(self) -> str:
        """The plan step by step, each compute with the graph op or rule that produced its kernel."""
        gap = gaps_note(self.gap, self.gap_to_floor, self.bound.why)
        head = [
            f"mesh {self.plan.mesh}: {len(self.plan.steps)} steps, predicted {self.plan.cost:.6g} s, "
            f"peak {self.peak_memory:,} bytes per device ({self.selection.extractor}, {self.status}{gap}; "
            f"{self.replicated_share:.0%} of compute steps replicated)",
            f"saturation: {len(self.stats.iterations)} iterations, {self.stats.enodes} e-nodes, "
            f"stopped by {self.stats.stopped_by}" + (f" ({self.stats.undone})" if self.stats.undone else ""),
            f"meaning: {self.meaning_check}",
        ]
        return "\n".join(head) + "\n" + explain_plan(self.plan)

    def render_egraph(self, path: str | Path, max_nodes: int = 400) -> Path:
        """An SVG/PNG of the e-graph, for small ones (a big one is unreadable and slow to lay out)."""
        from tapestry.egraph.render import egraph_to_dot
        from tapestry.graph.render import write_picture

        return write_picture(egraph_to_dot(self.egraph_json, max_nodes), path)


# A cut search whose plan replicates at least this share of its compute steps warns (SearchCutWarning): on 8x8
# a 2-layer 7B step stopped by generation came out 83-95% replicated at 0.4% MFU (docs/benchmarks.md, "Cluster")
REPLICATED_WARNING = 0.8
CUT_ROUNDS = 12  # re-solves with memory cuts when the decoded plan overshoots the budget
# The weights of "reductions hidden" tried after 1.0 when the plan's backward pass hides less than all of its
# gradient reductions (cost.overlap): the other piece of max(sum - reductions, sum - backward), and between.
LAGRANGE_WEIGHTS = (0.0, 0.5)
# The ILP's stop gap under fused node costs (egraph.fused_prices): they estimate a plan's time, so proving their
# optimum buys nothing; at 1% the ILP took 0.21 CPU s on gpt_neox's Mesh(4) e-graph, proving it 0.75 (the path cuts
# of an objective whose LP is not tight), and found the same plan.
FUSED_STOP_GAP = 0.01
# Meshes below this many devices get no second, fusion-priced extraction. On 2x2 and Mesh(4) it returned the same
# plans for all twelve zoo cases at two to three times the extraction time (GPT-NeoX 2x2: 17.8 against 6.1 CPU s,
# `python benchmarks/fused_extraction.py --case gpt_neox --mesh 2x2`); on 8x8 it found the 7B-width block's step
# 2.2% faster (docs/benchmarks.md, "Extraction under fused prices").
FUSED_EXTRACTION_DEVICES = 8
# The least depth `explore` folds by default: at 4 layers the folded 7B step on 8x8 planned 9% dearer and twice as
# slow (20.13 against 18.43 ms, 158 against 72 CPU s); at 32 only the fold plans (docs/benchmarks.md, "Extracting
# the folded step"). Between them it is not measured.
FOLD_FROM_COPIES = 8


class NoPlanError(ValueError):
    """No plan delivers the outputs as asked (in steady state, where the step carries state)."""


class SearchCutWarning(UserWarning):
    """A budget cut the search and the plan came out (nearly) replicated: the sharded options may never have been
    made (REPLICATED_WARNING)."""


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
    priced_moves: float = math.inf  # distinct moves pricing prices beyond those always priced (Decoder.priced)
    layered: Layered | None = None  # `graph` is the whole graph's fold: plans are expanded onto every layer
    baselines: Mapping[str, Plan] = field(default_factory=dict)  # the hand plans (`_against_baselines`), seeds
    _picks = cached_property(lambda self: SelectionMemo(PICKS_KEPT))  # `_warm_starts`' greedy-dag picks

    @property
    def whole(self) -> Graph:
        """The graph plans are of: the explored one, or the one it folds."""
        return self.graph if self.layered is None else self.layered.full

    @cached_property
    def folded(self) -> FoldedCandidates:
        """The folded graph's periodic candidates: their expansions onto every layer and prices, kept by choice."""
        if self.layered is None:
            raise ValueError("Explored.folded: the graph was not folded (Explored.layered is None)")
        return FoldedCandidates(self.layered, self.decoder, self.graph, self.names)

    @cached_property
    def repeated(self) -> Repeated | None:
        """The stack of identical layers, if any, for the ILP's periodic warm start (egraph.repeat)."""
        return find_repetition(self.decoder, list(self.roots))

    _held = cached_property(lambda self: held_bytes(self.decoder, self.graph))  # e-class -> bytes on each device
    # a memory budget's constraints (`device_budget`) but its limit, alike under every limit: made once per e-graph
    _charges = cached_property(lambda self: device_budget(self.decoder, self._held, self.layered, 0))

    @cached_property
    def _unbudgeted(self) -> SelectionMemo:
        """The selections made without a memory budget (`_select`); greedy-dag's steady picks apart (PICKS_KEPT)."""
        return SelectionMemo()

    @cached_property
    def _lean(self) -> LeanPlans:
        """Each selection's plan of the whole graph decoded, walked for its peaks, priced once (egraph.lean_plans)."""
        return LeanPlans(self.decoder, self.graph, self.names) if self.layered is None else LeanPlans(
            self.decoder, self.graph, self.names, self.layered, self.folded.decode, lowerings=self.folded.lowerings)

    @cached_property
    def _inputs_floor(self) -> tuple[int, tuple[tuple[str, int], ...]]:
        """The floor the inputs set under every plan's peak, and its parts (egraph.budget.inputs_floor)."""
        return inputs_floor(self.decoder, self.graph, self.layered)

    def _budget_error(self, limit: int, why: str) -> MemoryBudgetError:
        return budget_error(limit, why, self._inputs_floor, self.mesh.size)

    @no_collections()
    def extract(self, cost_model: CostModel | None = None, extractor: str = "ilp", time_limit: float = 10.0,
                memory_budget: int | None = None, outputs: Outputs = "any", steady: Mapping[str, str] | None = None,
                micro_batches: int = 1, fusion_refit: bool = True) -> OptimizeResult:
        """The cheapest plan whose outputs have the layouts `outputs` asks for and, with `memory_budget`, whose
        peak memory (cost.peak_memory) fits that many bytes on every device; MemoryBudgetError if none is found.

        Steady state: each output in `steady` (output -> input; default the graph's `carried`, {} for none) is
        delivered in the layout its input is placed in, so the step repeats without moving weights or optimizer
        state; the ILP keeps it exactly (`egraph.pins.steady_ties`), the greedy extractors by fixing each input's
        layout to the one their unconstrained choice delivered its output in (`pin_layouts`) or to the replicated one,
        whichever is cheaper (the first may leave no plan where the pricing budget left moves out).

        The budget enters the ILP as per-device linear constraints that every fitting plan meets
        (`egraph.budget.device_budget`), so a decoded plan that fits is the optimum. If it does not fit, what held
        its peak becomes a cut (`egraph.budget.memory_cuts`) and the ILP runs again, up to CUT_ROUNDS times: the
        cuts are heuristic (they can exclude a plan that fits), so what fits then is returned marked "feasible"
        (not proven best). A folded graph's plan that fits is weighed against its budgeted fallback's memory-priced
        candidates at the end (`FoldedCandidates.within_budget`, where `competes`), the cheaper by plan_cost kept.

        A training step's gradient reductions hide behind its backward pass (cost.overlap): the plan's time is
        max(sum - reductions, sum - backward), which no node cost can say. Extraction first takes the reductions
        as hidden whole (`_overlap_split`: weight 1 on the first piece); if the plan's backward pass is shorter
        than its reductions, it extracts again with the backward compute hidden instead (weight 0), and with
        both half hidden; the cheapest plan by plan_cost (of equals the leaner: StepObjective.better) is kept,
        marked "feasible" (the objectives were not its time).

        Fusion: where the model prices fusion groups as one kernel (its `fused_device`) and `fusion_refit` asks, the
        plan is extracted a second time with each fusible node priced as the group member its neighbourhood promises
        (`_fused`), and that plan is kept if plan_cost finds it cheaper, marked "feasible" (its node costs were
        estimates); the overlap sweep then extracts under the costs that won. docs/cost-models.md says what is exact.

        Gradient accumulation: with `micro_batches` > 1 the step is run that many times (its forward and backward,
        as a pipeline stage runs its micro-batches) per update, and the plan kept is the cheapest by that count
        (`cost.breakdown.PhaseTimes.accumulated`, its `notes["accumulated_cost"]`): each node off the update is
        priced `micro_batches` times, the update and the weight gradients' reductions once, the reductions hidden
        behind one micro-batch's backward in the overlap sweep. `plan.cost` stays the time of one run."""
        if micro_batches < 1:
            raise ValueError(f"extract: micro_batches must be at least 1, not {micro_batches}")
        model = cost_model or default_cost_model()
        whole_carried = dict(self.whole.carried if steady is None else steady)
        check_carried(self.whole, whole_carried)
        carried = {out: into for out, into in whole_carried.items() if out in self.graph.outputs}  # of the fold
        plain_sum = memory_budget is None and not (carried or self.graph.carried or self.layered)  # pruning's need
        split = overlap_split(self.decoder, self.graph.carried, {self.names[r]: r for r in self.roots}, (LR,),
                              accumulated=micro_batches > 1)
        floored = FloorPriced.made(self.decoder, self.roots, model, self.priced_moves) if plain_sum and not split[0] \
            and micro_batches == 1 and self.mesh.size < FUSED_EXTRACTION_DEVICES else None
        priced = floored.graph if floored else self.decoder.extraction_graph(
            list(self.roots), model, self.priced_moves, drop_dominated=plain_sum)
        egraph = restrict_outputs(self.decoder, priced, outputs)
        egraph, ties = steady_ties(self.decoder, egraph, carried)
        wide = self.mesh.size >= FUSED_EXTRACTION_DEVICES  # fused prices: dearer than they pay below it
        fused = fused_graph(self.decoder, egraph, model) if fusion_refit and wide else None
        if self.layered is not None:  # copy 1 counted once per later copy (fused prices too), tied to copy 0
            egraph, ties = self.layered.costs(egraph), sorted([*ties, *self.layered.ties()])
            fused = None if fused is None else self.layered.costs(fused)
        budget_of = cache(lambda: replace(self._charges, limit=memory_budget))  # where it binds
        if memory_budget is not None and self._inputs_floor[0] > memory_budget:  # no plan can: say so at once
            raise self._budget_error(memory_budget, "")
        hands = self._warm_starts(egraph, tuple(embedded for _, embedded in embedded_plans(
            self.decoder, egraph, self.baselines, ties)) if self.layered is None else (), extractor, time_limit, ties,
            carried)  # and in `fit` greedy-dag's picks of the graph solved: of one run's costs, then of that one's
        objective = StepObjective(model, micro_batches, split, (LR,))
        reductions = objective.split[0]

        extractors = [extractor]  # the ILP found no steady selection in time once: greedy-dag for the rest

        def weighted(base: ExtractGraph, weight: float | None) -> ExtractGraph:
            """`base` with each node's cost weighted by `node_weight`."""
            return base.with_costs([unless_unselectable(c, objective.node_weight(n, weight))
                                    for n, c in enumerate(base.node_cost)]) \
                if reductions and weight is not None or micro_batches > 1 else base

        def fit(base: ExtractGraph, weight: float | None, first: bool = False) -> tuple[Plan, Selection]:
            """Extracted from `weighted(base, weight)`; where the budget binds the `first` fit of a folded graph, its
            fallback tries `base`'s plain sum too (the refit that binding leaves unmade: `refit` below)."""
            hidden = weighted(base, weight)
            plan, selection = self._fit(hidden, extractors[-1], time_limit, budget_of, ties, carried, memory_budget,
                                        outputs, FUSED_STOP_GAP if base is fused else None, model,
                                        self._warm_starts(hidden, hands, extractor, time_limit, ties, carried),
                                        (base,) if first and reductions else ())
            fell_back = selection.extractor in EXTRACTORS and selection.extractor != extractors[-1]  # not a hand plan
            if fell_back and ties and memory_budget is None:
                extractors.append(selection.extractor)
            # time per run, not objective; a folded plan's priced where its ranking priced it
            # (`FoldedCandidates.expanded_time`) or its budgeted fallback did (by plan_cost: `within_budget`)
            fallback = self.layered is not None and plan.notes.get("memory_budget", "not binding") != "not binding"
            cost = plan.cost if fallback else self.folded.expanded_time(hidden, selection, model) \
                if self.layered is not None and memory_budget is None else self._lean.cost(plan, model)
            return replace(plan, cost=cost), selection

        plan, selection = fit(egraph, 1.0, first=True)
        while floored and (repriced := floored.repriced(egraph, selection)) is not None:  # chosen moves above floor
            egraph = repriced
            plan, selection = fit(egraph, 1.0)
        plain = egraph
        # a folded graph whose budget binds is fitted by its budgeted fallback (`FoldedCandidates.within_budget`),
        # which extracts and prices several periodic candidates: its plan stands, the other objectives' fits not made
        refit = self.layered is None or memory_budget is None or plan.notes.get("memory_budget") == "not binding"
        if fused is not None and refit:  # the plan extracted under fusion-aware costs, where plan_cost finds it cheaper
            try:
                seen = fit(fused, 1.0)
            except (MemoryBudgetError, NoPlanError):  # none found under these costs: the first plan stands
                seen = (plan, selection)
            if objective.better(seen[0], plan):
                egraph, (plan, selection) = fused, seen
        if self.layered is not None and reductions and refit:
            # the plain sum too (also under a budget no fit binds), of the node costs without fusion's estimates: on
            # the folded 7B step on 8x8 the greedy fallback's sharded periodic candidates came out of it (4 layers:
            # 19.24 ms; 32 layers: 142.16), where the weighted or fused fits kept the replicated pins (29.98; 186.31)
            with suppress(NoPlanError, MemoryBudgetError):  # under a budget: the plan in hand fits
                seen = fit(plain, None)
                if objective.better(seen[0], plan):
                    egraph, (plan, selection) = plain, seen
        if objective.exposed(plan) and refit:  # the first piece was not the plan's time
            swept = []
            for weight in LAGRANGE_WEIGHTS:
                with suppress(NoPlanError):  # a fallback's steady pins can fail under one weighting alone
                    swept.append(fit(egraph, weight))
            plan, selection = objective.least([(plan, selection), *swept])
            selection = replace(selection, status="feasible")  # no objective was the plan's time: nothing proven
            plan = replace(plan, notes={**plan.notes, "status": "feasible",
                                        "overlap_rounds": 1 + len(LAGRANGE_WEIGHTS)})
        fits = plan.notes.get("memory_budget") == "not binding"  # the budget binds no fit: priced rivals, `competes`
        if self.layered is not None and memory_budget is not None and fits and competes(
                max(p.bytes for p in self._lean.leaner(plain, selection)[2]), memory_budget):
            plan, selection = self._within_budget(weighted(plain, 1.0), budget_of, ties, carried, extractors[-1],
                                                  time_limit, None, model, (plan, selection))
        if egraph is fused:  # its node costs were an estimate of its time: nothing proven
            selection = replace(selection, status="feasible")
            plan = replace(plan, notes={**plan.notes, "status": "feasible", "node_costs": "fused"})
        if self.layered is None:  # a hand plan is of the whole graph: no floor for a folded one
            plan, selection = self._against_baselines(plan, selection, egraph, model, ties, memory_budget, objective)
        plan = self._verified(plan, extractor, whole_carried)
        if micro_batches > 1:
            plan = replace(plan, notes={**plan.notes, "micro_batches": micro_batches,
                                        "accumulated_cost": objective(plan)})
        pricing = self.decoder.pricing
        stats = replace(self.stats, reshards_unpriced=pricing.reshards_unpriced, moves_unpriced=pricing.moves_unpriced,
                        moves=pricing.moves)
        if self.layered is not None:  # the best periodic plan found: nothing proven over plans whose layers differ
            plan = replace(plan, notes={**plan.notes, "periodic": {
                "copies": self.layered.copies, "nodes_per_copy": len(self.layered.folded.layers.chains),
                "extractor": selection.extractor, "extractor_status": selection.status,
                "gap_among_periodic": selection.gap}})
            selection = replace(selection, status="periodic", gap=None)
        status = search_status(stats, selection)
        plan = replace(plan, notes={**plan.notes, "status": status, "extractor_status": selection.status,
                                    **({"extractor_stopped_by": selection.stopped_by} if selection.stopped_by else {})})
        parts = floor_parts(self.whole, self.mesh, model) if only_builtin(self.rule_files) else None
        floor = None if parts is None else parts.total
        unhidden = egraph is plain and not reductions and memory_budget is None and micro_batches == 1  # a node sum
        bound = lazy_bound(self.decoder, plain, model, plan, selection.bound if unhidden else None, floor,
                           None if parts is None else parts.fusion, periodic=self.layered is not None)
        result = OptimizeResult(plan, stats, replace(selection, status=status), self.rule_files, self.data, floor,
                                bound)
        if status.startswith("stopped") and result.replicated_share >= REPLICATED_WARNING:
            warnings.warn(f"{result.replicated_share:.0%} of the plan's compute steps are replicated and the search "
                          f"was {status} "
                          f"({stats.undone}): its sharded options were never all made; raise Budget.seconds or "
                          f"Budget.nodes", SearchCutWarning, stacklevel=3)
        return result

    def _against_baselines(self, plan: Plan, selection: Selection, egraph: ExtractGraph, model: CostModel,
                           ties: Ties, memory_budget: int | None,
                           objective: Callable[[Plan], float] = attrgetter("cost")) -> tuple[Plan, Selection]:
        """`plan`, or the cheapest hand plan (training.plans.baselines: data parallel, ZeRO-3, a MoE's expert
        parallel) that `objective` (of a plan whose cost is `plan_cost`'s) finds cheaper, lies in the e-graph
        (`egraph.embed`: every step a selectable e-node, so within the outputs and steady ties asked for) and fits
        `memory_budget`. Extraction can miss
        such a plan: an e-class is made once, so a selection never recomputes a value, where the training capture
        recomputes cheap forward values (casts, sigmoids) in the backward pass, fused there and hidden behind the
        gradient reductions (cost.overlap); and a cut ILP hands over to greedy-dag. The selection returned for a
        hand plan is its steps in the e-graph, a value it makes twice chosen once (marked "feasible": nothing
        proven)."""
        cheaper = {}
        best = objective(plan)
        for name, hand in sorted(self.baselines.items()):
            priced = replace(hand, cost=plan_cost(hand, model))
            if objective(priced) < best and (memory_budget is None or max(peak_memory(hand)) <= memory_budget):
                cheaper[name] = priced
        for hand, embedded in embedded_plans(self.decoder, egraph, cheaper, ties):
            if objective(hand) < best:
                best = objective(hand)
                selection = embedded
                plan = replace(hand, notes={**hand.notes, "extractor": embedded.extractor,
                                            "status": "feasible", "extracted_cost": plan.cost})
        return plan, selection

    def _warm_starts(self, egraph: ExtractGraph, hands: tuple[Selection, ...], extractor: str, time_limit: float,
                     ties: Ties, carried: Mapping[str, str]) -> tuple[Selection, ...]:
        """The ILP's warm starts (node n is e-node n in every graph): `hands`, and greedy-dag's steady picks of
        `egraph` (`pins.steady_picks`: the carried inputs replicated, and where its free choice delivered them)."""
        if self.layered is not None or extractor != "ilp" or not ties:  # a folded graph's: none (`_selected`)
            return hands
        return (*hands, *steady_picks(self.decoder, egraph, carried, lambda graph: self._picks.get(
            graph, (), ("greedy-dag", time_limit), None, lambda: extract(graph, "greedy-dag", time_limit))))

    def _fit(self, egraph: ExtractGraph, extractor: str, time_limit: float, budget_of: Callable[[], DeviceBudget],
             ties: Ties, carried: Mapping[str, str], memory_budget: int | None,
             outputs: Outputs, stop_gap: float | None = None, model: CostModel | None = None,
             hands: Sequence[Selection] = (), rivals: Sequence[ExtractGraph] = ()) -> tuple[Plan, Selection]:
        """The extracted plan, checked. Under a memory budget: the plan chosen without it where that fits (the budget
        does not bind), else re-solved with the budget's constraints (`budget_of`) and memory cuts until it fits."""
        base = None
        if memory_budget is not None:
            unbound = self._unbound(egraph, extractor, time_limit, ties, carried, memory_budget, stop_gap, model,
                                    hands)
            if unbound is not None:
                return unbound
            if self.layered is not None:  # the tied ILP alone found no periodic plan within a budget in time
                return self._within_budget(egraph, budget_of, ties, carried, extractor, time_limit, stop_gap, model,
                                           rivals=rivals)
            base = budget_of()
        cuts: list[dict[int, int]] = []
        rounds, tried = 0, []  # the decoded plans over the budget: the leanest is told where none fits

        def within(why: str) -> tuple[Plan, Selection]:  # the ILP gave up: a hand plan that fits, or the error
            return hand_within(egraph, hands, memory_budget, partial(self._lean.hand, egraph, hands=self.baselines),
                               tried, partial(self._budget_error, memory_budget), why)
        while True:
            budget = None if base is None else replace(base, groups=tuple(cuts))
            try:
                selection = self._select(egraph, extractor, time_limit, budget, ties, carried, stop_gap, model, hands)
            except NoFiniteChoiceError as err:
                if budget is None:
                    asked = f"outputs as asked ({outputs!r})" + (" in steady state" if ties else "")
                    raise NoPlanError(f"no plan delivers the {asked}: {err}") from None
                return within(f"{err}" + (f" (after {rounds} rounds of memory cuts)" if rounds else ""))
            problems = validate(egraph, selection)
            if problems:
                raise AssertionError(f"extractor {extractor} returned an invalid selection: {problems[0]}")
            if memory_budget is None:
                plan, step_nodes = self._lean.decode(egraph, selection)
                break
            plan, step_nodes, peaks = self._lean.leaner(egraph, selection)
            if max(p.bytes for p in peaks) <= memory_budget:
                break
            rounds += 1
            tried.append((plan, peaks))
            if rounds > CUT_ROUNDS:
                return within(f"after {CUT_ROUNDS} rounds of memory cuts the ILP's plan still needs "
                              f"{max(p.bytes for p in peaks):,}")
            cuts += [cut for cut in memory_cuts(egraph, step_nodes, peaks, memory_budget) if cut not in cuts]
        if rounds:
            selection = replace(selection, status="feasible")
            plan = replace(plan, notes={**plan.notes, "status": "feasible", "memory_cut_rounds": rounds})
        return plan, selection

    def _within_budget(self, egraph: ExtractGraph, budget_of: Callable[[], DeviceBudget], ties: Ties,
                       carried: Mapping[str, str], extractor: str, time_limit: float, stop_gap: float | None,
                       model: CostModel, incumbent: tuple[Plan, Selection] | None = None,
                       rivals: Sequence[ExtractGraph] = ()) -> tuple[Plan, Selection]:
        """`FoldedCandidates.within_budget` of the hand plans and the greedy-dag fallback (`_select`)."""
        return self.folded.within_budget(
            egraph, budget_of(), ties, carried, self.baselines, self._held,
            lambda priced: self._select(priced, "greedy-dag", time_limit, None, ties, carried, stop_gap),
            extractor, time_limit, stop_gap, model, incumbent, rivals)

    def _unbound(self, egraph: ExtractGraph, extractor: str, time_limit: float, ties: Ties,
                 carried: Mapping[str, str], memory_budget: int,
                 stop_gap: float | None = None, model: CostModel | None = None,
                 hands: Sequence[Selection] = ()) -> tuple[Plan, Selection] | None:
        """The plan chosen without the memory budget, if its exact peak fits: the budget does not bind, so what
        was proven of it holds under the budget too (a small model's plan fits 80 GB whatever it splits). Tried
        first: the budget's constraints made CP-SAT slow (190 CPU s of constraints for a 2-layer LLaMA training
        step on 8x8 at 80 GB) or find nothing in time, for a budget every plan met."""
        try:
            selection = self._select(egraph, extractor, time_limit, None, ties, carried, stop_gap, model, hands)
        except NoFiniteChoiceError:
            return None
        problems = validate(egraph, selection)
        if problems:
            raise AssertionError(f"extractor {selection.extractor} returned an invalid selection: {problems[0]}")
        if max(self._lean.floor(selection)) > memory_budget:  # over in any step order: binds, not decoded
            return None
        plan, _, peaks = self._lean.leaner(egraph, selection)
        if max(p.bytes for p in peaks) > memory_budget:
            return None
        return replace(plan, notes={**plan.notes, "memory_budget": "not binding"}), selection

    @staticmethod
    def _verified(plan: Plan, extractor: str, carried: Mapping[str, str]) -> Plan:
        """The plan, validated (exact: partitions, covered reads, possible moves, by islpy), steady, and with its
        meaning checked; done to the plan kept only (validating 64 devices' blocks is seconds per plan)."""
        validate_plan(plan)
        unsteady = steady_violations(plan, carried)
        if unsteady:
            raise AssertionError(f"extractor {extractor} broke steady state: {unsteady[0]}")
        # a rule that passed check-rules can still be wrong where it was not drawn
        return replace(plan, notes={**plan.notes, "meaning_check": meaning_check(plan)})

    def _select(self, egraph: ExtractGraph, extractor: str, time_limit: float, budget: DeviceBudget | None,
                ties: Ties, carried: Mapping[str, str], stop_gap: float | None = None,
                model: CostModel | None = None, hands: Sequence[Selection] = ()) -> Selection:
        """`_selected`'s selection, made once per graph and arguments where no memory budget is asked (extract.memo:
        an extraction under a budget tries first what one without it chose, `_unbound`)."""
        if budget is not None:
            return self._selected(egraph, extractor, time_limit, budget, ties, carried, stop_gap, model, hands)
        return self._unbudgeted.get(
            egraph, hands, (extractor, time_limit, ties, sorted(carried.items()), stop_gap), model,
            lambda: self._selected(egraph, extractor, time_limit, None, ties, carried, stop_gap, model, hands))

    def _selected(self, egraph: ExtractGraph, extractor: str, time_limit: float, budget: DeviceBudget | None,
                  ties: Ties, carried: Mapping[str, str], stop_gap: float | None = None,
                  model: CostModel | None = None, hands: Sequence[Selection] = ()) -> Selection:
        """The selection `extractor` makes, steady where `ties` ask (module docstring of `extract`); a folded graph's
        periodic candidates are ranked by their expanded plan's time under `model` where given (the objective
        hides reductions or prices fusion as estimates, and mirroring moves costs between copies). The ILP starts
        from the cheapest of `hands` (hand plans as selections) that fits `budget`, where that is cheaper than its
        own warm start, and returns nothing dearer."""
        if not ties or extractor == "ilp":
            start = None  # a folded graph's ILP starts from greedy-dag's periodic selection, and keeps the cheaper
            started = self.layered is not None and extractor == "ilp" and bool(ties) and budget is None
            if started:
                with suppress(NoFiniteChoiceError):
                    start = self._select(egraph, "greedy-dag", time_limit, budget, ties, carried, stop_gap, model)
                if start is not None and not models_in(egraph, time_limit):
                    return start  # what the ILP would return, after seconds of local search (it keeps no twin tie)
            elif extractor == "ilp":  # priced under this graph's costs: infinite where it pins other layouts
                fitting = [replace(hand, dag_cost=dag_cost(egraph, hand.choice)) for hand in hands
                           if budget is None or budget.fits(hand.choice)]
                start = min((hand for hand in fitting if math.isfinite(hand.dag_cost)),
                            key=lambda hand: hand.dag_cost, default=None)
            try:
                found = extract(egraph, extractor, time_limit, budget, ties, self.repeated, stop_gap, start)
                return found if start is None or found.dag_cost <= start.dag_cost else start
            except NoFiniteChoiceError as err:
                if start is not None:
                    return start
                if started or not ties or extractor != "ilp" or budget is not None:  # greedy-dag takes no budget;
                    raise  # where it was the start, it found no steady selection already
                # CP-SAT found no steady selection in time (a training step past a few layers on many devices):
                # greedy-dag's pinned layouts are steady; the selection names its extractor, and proves nothing
                try:  # (where the graph was folded, copy 1 then mirrors copy 0's choice: Layered.mirror)
                    return self._select(egraph, "greedy-dag", time_limit, budget, ties, carried, stop_gap, model)
                except NoFiniteChoiceError:
                    raise err from None
        free = extract(egraph, extractor, time_limit, budget, stop_gap=stop_gap)
        steady: list[Selection] = []
        delivered = delivered_layouts(self.decoder, free, carried)
        aligned = [] if self.layered is None else [
            *(self.layered.aligned(delivered, source) for source in (1, 0)),
            # state kept where copy 1 (run m - 1 times) reads it: on the folded 7B step on 8x8, 19.24 ms at 4
            # layers and 142.16 at 32, where the delivered pins' mirrored choices broke carried pairs
            # (benchmarks/folded_candidates.py)
            self.layered.aligned(placed_layouts(self.decoder, free, carried), 1)]
        if self.layered is not None:  # the free choice itself, each copy's for both, its broken pairs mended
            steady += periodic_selections(self.layered, self.decoder, egraph, free, ties, carried)
        tried: list[dict[str, str]] = []
        for pins in (delivered, *aligned, replicated_layouts(self.decoder, carried)):
            if pins in tried:  # pinned alike (the free choice's layouts were periodic already): extracted alike
                continue
            tried.append(pins)
            try:
                selection = extract(pin_layouts(self.decoder, egraph, pins, carried), extractor, time_limit, budget,
                                    stop_gap=stop_gap)
            except NoFiniteChoiceError:
                continue  # a pinned layout's moves were left unpriced (budget): the other pins
            if self.layered is not None:  # one copy mirrors the other; the steady ties must hold, the twins' one way
                steady += periodic_selections(self.layered, self.decoder, egraph, selection, ties, carried)
            elif ties_hold(selection.choice, ties):
                steady.append(selection)
        if not steady:
            raise NoFiniteChoiceError(f"extractor {extractor!r} found no steady-state plan; use 'ilp'")
        # the cheaper: the layouts the free choice delivered can cost more every step than state kept whole
        # (a small model on 4 ranks sharing 2 cores: 0.0426 s against 0.0171 s replicated)
        if self.layered is not None and model is not None:
            return self.folded.cheapest(egraph, steady, model)
        return min(steady, key=lambda selection: selection.dag_cost)

    def pareto(self, cost_model: CostModel | None = None, extractor: str = "ilp", time_limit: float = 10.0,
               points: int = 6, fastest: OptimizeResult | None = None, micro_batches: int = 1
               ) -> list[OptimizeResult]:
        """Plans not beaten on both predicted time and peak memory, fastest first: the fastest plan (`fastest`
        where the caller extracted it already), then `leaner_plans`, up to `points` tries; a plan the ILP did not
        prove best can be beaten by a leaner one, and is dropped. Time is per update of `micro_batches` runs
        (`extract`)."""
        first = fastest or self.extract(cost_model, extractor, time_limit, micro_batches=micro_batches)
        front = [first, *islice(self.leaner_plans(first, cost_model, extractor, time_limit, micro_batches),
                                points - 1)]

        def time(r: OptimizeResult) -> float:
            return r.plan.notes.get("accumulated_cost", r.plan.cost)

        return [r for i, r in enumerate(front) if all(time(r) < time(later) for later in front[i + 1:])]

    def leaner_plans(self, than: OptimizeResult, cost_model: CostModel | None = None, extractor: str = "ilp",
                     time_limit: float = 10.0, micro_batches: int = 1) -> Iterator[OptimizeResult]:
        """The fastest plan that needs less memory than `than`, then the fastest that needs less than that, until
        none is found (an epsilon-constraint sweep, so points in the front's dents are found too): each an
        extraction under a memory budget, the dearest calls of a search, made only as the caller asks for the
        next (`plan_pipeline` stops where a floor under the next one's time cannot win)."""
        last = than
        while True:
            try:
                last = self.extract(cost_model, extractor, time_limit, memory_budget=last.peak_memory - 1,
                                    micro_batches=micro_batches)
            except MemoryBudgetError:
                return
            yield last


@no_collections()
def explore(graph: Graph, mesh: Mesh | int = 1, rules: Sequence[str | Path] | None = None,
            budget: Budget = Budget(), progress: Callable[[IterationStats], None] | None = None,
            layers: bool | None = None) -> Explored:
    """Saturate: every sharding, fusion and substitution the rules and signatures allow, in one e-graph.

    With `layers=True` a graph of three or more repeated layers (graph.layers) is saturated folded to two of them,
    and its plans are periodic: one layer planned, run by every copy (egraph.layered). By default (None) only
    from FOLD_FROM_COPIES copies; `layers=False` never."""
    mesh = Mesh(mesh) if isinstance(mesh, int) else mesh
    rule_files = load_rules(rules)
    started = clock()
    found = find_layers(graph) if layers is not False else None
    if layers is None and found is not None and found.copies < FOLD_FROM_COPIES:
        found = None
    folded = fold(graph, found) if found is not None else None
    explored = folded.graph if folded is not None else graph
    hands = baselines(explored, mesh)  # the floor's, in the e-graph whatever the budget cuts (a fold's: periodic)
    seeds = tuple(hands.values()) if mesh.size > 1 else ()
    hands.update(recomputed_baselines(explored, mesh, hands) if folded is None else {})  # leaner, not seeds
    gen, _, stats = saturate(explored, mesh, rule_files, budget, progress, seeds, folded.twins if folded else ())
    data = gen.session.serialize()
    nodes, roots, names, stats = make_reshards(data, gen.interner, started, budget, stats)
    decoder = Decoder(nodes, gen.interner, mesh, {n.name: n.dtype for n in explored.inputs}, explored.fixed)
    layered = None if folded is None else Layered(graph, folded, decoder, value_classes(data, explored))
    return Explored(explored, mesh, decoder, tuple(roots), names, stats, tuple(rule_files), data,
                    moves_to_price(budget, mesh), layered, hands)


@no_collections()
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
    outputs: Outputs = "any",
    steady: Mapping[str, str] | None = None,
    layers: bool | None = None,
) -> OptimizeResult:
    """Find the cheapest plan for `graph` on `mesh` among everything the rules and sharding allow.

    `rules` are rule files or directories (default: the package's rules/). `memory_budget` (bytes per
    device) is a hard limit on peak memory; `outputs` picks the outputs' layouts: "any" plain layout,
    "replicated", or per output name a Layout (or "any"/"replicated"). `steady` maps outputs to the inputs they
    replace at the next step (default `graph.carried`, which training imports fill; {} turns it off): each is
    delivered in its input's placed layout. `layers` folds a model's repeated layers to plan one for all
    (`explore`: by default from FOLD_FROM_COPIES layers; True from three; False plans them one by one).
    See `Explored.extract`.
    """
    return explore(graph, mesh, rules, budget, progress, layers).extract(cost_model, extractor, time_limit,
                                                                         memory_budget, outputs, steady)
