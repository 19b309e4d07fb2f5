"""How many fusion groups every plan of an e-graph launches at least: what the bound (egraph.plan_bound) adds for
their launches, which no node can be charged alone (two members share one).

cost.fusion joins fusible steps into a group only at one epoch (the most unfusible steps, Reshards and library
kernels, on a path from the inputs; Places and prepared steps add none), and a group of one is its step. Along one
path of a plan the epochs never fall and rise past each unfusible step, so the fusible steps of a path that an
unfusible one separates lie in distinct epochs, hence distinct groups, each at least one launch (a group's time and
its members' summed costs both hold one: cost.fusion.fused_costs charges the lesser). Views count for nothing: a
group of views alone is charged their near-zero step costs; so does a fusible step priced below a launch.

For the paths that end at a step, M: the most such fusible runs on one path, and N: the same plus one where the
path ends past an unfusible step (a fusible reader starts a new run); N is M or M + 1, so V = M + N orders the
pairs. A node's V is made from its children's (a library kernel: M = the children's most M, N = M + 1; a counted
fusible step: M = N = the larger of 1 and the children's most N; a view, a Deliver: the children's most of each;
a Place or prepared step: 0), never below any child's. A move (Reshard) would only raise its source's V, so it is
passed through: a value's layouts share the least V of the nodes that compute any of them (a lower bound, and a
graph a fifth the size). The least V of each value over its derivations (Knuth's generalization of Dijkstra's
algorithm, for such superior functions, whatever cycles rewrites leave) lies below the V each acyclic selection
gives it, so the roots' most M bounds the groups of every plan of the e-graph.
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
    ids = egraph.class_ids
    index: dict[str, int] = {}
    value_of = [index.setdefault(decoder.class_value.get(c, c), len(index)) for c in ids]  # a value's layouts: one
    nodes = [(n, kind) for n, cost in enumerate(egraph.node_cost) if (kind := _kind(decoder, n, cost, launch))
             is not None]
    children = {n: {value_of[d] for d in egraph.child_sets[n]} for n, kind in nodes if kind != SOURCE}
    readers: dict[int, list[int]] = {}
    for n, read in children.items():
        for d in read:
            readers.setdefault(d, []).append(n)
    waiting = {n: len(read) for n, read in children.items()}
    kinds = dict(nodes)
    least: dict[int, int] = {}  # value -> its least V, once final
    heap = [(0 if kind == SOURCE else _value(kind, ()), value_of[egraph.node_class[n]]) for n, kind in nodes
            if kind == SOURCE or not children[n]]
    heapq.heapify(heap)
    while heap:
        v, c = heapq.heappop(heap)
        if c in least:
            continue
        least[c] = v
        for n in readers.get(c, ()):
            waiting[n] -= 1
            if waiting[n] == 0:
                made = _value(kinds[n], [least[d] for d in children[n]])
                heapq.heappush(heap, (made, value_of[egraph.node_class[n]]))
    return max((least[value_of[r]] // 2 for r in egraph.roots if value_of[r] in least), default=0)


def _kind(decoder: Decoder, n: int, cost: float, launch: float) -> int | None:
    """How node `n` enters the pairs (None: never chosen, at infinite cost, or a move: passed through)."""
    if not math.isfinite(cost):
        return None
    node = decoder.nodes[n]
    if node.op == "Deliver":
        return TRANSPARENT
    if node.op == "Reshard":
        return None
    if node.op == "Place" or decoder.prepared(node):
        return SOURCE
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
