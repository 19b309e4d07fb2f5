"""How many fusion groups every plan of an e-graph launches at least: what the bound (egraph.plan_bound) adds for
their launches, which no node can be charged alone (two members share one).

cost.fusion joins fusible steps into a group only at one epoch (the most unfusible steps, Reshards and library
kernels, on a path from the inputs; Places and prepared steps add none), and a group of one is its step. Along one
path of a plan the epochs never fall and rise past each unfusible step, so the fusible steps of a path that an
unfusible one separates lie in distinct epochs, hence distinct groups, each at least one launch (a group's time and
its members' summed costs both hold one: cost.fusion.fused_costs charges the lesser). Views count for nothing: a
group of views alone is charged their near-zero step costs; so does a fusible step priced below a launch.

Per class, for the paths that end at its step, M: the most such fusible runs on one path, and N: the same plus one
where the path ends past an unfusible step (a fusible reader starts a new run); N is M or M + 1, so V = M + N
orders the pairs. A node's V is made from its children's (an unfusible step: M = the children's most M, N = M + 1;
a counted fusible step: M = N = the larger of 1 and the children's most N; a view, a Deliver: the children's most
of each; a Place or prepared step: 0), never below any child's, and a class's is the least over its nodes: the
least V over the class's derivations (Knuth's generalization of Dijkstra's algorithm, for such superior
functions, on the e-graph's cycles of moves), which lies below the V each acyclic selection gives it. So the roots'
most M bounds the groups of every plan of the e-graph.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from tapestry.cost.fusion import fusible
from tapestry.egraph.decode import Decoder
from tapestry.extract import EGraph as ExtractGraph

TRANSPARENT, UNFUSIBLE, COUNTED, SOURCE = range(4)


def group_launches(decoder: Decoder, egraph: ExtractGraph, launch: float) -> int:
    """The fusion groups every plan of `egraph` (its finite nodes) launches at least: the module docstring's roots'
    most M; a fusible step counts where its node costs a `launch` (seconds, stretched as its step is) or more."""
    kinds = [_kind(decoder, n, cost, launch) for n, cost in enumerate(egraph.node_cost)]
    child_sets = egraph.child_sets
    waiting = [len(child_sets[n]) if kind != SOURCE else 0 for n, kind in enumerate(kinds)]
    readers: dict[int, list[int]] = {}
    for n, kind in enumerate(kinds):
        if kind is not None and kind != SOURCE:
            for d in child_sets[n]:
                readers.setdefault(d, []).append(n)
    value: dict[int, int] = {}  # class -> its least V, once final
    heap = [(0, egraph.node_class[n]) for n, kind in enumerate(kinds) if kind is not None and waiting[n] == 0]
    heapq.heapify(heap)
    while heap:
        v, c = heapq.heappop(heap)
        if c in value:
            continue
        value[c] = v
        for n in readers.get(c, ()):
            waiting[n] -= 1
            if waiting[n] == 0:
                heapq.heappush(heap, (_value(kinds[n], [value[d] for d in child_sets[n]]), egraph.node_class[n]))
    return max((value[r] // 2 for r in egraph.roots if r in value), default=0)


def _kind(decoder: Decoder, n: int, cost: float, launch: float) -> int | None:
    """How node `n` enters the pairs (None: never chosen, at infinite cost)."""
    if not math.isfinite(cost):
        return None
    node = decoder.nodes[n]
    if node.op == "Deliver":
        return TRANSPARENT
    if node.op == "Place" or decoder.prepared(node):
        return SOURCE
    if node.op == "Reshard":
        return UNFUSIBLE
    step = decoder.interner.runs[node.key]
    if not fusible(step):
        return UNFUSIBLE
    return COUNTED if not step.signature.kernel.is_view and cost >= launch * (1 - 1e-9) else TRANSPARENT


def _value(kind: int, children: Sequence[int]) -> int:
    """V of a node of `kind` whose children's classes have V `children` (module docstring)."""
    most = max((v // 2 for v in children), default=0)
    closed = max((v - v // 2 for v in children), default=0)
    if kind == UNFUSIBLE:
        return 2 * most + 1
    if kind == COUNTED:
        return 2 * max(1, closed)
    return most + closed
