"""Extraction of a repeated block, solved once and reused (Alpa's layer clustering, for e-graph extraction).

A stack of m identical copies of a block (`Repeated`: classes of copy k aligned with copy k+1's) is extracted as
one periodic problem: the prefix before the copies, copy 0, copy 1 standing for copies 1..m-1 (its costs times
m - 1), and the suffix, whose reads of a later copy are redirected to copy 1. Each node of copy 0 is tied to its
twin in copy 1 (same op, cost and children one copy on), so both copies choose alike: copy 1 reads copy 0 as
copy k+1 reads copy k, and copy 0 reads the prefix. That problem is about three layers big whatever m is; its
selection, copied onto copies 2..m-1 twin by twin, is a selection of the whole e-graph that costs no more than
its objective (every node it reaches is counted with its multiplicity there). It is the best periodic plan
the solver finds, not a bound: a plan whose layers differ can be cheaper, so it serves as a warm start.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tapestry.extract.egraph import EGraph, Node
from tapestry.extract.selection import Selection


@dataclass(frozen=True)
class Repeated:
    """`copies[k][i]` (a class id) is repeated by `copies[k + 1][i]`; `entry` maps a class outside the copies
    that copy 0 reads to the class copy 1 reads in its place (a class missing from it is taken as shared by
    every copy, as a constant is)."""

    copies: tuple[tuple[str, ...], ...]
    entry: Mapping[str, str]

    def __post_init__(self) -> None:
        if len({len(copy) for copy in self.copies}) > 1:
            raise ValueError(f"copies must line up class for class; their lengths are "
                             f"{sorted({len(copy) for copy in self.copies})}")
        classes = [c for copy in self.copies for c in copy]
        if len(set(classes)) < len(classes):
            twice = next(c for i, c in enumerate(classes) if c in classes[:i])
            raise ValueError(f"class {twice!r} is in the copies twice; each class belongs to one copy")


MIN_COPIES = 3  # the folded problem models two copies, so fewer save nothing
Solve = Callable[[EGraph, float, Sequence[tuple[int, int]]], Selection]  # (graph, seconds, ties) -> selection


class _Copies:
    """The copies as class indices of one e-graph, and each node's twin one copy on."""

    def __init__(self, egraph: EGraph, repeated: Repeated) -> None:
        index = {c: i for i, c in enumerate(egraph.class_ids)}
        unknown = [c for copy in repeated.copies for c in copy if c not in index]
        if unknown:
            raise ValueError(f"the repeated copies name class {unknown[0]!r}, which the e-graph does not have")
        self.egraph = egraph
        self.copies = [[index[c] for c in copy] for copy in repeated.copies]
        self.where = {c: (k, i) for k, copy in enumerate(self.copies) for i, c in enumerate(copy)}
        self.entry = {index[a]: index[b] for a, b in repeated.entry.items() if a in index and b in index}
        self._nodes: dict[int, dict[tuple[str, float, tuple[int, ...]], int]] = {}

    def image(self, c: int, k: int) -> int | None:
        """Class `c`, read by copy k, as copy k+1 reads it: one copy on, or across the entry, or itself."""
        if c in self.where:
            j, i = self.where[c]
            return self.copies[j + 1][i] if j + 1 < len(self.copies) else None
        return self.entry.get(c, c) if k == 0 else c

    def twin(self, n: int, k: int) -> int | None:
        """The node of copy k+1 that repeats node `n` of copy k."""
        egraph = self.egraph
        c = self.image(egraph.node_class[n], k)
        children = tuple(self.image(d, k) for d in egraph.node_children[n])
        if c is None or None in children:
            return None
        if c not in self._nodes:
            self._nodes[c] = {}
            for m in egraph.class_nodes[c]:
                self._nodes[c].setdefault((egraph.node_ops[m], egraph.node_cost[m], egraph.node_children[m]), m)
        return self._nodes[c].get((egraph.node_ops[n], egraph.node_cost[n], children))  # type: ignore[arg-type]


def periodic_choice(egraph: EGraph, repeated: Repeated, solve: Solve, seconds: float,
                    max_nodes: float = math.inf) -> list[int] | None:
    """A choice per class of `egraph` (-1: none) that repeats one solved copy over all of them, or None when the
    copies cannot be folded (fewer than three, a root inside a later copy, or more than `max_nodes` left)."""
    copies = _Copies(egraph, repeated)
    m = len(copies.copies)
    later = {c for copy in copies.copies[2:] for c in copy}
    if m < MIN_COPIES or any(r in later for r in egraph.roots):
        return None
    size = egraph.num_nodes - sum(len(egraph.class_nodes[c]) for c in later)
    if size > max_nodes:
        return None
    inside = copies.where
    first, second = set(copies.copies[0]), set(copies.copies[1])
    kept = [n for n in range(egraph.num_nodes) if egraph.node_class[n] not in later
            and not (egraph.node_class[n] in inside and any(d in later for d in egraph.node_children[n]))]
    position = {n: i for i, n in enumerate(kept)}  # node of egraph -> node of the folded graph
    twins: dict[int, int | None] = {}
    claimed: set[int | None] = {None}
    for c in copies.copies[0]:
        for n in egraph.class_nodes[c]:
            if n in position:
                twin = copies.twin(n, 0)  # alike nodes have one twin: the first takes it, the rest are left out
                twins[n] = None if twin in claimed else twin
                claimed.add(twin)
    ties = [(position[n], position[t]) for n, t in twins.items() if t in position]
    repeats = {t for _, t in ties}
    folded: list[Node] = []
    for n in kept:
        c = egraph.node_class[n]
        children = tuple(copies.copies[1][inside[d][1]] if d in later else d for d in egraph.node_children[n])
        cost = egraph.node_cost[n]
        if c in first and twins[n] not in position or c in second and position[n] not in repeats:
            cost = math.inf  # no twin: choosing it would break the period
        elif c in second:
            cost *= m - 1
        folded.append(Node(str(n), egraph.node_ops[n], str(c), cost, tuple(map(str, children))))
    graph = EGraph.from_nodes(folded, [str(r) for r in egraph.roots])
    selection = solve(graph, seconds, ties)
    choice = [-1] * egraph.num_classes
    for c, n in selection.choice.items():
        choice[int(graph.class_ids[c])] = kept[n]
    # A class the ties kept active but nothing reachable read is missing from the selection in one copy and not
    # in the other (copy 0's outputs are read by copy 1, copy 1's by the suffix only): copy 1 takes what copy 0
    # chose there, and each later copy what the one before it has.
    for k in range(m - 1):
        for c, d in zip(copies.copies[k], copies.copies[k + 1]):
            if choice[c] >= 0 and (k > 0 or choice[d] < 0):
                twin = copies.twin(choice[c], k)
                choice[d] = -1 if twin is None else twin
    return choice
