"""Builders shared by the extraction tests: tiny e-graphs written as {class: [(cost, children), ...]}."""
from __future__ import annotations

import itertools
import random
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from tapestry.extract import EGraph, Node, Repeated

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


def stacked(blocks: int, per: int, layouts: int, seed: int = 0) -> tuple[EGraph, Repeated]:
    """`blocks` identical copies of a block of `per` values in the style of `layered` (each value in `layouts`
    layout classes joined by reshards, runs reading the value before and maybe the one before that), after a
    placed input; and the copies, aligned, as `tapestry.egraph.repeat` would find them. Position j of every
    block draws its costs and reads from `seed` and j alone, and names its ops by position, so blocks are alike."""
    nodes = [Node(f"v0.{lay}", "place", f"v0.{lay}", 0.0) for lay in range(layouts)]
    for j in range(per):
        rng = random.Random(f"{seed}.{j}")
        runs = [(rng.uniform(1.0, 4.0), [rng.randrange(layouts) for _ in range(2 if j and rng.random() < 0.5 else 1)],
                 rng.randrange(layouts)) for _ in range(2 * layouts)]
        moves = [(rng.uniform(0.1, 1.5), src, dst) for src in range(layouts) for dst in range(layouts) if src != dst]
        for b in range(blocks):
            v = 1 + b * per + j
            nodes += [Node(f"v{v}.run{i}", f"run{j}.{i}", f"v{v}.{out}", cost,
                           tuple(f"v{v - 1 - k}.{r}" for k, r in enumerate(reads)))
                      for i, (cost, reads, out) in enumerate(runs)]
            nodes += [Node(f"v{v}.move{src}.{dst}", "move", f"v{v}.{dst}", cost, (f"v{v}.{src}",))
                      for cost, src, dst in moves]
    last = blocks * per
    nodes += [Node(f"out.{lay}", "deliver", "out", 0.0, (f"v{last}.{lay}",)) for lay in range(layouts)]
    copies = tuple(tuple(f"v{1 + b * per + j}.{lay}" for j in range(per) for lay in range(layouts))
                   for b in range(blocks))
    entry = {f"v0.{lay}": f"v{per}.{lay}" for lay in range(layouts)}
    return EGraph.from_nodes(nodes, ["out"]), Repeated(copies, entry)
