"""Which Place and Deliver nodes an extraction may choose: the outputs' layouts asked for, and a training step's
steady state (each carried input placed in the layout its output is delivered in, so the step repeats).

Each returns the extraction graph with the excluded nodes at infinite cost, or the pairs the ILP keeps together.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from tapestry.egraph.decode import Decoder
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection, Ties
from tapestry.sharding import Layout, Mesh

Outputs = str | Mapping[str, "str | Layout"]  # "any", "replicated", or per output name one of those or a Layout


def steady_ties(decoder: Decoder, egraph: ExtractGraph, carried: Mapping[str, str]) -> tuple[ExtractGraph, Ties]:
    """Pairs (Place of input X in layout L, Deliver of its carried output in L); a Place or Deliver with no
    partner in its layout is unselectable: the output could not come back, or the input never arrive."""
    places: dict[tuple[str, str], int] = {}
    delivers: dict[tuple[str, str], int] = {}
    into = dict(carried)
    for n, node in enumerate(decoder.nodes):
        if node.op == "Place" and node.key in into.values():
            places[(node.key, node.layout)] = n
        elif node.op == "Deliver" and node.key in into:
            delivers[(into[node.key], decoder.class_layout[node.children[0]])] = n
    ties = [(places[k], delivers[k]) for k in places.keys() & delivers.keys()]
    costs = list(egraph.node_cost)
    for k in places.keys() ^ delivers.keys():
        costs[places.get(k, delivers.get(k))] = math.inf  # type: ignore[index]
    return (egraph.with_costs(costs) if ties or places or delivers else egraph), sorted(ties)

def delivered_layouts(decoder: Decoder, free: Selection, carried: Mapping[str, str]) -> dict[str, str]:
    """Carried input -> the layout (key) `free` delivered its output in (a selectable Deliver has a Place
    partner: `steady_ties`)."""
    pinned: dict[str, str] = {}
    for n in free.choice.values():
        node = decoder.nodes[n]
        if node.op == "Deliver" and node.key in carried:
            pinned[carried[node.key]] = decoder.class_layout[node.children[0]]
    return pinned

def replicated_layouts(decoder: Decoder, carried: Mapping[str, str]) -> dict[str, str]:
    """Carried input -> its replicated layout (key): pins that always leave a plan, as every value has its
    replicated run and the moves out of a replicated layout are always priced (docs/cost-models.md,
    "Budgets"), where the pins `free` chose can need moves the pricing budget left out."""
    inputs = set(carried.values())
    layouts = decoder.interner.layouts
    return {node.key: node.layout for node in decoder.nodes
            if node.op == "Place" and node.key in inputs
            and layouts[node.layout][1] == Layout.replicated(layouts[node.layout][0], decoder.mesh)}

def pin_layouts(decoder: Decoder, egraph: ExtractGraph, pinned: Mapping[str, str],
                 carried: Mapping[str, str]) -> ExtractGraph:
    """Each carried input allowed only its `pinned` layout (key), and its output only that one."""
    costs = list(egraph.node_cost)
    for n, node in enumerate(decoder.nodes):
        if node.op == "Place" and node.key in pinned and node.layout != pinned[node.key]:
            costs[n] = math.inf
        elif node.op == "Deliver" and carried.get(node.key) in pinned:
            if decoder.class_layout[node.children[0]] != pinned[carried[node.key]]:
                costs[n] = math.inf
    return egraph.with_costs(costs)

def restrict_outputs(decoder: Decoder, egraph: ExtractGraph, outputs: Outputs) -> ExtractGraph:
    """Deliver nodes of unwanted output layouts become unselectable (infinite cost)."""
    if outputs == "any":
        return egraph
    costs = list(egraph.node_cost)
    for n, node in enumerate(decoder.nodes):
        if node.op == "Deliver":
            want = outputs if isinstance(outputs, str) else outputs.get(node.key, "any")
            shape, layout = decoder.interner.layouts[decoder.class_layout[node.children[0]]]
            if not _delivers(want, shape, layout, decoder.mesh):
                costs[n] = math.inf
    return egraph.with_costs(costs)


def _delivers(want: str | Layout, shape: tuple[int, ...], layout: Layout, mesh: Mesh) -> bool:
    if want == "any":
        return True
    if want == "replicated":
        return layout == Layout.replicated(shape, mesh)
    return layout == want
