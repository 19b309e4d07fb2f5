"""Cheapest tree cost per class (Knuth's lightest-derivation order, a one-pass bottom-up fixpoint).

Classes are finalized in increasing tree cost, so a class's chosen node only has
children finalized before it: the choice is acyclic by construction, and `rank`
(finalization order) is the witness that the cycle repair falls back on.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
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

    def all_extractable(self, classes: Iterable[int]) -> bool:
        """`extractable` of every class of `classes` (true of none), as one `min` at C speed: greedy-dag's moves
        ask it of each candidate node's children."""
        return min(map(self.node.__getitem__, classes), default=0) >= 0


def tree_choice(egraph: EGraph) -> TreeChoice:
    """Cheapest tree per class; repeated children count every time, as in extraction-gym's bottom-up."""
    pending = list(egraph.child_counts)
    node_cost, selectable, node_class = egraph.node_cost, egraph.selectable_nodes, egraph.node_class
    front = class_fronts(egraph)
    heap = leaves(egraph, front, pending)
    best = [-1] * egraph.num_classes
    cost = [math.inf] * egraph.num_classes
    rank = [-1] * egraph.num_classes
    finalized = 0
    node_children, parents = egraph.node_children, egraph.parents
    while heap:
        value, n = heapq.heappop(heap)
        c = node_class[n]
        if best[c] >= 0:
            continue
        best[c], cost[c], rank[c] = n, value, finalized
        finalized += 1
        for p in parents[c]:
            pending[p] -= 1
            if pending[p] == 0 and best[node_class[p]] < 0 and selectable[p]:
                entry = (node_cost[p] + sum(map(cost.__getitem__, node_children[p])), p)
                if entry < front[node_class[p]]:  # else its class's node queued before pops first
                    front[node_class[p]] = entry
                    heapq.heappush(heap, entry)
    return TreeChoice(node=tuple(best), cost=tuple(cost), rank=tuple(rank))


def class_fronts(egraph: EGraph) -> list[tuple[float, int]]:
    """Per class, the least (priority, node) queued so far: none yet (a key above every node's).

    The lightest-derivation searches (`tree_choice`, greedy-dag's) pop nodes by (priority, node) and finalize a
    class with the first of its nodes popped, so a node queued behind a less one of its class is never chosen:
    it is not queued (exact: the same classes finalized with the same nodes, in the same order; most of a
    training step's nodes are reshards, about sixteen per class, ~200,000 on the folded 7B step)."""
    return [(math.inf, egraph.num_nodes)] * egraph.num_classes


def leaves(egraph: EGraph, front: list[tuple[float, int]], pending: Sequence[int]) -> list[tuple[float, int]]:
    """The heap of the selectable nodes with no children, each the least of its class (`class_fronts`)."""
    node_cost, selectable, node_class = egraph.node_cost, egraph.selectable_nodes, egraph.node_class
    for n in range(egraph.num_nodes):
        if pending[n] == 0 and selectable[n] and (node_cost[n], n) < front[node_class[n]]:
            front[node_class[n]] = (node_cost[n], n)
    heap = [entry for entry in front if entry[1] < egraph.num_nodes]
    heapq.heapify(heap)
    return heap


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
