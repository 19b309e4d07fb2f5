"""Greedy DAG extraction: a class's cost is the summed cost of the distinct classes in its cheapest DAG.

Same idea as extraction-gym's "faster-greedy-dag", but classes are finalized in
increasing DAG cost (as in `tree.py`), so every node is priced once, when its last
child class is finalized, and a chosen node only points at earlier classes. The
search stops as soon as every root is finalized. A local search (`improve`) then
re-chooses one class at a time while that lowers the DAG cost of the whole selection.
With a `deadline` (as the ILP's warm start has) the local search stops when its tries (TRIES_PER_SECOND) reach
it, keeping the moves made so far; the greedy search always finishes: stopped, it left classes to the tree choice,
which recomputes
what the DAG shares (a 2x2x2 mesh's 24- and 48-layer stacks came out 3.2x and 5.5x dearer than greedy-dag).
"""
from __future__ import annotations

import heapq
import math

from tapestry.clock import clock
from tapestry.extract.egraph import EGraph
from tapestry.extract.selection import Selection, children_first, finalize, reachable_choice
from tapestry.extract.structure import cyclic_components
from tapestry.extract.tree import TreeChoice, class_fronts, leaves, solvable_tree
from tapestry.extract.work import Deadline

CHECK_EVERY = 4096  # classes the local search visits between looks at the clock (the safety net's)
# Tries of the local search (a selected class visited, each class a priced move adds or drops and each of its
# children; a reordering of the selection its classes / REORDER_CLASSES) per second of work (`work.Meter`): CPU
# seconds of `improve` from greedy-dag's choice on Mixtral's 2-layer training step on 8 devices (17,846 nodes:
# 128,718 tries in 0.18 s) and on `layered` graphs (300 x 12: 1,114,769 in 1.53 s; 60 x 4: 6,000 in 0.013 s), at
# load ~14: 480,000-730,000 a second (`python benchmarks/extract_work.py --layered`).
TRIES_PER_SECOND = 700_000
REORDER_CLASSES = 32


def greedy_choice(egraph: EGraph) -> list[int]:
    """Per class, the node with the cheapest DAG given already-finalized children (-1 if never reached)."""
    costs = egraph.node_cost
    child_sets, node_class, parents = egraph.child_sets, egraph.node_class, egraph.parents
    best = [-1] * egraph.num_classes
    class_cost = [0.0] * egraph.num_classes
    members: list[frozenset[int]] = [frozenset()] * egraph.num_classes
    dag_cost = [0.0] * egraph.num_classes

    def union(children: tuple[int, ...]) -> tuple[frozenset[int], float]:
        if len(children) == 1:  # most nodes (a reshard, a Place): what the one child's DAG holds
            return members[children[0]], dag_cost[children[0]]
        ordered = sorted(children, key=lambda d: len(members[d]), reverse=True)
        base, total = members[ordered[0]], dag_cost[ordered[0]]
        for d in ordered[1:]:
            extra = members[d] - base
            if extra:
                total += sum(map(class_cost.__getitem__, extra))
                base = base | extra
        return base, total

    selectable = egraph.selectable_nodes
    pending = list(egraph.child_counts)
    front = class_fronts(egraph)
    heap = leaves(egraph, front, pending)
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
            if pending[p] == 0 and best[node_class[p]] < 0 and selectable[p]:
                entry = (costs[p] + union(child_sets[p])[1], p)
                if entry < front[node_class[p]]:  # else its class's node queued before pops first
                    front[node_class[p]] = entry
                    heapq.heappush(heap, entry)
    return best


def improve(egraph: EGraph, choice: list[int], tree: TreeChoice, deadline: Deadline | None = None,
            frozen: frozenset[int] = frozenset()) -> list[int]:
    """Local search: switch one reachable class to another node while the selection's DAG cost drops.

    `choice` must name a node for every class (classes outside the selection keep
    theirs for when a move reaches them) and be acyclic on the classes the roots
    reach. Reference counts (chosen parents per class) price a move exactly: the
    new node's children that were unused join with their own choices, and classes
    the old node alone kept alive leave. An improving move is kept only if the new
    selection is still acyclic. Every kept move lowers the cost, so the search ends.
    A children-first position of the selected classes makes most acyclicity checks
    local (`joining`): a move is acyclic if its new children are selected classes placed
    before its class, or unselected ones whose own choices lead only there; the classes
    that join then get positions in between. Any other move re-checks the whole
    selection and recomputes the positions (on a 47,000-node e-graph that alone took 18 s).
    With `deadline`, the search stops where its tries reach it (charged to its meter), or at the safety net.
    No move adds or drops a node of `frozen` (the ILP's tied nodes: a selection that keeps its ties keeps them).
    """
    cost, child_sets, selectable, all_extractable = (egraph.node_cost, egraph.child_sets, egraph.selectable_nodes,
                                                     tree.all_extractable)
    choice = list(choice)
    refs = [0] * egraph.num_classes
    for root in egraph.roots:
        refs[root] += 1
    for node in reachable_choice(egraph, choice).values():
        for d in child_sets[node]:
            refs[d] += 1
    total = sum(cost[choice[c]] for c in range(egraph.num_classes) if refs[c])
    tries = 0

    def usable(c: int, node: int) -> bool:
        return selectable[node] and c not in child_sets[node] and all_extractable(child_sets[node])

    def delta(c: int, new: int) -> tuple[float, dict[int, int]]:
        """Cost change and reference-count changes of choosing `new` for class `c`, additions first; infinite
        where a node of `frozen` would join or leave."""
        nonlocal tries
        change: dict[int, int] = {}
        had = change.get
        price = cost[new] - cost[choice[c]]
        for step, first in ((1, new), (-1, choice[c])):  # the classes joining, then those leaving
            work = list(child_sets[first])
            tries += len(work)
            while work:
                d = work.pop()
                so_far = had(d, 0)
                before = refs[d] + so_far
                change[d] = so_far + step
                if (before == 0) != (before + step == 0):  # d joins or leaves the selection
                    node = new if d == c else choice[d]
                    if node in frozen:
                        return math.inf, change
                    price += step * cost[node]
                    work += child_sets[node]
                    tries += len(child_sets[node])
        return price, change

    def positions() -> dict[int, float]:
        return {k: float(i) for i, k in enumerate(children_first(egraph, choice))}

    def reaches(start: int, c: int) -> bool:
        """Whether selected class `start` reaches `c` through the chosen nodes; only classes placed after `c`
        can (a class's descendants all lie before it)."""
        stack, seen = [start], {start}
        while stack:
            d = stack.pop()
            if d == c:
                return True
            for e in child_sets[choice[d]]:
                if e not in seen and position[e] >= position[c]:
                    seen.add(e)
                    stack.append(e)
        return False

    def joining(c: int, new: int) -> tuple[list[int], float] | bool:
        """Whether choosing `new` for `c` closes a cycle (True), may reorder the selection (False), or else the
        unselected classes it brings in, children first, and the latest position of a selected class they or
        `new` reach (new positions for them go between that and `c`'s)."""
        order: list[int] = []
        seen: set[int] = set()
        low = position[c] - 1
        reorders = False
        stack = [(d, False) for d in child_sets[new]]
        while stack:
            d, expanded = stack.pop()
            if expanded:
                order.append(d)
            elif refs[d]:
                if d == c or (position[d] >= position[c] and reaches(d, c)):
                    return True
                reorders = reorders or position[d] >= position[c]
                low = max(low, position[d])
            elif d in seen:  # met twice: may be a cycle among the joining classes
                return cyclic_components(reachable_choice(egraph, choice), lambda k: child_sets[choice[k]]) != []
            else:
                seen.add(d)
                stack.append((d, True))
                stack.extend((e, False) for e in child_sets[choice[d]])
        return False if reorders else (order, low)

    position = positions()
    allowed = math.inf if deadline is None else deadline.left() * TRIES_PER_SECOND
    try:
        improved = True
        while improved:
            improved = False
            for c in range(egraph.num_classes):
                if tries >= allowed or (c % CHECK_EVERY == 0 and deadline is not None and deadline.safety()):
                    return choice  # every kept move left a valid selection
                if not refs[c]:
                    continue
                tries += 1
                if choice[c] in frozen:
                    continue
                for new in egraph.class_nodes[c]:
                    if new == choice[c] or new in frozen or not usable(c, new):
                        continue
                    price, change = delta(c, new)
                    if price >= -1e-12 * total:
                        continue
                    old, choice[c] = choice[c], new
                    joins = joining(c, new)
                    if joins is True:
                        choice[c] = old
                        continue
                    for d, step in change.items():
                        refs[d] += step
                    total += price
                    improved = True
                    if joins is False:
                        position = positions()
                        tries += len(position) // REORDER_CLASSES
                    else:  # between the latest selected class they reach and c, children first
                        order, low = joins
                        for i, d in enumerate(order, 1):
                            position[d] = low + (position[c] - low) * i / (len(order) + 1)
    finally:
        if deadline is not None:
            deadline.meter.charge(tries / TRIES_PER_SECOND)
    return choice


def greedy_dag_choice(egraph: EGraph, tree: TreeChoice, deadline: Deadline | None = None,
                      frozen: frozenset[int] = frozenset()) -> list[int]:
    """Greedy DAG choice made acyclic, then locally improved until `deadline` (no move adding or dropping a node of
    `frozen`); a node for every class (tree choice if unreached)."""
    greedy = greedy_choice(egraph)
    start = finalize(egraph, greedy, tree, "greedy-dag", 0.0).choice
    full = [start.get(c, g if g >= 0 else t) for c, (g, t) in enumerate(zip(greedy, tree.node))]
    return improve(egraph, full, tree, deadline, frozen)


def extract_greedy_dag(egraph: EGraph) -> Selection:
    """Shares subterms when choosing, unlike bottom-up; acyclic by construction, re-checked in `finalize`."""
    started = clock()
    tree = solvable_tree(egraph)
    return finalize(egraph, greedy_dag_choice(egraph, tree), tree, "greedy-dag", started)
