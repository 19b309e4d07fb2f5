"""Cheapest tree cost per class (Knuth's lightest-derivation order, a one-pass bottom-up fixpoint).

Classes are finalized in increasing tree cost, so a class's chosen node only has
children finalized before it: the choice is acyclic by construction, and `rank`
(finalization order) is the witness that the cycle repair falls back on.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from tapestry.extract.egraph import EGraph, EGraphError, NoFiniteChoiceError


@dataclass(frozen=True)
class TreeChoice:
    """Per class: chosen node (-1 when no finite acyclic choice exists), its tree cost, finalization rank."""

    node: tuple[int, ...]
    cost: tuple[float, ...]
    rank: tuple[int, ...]

    def extractable(self, eclass: int) -> bool:
        return self.node[eclass] >= 0


def tree_choice(egraph: EGraph) -> TreeChoice:
    """Cheapest tree per class; repeated children count every time, as in extraction-gym's bottom-up."""
    child_sets = egraph.child_sets
    pending = [len(ch) for ch in child_sets]
    node_cost = egraph.node_cost
    heap: list[tuple[float, int]] = [
        (node_cost[n], n) for n in range(egraph.num_nodes) if pending[n] == 0 and egraph.selectable(n)
    ]
    heapq.heapify(heap)
    best = [-1] * egraph.num_classes
    cost = [math.inf] * egraph.num_classes
    rank = [-1] * egraph.num_classes
    finalized = 0
    node_class, node_children, parents = egraph.node_class, egraph.node_children, egraph.parents
    while heap:
        value, n = heapq.heappop(heap)
        c = node_class[n]
        if best[c] >= 0:
            continue
        best[c], cost[c], rank[c] = n, value, finalized
        finalized += 1
        for p in parents[c]:
            pending[p] -= 1
            if pending[p] == 0 and best[node_class[p]] < 0 and egraph.selectable(p):
                heapq.heappush(heap, (node_cost[p] + sum(cost[d] for d in node_children[p]), p))
    return TreeChoice(node=tuple(best), cost=tuple(cost), rank=tuple(rank))


def solvable_tree(egraph: EGraph) -> TreeChoice:
    """Tree choice after checking that there is something to extract: every extractor starts here. Made once per
    graph (`EGraph.priced`)."""
    if not egraph.roots:
        raise EGraphError("the e-graph has no root e-classes; nothing to extract")
    tree = egraph.priced("tree", tree_choice)
    for root in egraph.roots:
        if not tree.extractable(root):
            raise NoFiniteChoiceError(
                f"root e-class {egraph.class_ids[root]!r} has no finite choice "
                "(every node is subsumed, infinite-cost, or needs a cycle or an unextractable class)"
            )
    return tree
