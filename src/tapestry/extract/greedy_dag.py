"""Greedy DAG extraction: a class's cost is the summed cost of the distinct classes in its cheapest DAG.

Same idea as extraction-gym's "faster-greedy-dag", but classes are finalized in
increasing DAG cost (as in `tree.py`), so every node is priced once, when its last
child class is finalized, and a chosen node only points at earlier classes. The
search stops as soon as every root is finalized.
"""
from __future__ import annotations

import heapq
import time

from tapestry.extract.egraph import EGraph
from tapestry.extract.selection import Selection, finalize
from tapestry.extract.tree import solvable_tree


def greedy_choice(egraph: EGraph) -> list[int]:
    """Per class, the node with the cheapest DAG given already-finalized children (-1 if never reached)."""
    costs = egraph.node_cost
    child_sets, node_class, parents = egraph.child_sets, egraph.node_class, egraph.parents
    best = [-1] * egraph.num_classes
    class_cost = [0.0] * egraph.num_classes
    members: list[frozenset[int]] = [frozenset()] * egraph.num_classes
    dag_cost = [0.0] * egraph.num_classes

    def union(children: tuple[int, ...]) -> tuple[frozenset[int], float]:
        ordered = sorted(children, key=lambda d: len(members[d]), reverse=True)
        base, total = members[ordered[0]], dag_cost[ordered[0]]
        for d in ordered[1:]:
            extra = members[d] - base
            if extra:
                total += sum(map(class_cost.__getitem__, extra))
                base = base | extra
        return base, total

    pending = [len(ch) for ch in child_sets]
    heap = [(costs[n], n) for n in range(egraph.num_nodes) if pending[n] == 0 and egraph.selectable(n)]
    heapq.heapify(heap)
    waiting = set(egraph.roots)
    while heap and waiting:
        _, n = heapq.heappop(heap)
        c = node_class[n]
        if best[c] >= 0:
            continue
        below, total = union(child_sets[n]) if child_sets[n] else (frozenset(), 0.0)
        best[c], class_cost[c] = n, costs[n]
        members[c], dag_cost[c] = below | {c}, total + costs[n]
        waiting.discard(c)
        for p in parents[c]:
            pending[p] -= 1
            if pending[p] == 0 and best[node_class[p]] < 0 and egraph.selectable(p):
                heapq.heappush(heap, (costs[p] + union(child_sets[p])[1], p))
    return best


def extract_greedy_dag(egraph: EGraph) -> Selection:
    """Shares subterms when choosing, unlike bottom-up; acyclic by construction, re-checked in `finalize`."""
    started = time.perf_counter()
    tree = solvable_tree(egraph)
    return finalize(egraph, greedy_choice(egraph), tree, "greedy-dag", started)
