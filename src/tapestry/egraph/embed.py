"""A plan built outside the e-graph (a hand plan: training.plans) as a selection of its e-nodes.

Extraction can miss a plan the e-graph holds: the ILP may find no steady selection in its time and hand over to
greedy-dag, and the fused extraction's node costs only estimate `plan_cost` (egraph.fused_prices). A known good
plan found in the e-graph is a selection like any extractor's, decoded and priced the same way, so the optimizer
can keep it where it is cheaper (`Explored.extract`).

Each plan step is matched to the e-node that is the same step (both routes build steps with
`Compute.running`): a Place by input and layout, a Compute by its step less names and origin over its arguments'
classes, a Reshard by its source's class and target layout, an output by its Deliver.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from tapestry.clock import clock
from tapestry.egraph.decode import Decoder
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection, Ties, ties_hold
from tapestry.extract.selection import dag_cost, reachable_choice
from tapestry.plan import Compute, Place, Plan, Reshard


HAND = "hand plan ({})"  # a hand plan's selection's extractor, of its name


def hand_name(extractor: str) -> str | None:
    """The hand plan a selection made by `extractor` embeds (`embedded_plans`), if it does."""
    head, tail = HAND.split("{}")
    return extractor[len(head):-len(tail)] if extractor.startswith(head) and extractor.endswith(tail) else None


class NotInEGraph(ValueError):
    """A plan step the e-graph has no selectable e-node for."""


def plan_selection(decoder: Decoder, egraph: ExtractGraph, plan: Plan, extractor: str) -> Selection:
    """The selection of `egraph` (decoder's nodes, node n = e-node n) that decodes to `plan`'s steps; where the
    plan makes one value in one layout twice, the first step stands for both. NotInEGraph names the first step
    with no selectable e-node (absent, or of infinite cost: unpriced, or excluded by outputs or steady ties)."""
    started = clock()
    by_children: dict[tuple[str, ...], list[int]] = {}
    places: dict[str, list[int]] = {}  # input -> its Place nodes
    for n, node in enumerate(decoder.nodes):
        if node.op == "Place":
            places.setdefault(node.key, []).append(n)
        else:
            by_children.setdefault(node.children, []).append(n)
    layouts = decoder.interner.layouts
    selectable = egraph.selectable

    def match(step: Compute | Reshard, args: tuple[str, ...]) -> int | None:
        for n in by_children.get(args, ()):
            node = decoder.nodes[n]
            if not selectable(n):
                continue
            if isinstance(step, Reshard) and node.op == "Reshard" and layouts[node.key] == (step.shape, step.layout):
                return n
            if isinstance(step, Compute) and node.op not in ("Reshard", "Deliver") \
                    and replace(decoder.interner.runs[node.key], origin="") == step:
                return n
        return None

    choice: dict[str, int] = {}  # distributed class -> chosen node
    value: dict[str, str] = {}  # plan value -> distributed class
    for step in plan.steps:
        if isinstance(step, Place):
            found = next((n for n in places.get(step.input, ()) if selectable(n)
                          and layouts[decoder.nodes[n].layout] == (step.shape, step.layout)), None)
            args: tuple[str, ...] = ()
        else:
            args = tuple(value[a] for a in step.args) if isinstance(step, Compute) else (value[step.src],)
            bare = replace(step, out="?", args=("?",) * len(step.args), origin="") \
                if isinstance(step, Compute) else step
            found = match(bare, args)
        if found is None:
            raise NotInEGraph(f"no selectable e-node for step {step.out} ({type(step).__name__}"
                              + (f" {step.kernel}" if isinstance(step, Compute) else "") + ")")
        value[step.out] = decoder.nodes[found].eclass
        choice.setdefault(value[step.out], found)
    for r in egraph.roots:
        root = egraph.class_ids[r]
        delivers = [n for n in egraph.class_nodes[r] if decoder.nodes[n].op == "Deliver" and selectable(n)
                    and decoder.nodes[n].children[0] == value.get(plan.outputs.get(decoder.nodes[n].key, ""))]
        if not delivers:
            raise NotInEGraph(f"no selectable Deliver of output class {root} from the plan's value")
        choice[root] = delivers[0]
    index = {c: k for k, c in enumerate(egraph.class_ids)}
    per_class = [-1] * len(egraph.class_ids)
    for c, n in choice.items():
        per_class[index[c]] = n
    reach = reachable_choice(egraph, per_class)
    return Selection(reach, dag_cost(egraph, reach), extractor, clock() - started, status="feasible")


def embedded_plans(decoder: Decoder, egraph: ExtractGraph, plans: Mapping[str, Plan], ties: Ties
                   ) -> Iterator[tuple[Plan, Selection]]:
    """Each of `plans` (by name, in name order) that lies in `egraph` keeping `ties`, with its selection: the
    optimizer's hand-plan floor and the ILP's warm starts (optimizer.Explored)."""
    for name, plan in sorted(plans.items()):
        try:
            embedded = plan_selection(decoder, egraph, plan, HAND.format(name))
        except NotInEGraph:
            continue
        if ties_hold(embedded.choice, ties):
            yield plan, embedded
