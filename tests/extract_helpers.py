"""Builders shared by the extraction tests: tiny e-graphs written as {class: [(cost, children), ...]}."""
from __future__ import annotations

import itertools
import random
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from tapestry.extract import EGraph, Node

GYM = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "extraction-gym"

Spec = Mapping[str, Sequence[tuple[float, Sequence[str]]]]


def build(classes: Spec, roots: Sequence[str], subsumed: Sequence[str] = ()) -> EGraph:
    """Node ids are "<class>.<i>"; `subsumed` lists node ids to mark subsumed."""
    nodes = [
        Node(f"{c}.{i}", f"op_{c}_{i}", c, cost, tuple(children), f"{c}.{i}" in subsumed)
        for c, options in classes.items()
        for i, (cost, children) in enumerate(options)
    ]
    return EGraph.from_nodes(nodes, roots)


def brute_force(egraph: EGraph) -> float:
    """Cheapest valid acyclic selection by enumerating one node per class; inf if none exists."""
    options = [[n for n in nodes if egraph.selectable(n)] or [-1] for nodes in egraph.class_nodes]
    best = math.inf
    for choice in itertools.product(*options):
        reach: dict[int, int] = {}
        stack, ok = list(egraph.roots), True
        while stack and ok:
            c = stack.pop()
            if c in reach:
                continue
            ok = choice[c] >= 0
            reach[c] = choice[c]
            stack.extend(egraph.child_sets[choice[c]] if ok else ())
        if ok and _acyclic(egraph, reach):
            best = min(best, sum(egraph.node_cost[n] for n in reach.values()))
    return best


def _acyclic(egraph: EGraph, reach: Mapping[int, int]) -> bool:
    state: dict[int, int] = {}

    def visit(c: int) -> bool:
        if state.get(c) == 1:
            return False
        if state.get(c) == 2:
            return True
        state[c] = 1
        ok = all(visit(d) for d in egraph.child_sets[reach[c]])
        state[c] = 2
        return ok

    return all(visit(c) for c in reach)


def layered(values: int, layouts: int, seed: int = 0) -> EGraph:
    """A miniature Tapestry extraction graph: a chain of values, each in `layouts` layout classes joined by
    reshards both ways (so every value is a cyclic component), computed by runs that read the previous value
    (and the one before, like a residual) in given layouts, and one root delivering the last value in any layout.
    Costs are drawn from `seed`: runs dearer than reshards, as on a real mesh."""
    rng = random.Random(seed)
    spec: dict[str, list[tuple[float, list[str]]]] = {}
    for v in range(values):
        for lay in range(layouts):
            options: list[tuple[float, list[str]]] = []
            if v == 0:
                options.append((0.0, []))  # an input placed in this layout
            else:
                for _ in range(2):
                    reads = [f"v{v - 1}.{rng.randrange(layouts)}"]
                    if v >= 2 and rng.random() < 0.5:
                        reads.append(f"v{v - 2}.{rng.randrange(layouts)}")
                    options.append((rng.uniform(1.0, 4.0), reads))
            options.extend((rng.uniform(0.1, 1.5), [f"v{v}.{src}"]) for src in range(layouts) if src != lay)
            spec[f"v{v}.{lay}"] = options
    spec["out"] = [(0.0, [f"v{values - 1}.{lay}"]) for lay in range(layouts)]
    return build(spec, roots=["out"])
