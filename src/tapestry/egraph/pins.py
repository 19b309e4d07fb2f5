"""Which Place and Deliver nodes an extraction may choose: the outputs' layouts asked for, and a training step's
steady state (each carried input placed in the layout its output is delivered in, so the step repeats).

Each returns the extraction graph with the excluded nodes at infinite cost, or the pairs the ILP keeps together.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import replace

from tapestry.egraph.decode import Decoder
from tapestry.egraph.layered import Layered
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import NoFiniteChoiceError, Selection, Ties, ties_hold
from tapestry.graph import Graph, GraphError
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


def _chosen_places(decoder: Decoder, choice: Mapping[int, int], inputs: set[str]) -> dict[str, list[int]]:
    """Input (of `inputs`) -> the Place nodes `choice` chose for it."""
    placed: dict[str, list[int]] = {}
    for n in choice.values():
        node = decoder.nodes[n]
        if node.op == "Place" and node.key in inputs:
            placed.setdefault(node.key, []).append(n)
    return placed


def steady_repaired(decoder: Decoder, egraph: ExtractGraph, choice: Mapping[int, int],
                    carried: Mapping[str, str]) -> dict[int, int] | None:
    """`choice` (class -> node) with each carried pair it breaks mended by the cheaper of two moves: the input
    placed in the layout its output is delivered in (each other layout it was placed in made by a reshard from
    that one: the state kept as delivered, moved for its readers), or the output delivered in the one layout its
    input is placed in (moved there by a reshard from the layout the step computes it in). None where a pair has
    neither move (the pricing budget left it out). A free extraction breaks such pairs where the layout its
    forward pass reads and the one its update writes differ; this keeps its other choices."""
    index = {c: i for i, c in enumerate(egraph.class_ids)}
    costs = egraph.node_cost
    found = dict(choice)
    placed = _chosen_places(decoder, choice, set(carried.values()))
    delivered = {decoder.nodes[n].key: n for n in choice.values()  # carried output -> its chosen Deliver node
                 if decoder.nodes[n].op == "Deliver" and decoder.nodes[n].key in carried}
    places = {(node.key, node.layout): n for n, node in enumerate(decoder.nodes)
              if node.op == "Place" and node.key in placed and math.isfinite(costs[n])}

    def move(into: str, source: str) -> int | None:
        """The cheapest finite node of class `into` made from class `source` alone (a reshard)."""
        moves = [n for n in egraph.class_nodes[index[into]] if math.isfinite(costs[n])
                 and egraph.child_sets[n] == (index[source],)]
        return min(moves, key=lambda n: (costs[n], n), default=None)

    for out, name in sorted(carried.items()):
        if out not in delivered or name not in placed:
            continue
        deliver = decoder.nodes[delivered[out]]
        want = decoder.class_layout[deliver.children[0]]
        layouts = sorted(decoder.nodes[n].layout for n in placed[name])
        if layouts == [want]:
            continue
        options: list[tuple[float, dict[int, int]]] = []
        place = places.get((name, want))
        if place is not None:  # placed as delivered, moved for its readers
            edit = {index[decoder.nodes[place].eclass]: place}
            for n in placed[name]:
                if decoder.nodes[n].layout != want:
                    reshard = move(decoder.nodes[n].eclass, decoder.nodes[place].eclass)
                    if reshard is None:
                        break
                    edit[index[decoder.nodes[n].eclass]] = reshard
            else:
                options.append((sum(costs[n] for n in edit.values()) - sum(costs[n] for n in placed[name]), edit))
        if len(layouts) == 1:  # delivered as placed, moved from the layout computed
            alike = [n for n in egraph.class_nodes[index[deliver.eclass]] if math.isfinite(costs[n])
                     and decoder.class_layout[decoder.nodes[n].children[0]] == layouts[0]]
            for n in alike:
                into = decoder.nodes[n].children[0]
                edit = {index[deliver.eclass]: n}
                if index[into] not in found:
                    reshard = move(into, deliver.children[0])
                    if reshard is None:
                        continue
                    edit[index[into]] = reshard
                options.append((sum(costs[m] for m in edit.values()) - costs[delivered[out]], edit))
        if not options:
            return None
        found.update(min(options, key=lambda option: (option[0], sorted(option[1].items())))[1])
    return found


def delivered_layouts(decoder: Decoder, free: Selection, carried: Mapping[str, str]) -> dict[str, str]:
    """Carried input -> the layout (key) `free` delivered its output in (a selectable Deliver has a Place
    partner: `steady_ties`)."""
    pinned: dict[str, str] = {}
    for n in free.choice.values():
        node = decoder.nodes[n]
        if node.op == "Deliver" and node.key in carried:
            pinned[carried[node.key]] = decoder.class_layout[node.children[0]]
    return pinned


def placed_layouts(decoder: Decoder, free: Selection, carried: Mapping[str, str]) -> dict[str, str]:
    """Carried input -> the layout (key) `free` placed it in (of several, the least key): state kept where a reader
    reads it and the update made to deliver it there, where `delivered_layouts` keeps it where the update writes
    it. (Preferring the delivered one of several made these the delivered pins on the folded 7B step.)"""
    placed = _chosen_places(decoder, free.choice, set(carried.values()))
    return {name: min(decoder.nodes[n].layout for n in nodes) for name, nodes in placed.items()}


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


def periodic_selections(layered: Layered, decoder: Decoder, egraph: ExtractGraph, selection: Selection, ties: Ties,
                        carried: Mapping[str, str]) -> list[Selection]:
    """`selection` of a folded graph made periodic each way (Layered.mirror: copy 1 as copy 0, copy 0 as copy 1),
    a carried pair it breaks mended by a reshard (`steady_repaired`) and mirrored again, where copy 1 then runs
    the twin of all copy 0 runs and the steady ties hold."""
    twins = set(layered.ties())
    steady = [t for t in ties if t not in twins]
    found = []
    for source in (0, 1):
        mirrored = layered.mirror(egraph, selection, source)
        if not ties_hold(mirrored.choice, steady):
            repaired = steady_repaired(decoder, egraph, mirrored.choice, carried)
            if repaired is None:
                continue
            mirrored = layered.mirror(egraph, replace(mirrored, choice=repaired), source)
        if layered.holds(mirrored) and ties_hold(mirrored.choice, steady):
            found.append(mirrored)
    return found


def steady_picks(decoder: Decoder, egraph: ExtractGraph, carried: Mapping[str, str],
                 pick: Callable[[ExtractGraph], Selection]) -> tuple[Selection, ...]:
    """`pick`'s choices (an extractor that keeps no ties: greedy-dag) of `egraph` with the carried inputs pinned
    replicated, and pinned where its free choice delivered them, where that leaves a plan (the free choice's pins
    can need moves the pricing budget left out): steady selections, the ILP's warm starts. Both, as the two keep
    state apart: replicated, a data-parallel step; as delivered, the free choice's (on the 70B layer on 8x8, the
    state split over all 64 devices: 9.9 ms a micro-batch, where the ILP under a memory budget kept its
    data-and-tensor-parallel hand-plan start, 15.2 ms; docs/benchmarks.md, "The 70B layer's regression")."""
    found = []
    for pins in (lambda: replicated_layouts(decoder, carried), lambda: delivered_layouts(decoder, pick(egraph),
                                                                                          carried)):
        with suppress(NoFiniteChoiceError):
            found.append(pick(pin_layouts(decoder, egraph, pins(), carried)))
    return tuple(found)


def check_carried(graph: Graph, carried: Mapping[str, str]) -> None:
    """`steady` pairs outputs and inputs of the graph that match, each input carried once."""
    for out, name in carried.items():
        graph.check_carry(out, name)
    twice = [name for name, n in Counter(carried.values()).items() if n > 1]
    if twice:
        raise GraphError(f"steady: input {twice[0]!r} is carried by more than one output")
