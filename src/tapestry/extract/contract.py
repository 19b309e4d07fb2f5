"""A cheap lower bound for large e-graphs: the LP of a contracted problem (docs/extraction.md, "Contracted bound").

On Tapestry's e-graphs most candidates are reshards between the layouts of one value: 39,490 of the 41,850 that
the 2-layer LLaMA on `Mesh(2, 2)` leaves after `ilp.reduce`, and the ILP's first LP (relax.py) takes 5-11 s on
them. A node that reads a class of its own block (`ilp._block`: one value's layouts) is an *inner* node; it is
never its block's entry. Contracted, each class's inner nodes become one node that costs the cheapest of them and
reads only its own class (so it needs no other layout active, and is still no entry). Every selection of the
e-graph maps to a selection of the contracted problem that costs no more and keeps every constraint of the LP:
each chosen inner node becomes its class's contracted node; entries, hence sources, readers and needs, are the
same nodes reading the same classes. So the contracted LP's optimum is at most the e-graph's LP optimum, and a
lower bound on every selection's cost. Path cuts are left out: they follow chains of reshards, which the
contraction cuts. It keeps a quarter of LLaMA's candidates and 42% of GPT-NeoX's (whose reshards from one strongly
connected component of a value's layouts into another are entries, kept); its LP took 0.45 and 1.23 CPU s where
the full one took 6.43 and 16.79 (`benchmarks/contract.py`, docs/extraction.md).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from tapestry.extract.egraph import EGraph
from tapestry.extract.relax import lp_bound


def contracted(egraph: EGraph, candidates: Mapping[int, Sequence[int]],
               block: Mapping[int, int]) -> tuple[EGraph, dict[int, tuple[int, ...]]]:
    """The contracted problem: the e-graph with one node appended per class that has inner nodes (its cheapest
    inner cost, its own class as its child), and the candidates per class with those nodes in the inner ones'
    place."""
    child_sets, cost = egraph.child_sets, egraph.node_cost
    kept: dict[int, tuple[int, ...]] = {}
    added: list[tuple[int, float]] = []  # (class, cost) of each contracted node, numbered after egraph's
    for c, nodes in candidates.items():
        inner = {n for n in nodes if any(block[d] == block[c] for d in child_sets[n])}
        if not inner:
            kept[c] = tuple(nodes)
            continue
        kept[c] = (*(n for n in nodes if n not in inner), egraph.num_nodes + len(added))
        added.append((c, min(cost[n] for n in inner)))
    members = [list(nodes) for nodes in egraph.class_nodes]
    for i, (c, _) in enumerate(added):
        members[c].append(egraph.num_nodes + i)
    graph = replace(
        egraph,
        node_ids=egraph.node_ids + tuple(f"{egraph.class_ids[c]}.contracted" for c, _ in added),
        node_ops=egraph.node_ops + ("contracted",) * len(added),
        node_class=egraph.node_class + tuple(c for c, _ in added),
        node_cost=egraph.node_cost + tuple(k for _, k in added),
        node_children=egraph.node_children + tuple((c,) for c, _ in added),
        node_subsumed=egraph.node_subsumed + (False,) * len(added),
        class_nodes=tuple(map(tuple, members)),
    )
    return graph, kept


def contracted_bound(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                     needs: Mapping[int, Sequence[int]], deadline: float) -> float:
    """A lower bound on every selection's cost: the contracted problem's LP (0 when not solved by `deadline`).
    `candidates`, `block` and `needs` are the ILP's (`ilp.Reduced`)."""
    graph, kept = contracted(egraph, candidates, block)
    return lp_bound(graph, kept, block, needs, deadline)
