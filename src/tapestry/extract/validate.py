"""Independent check of a selection: trusts nothing the extractor computed."""
from __future__ import annotations

import math

from tapestry.extract.egraph import EGraph
from tapestry.extract.selection import Selection
from tapestry.extract.structure import cyclic_components


def validate(egraph: EGraph, selection: Selection) -> list[str]:
    """Problems with `selection` as readable sentences; empty when it is a valid acyclic extraction."""
    problems: list[str] = []
    choice = selection.choice
    name = egraph.class_ids
    for c, n in choice.items():
        if not (0 <= c < egraph.num_classes and 0 <= n < egraph.num_nodes):
            problems.append(f"class index {c} / node index {n} out of range")
            continue
        if egraph.node_class[n] != c:
            problems.append(f"node {egraph.node_ids[n]!r} chosen for class {name[c]!r} belongs to another class")
        if egraph.node_subsumed[n]:
            problems.append(f"node {egraph.node_ids[n]!r} is subsumed")
        if not math.isfinite(egraph.node_cost[n]):
            problems.append(f"node {egraph.node_ids[n]!r} has infinite cost")
        problems.extend(
            f"child class {name[d]!r} of node {egraph.node_ids[n]!r} has no chosen node"
            for d in egraph.child_sets[n]
            if d not in choice
        )
    problems.extend(f"root class {name[r]!r} has no chosen node" for r in egraph.roots if r not in choice)
    if problems:
        return problems
    return [
        "cycle through classes " + ", ".join(repr(name[c]) for c in sorted(component)[:10])
        for component in cycles(egraph, selection)
    ]


def cycles(egraph: EGraph, selection: Selection) -> list[list[int]]:
    """Cyclic components of the chosen nodes; only meaningful once every child class is covered."""
    choice = selection.choice
    return cyclic_components(choice, lambda c: egraph.child_sets[choice[c]] if c in choice else ())
