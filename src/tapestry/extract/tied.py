"""The ILP's search for a tied selection where it has no work left to model the graph (`ilp.models_in`): the
greedy local search keeps no tie, so without this the ILP returned its caller's start as it came (LLaMA 13B's
training step on 8x8, 258,033 nodes: at 4d5983f the DP x TP hand plan, 65.58 ms, where greedy-dag's plan costs
44.41; docs/benchmarks.md, "The tied ILP improves its start").

The cheapest selection that keeps every tie of: the free warm start, the caller's start, that start with each
untied class re-chosen by greedy-dag's local search (`improve` with the tied nodes frozen: none joins or leaves),
and greedy-dag's choice on the graph pinned to the pairs the free warm start takes (each pair whose second node it
chose kept, every other tied node unselectable; for a training step's (Place, Deliver) pairs, each weight placed in
the layout the free choice delivers its update in, greedy-dag's "delivered" pins), improved alike.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import suppress

from tapestry.extract.constraints import Ties, tied_nodes, ties_hold
from tapestry.extract.egraph import EGraph, NoFiniteChoiceError
from tapestry.extract.greedy_dag import greedy_dag_choice, improve
from tapestry.extract.selection import Selection, finalize
from tapestry.extract.tree import TreeChoice, solvable_tree
from tapestry.extract.work import Deadline


def tied_search(egraph: EGraph, tree: TreeChoice, free: Sequence[int], start: Selection | None, ties: Ties,
                deadline: Deadline, started: float) -> Selection | None:
    """The cheapest of `start` improved and the free choice's pinned pairs extracted (module docstring) that keeps
    `ties`, or None where neither does. `free` names a node for every class (the ILP's warm start)."""
    frozen = tied_nodes(ties)
    unpinned = finalize(egraph, free, tree, "ilp", started)
    found = [unpinned]
    if start is not None and ties_hold(start.choice, ties):  # half the work left to improving it, half to the pins
        half = deadline.meter.until(deadline.meter.spent + deadline.left() / 2)
        full = [start.choice.get(c, n) for c, n in enumerate(free)]
        found += [start, finalize(egraph, improve(egraph, full, tree, half, frozen), tree, "ilp", started)]
    chosen = set(unpinned.choice.values())
    pinned = _pinned(egraph, [pair for pair in ties if pair[1] in chosen], frozen)
    with suppress(NoFiniteChoiceError):  # a pinned pair no selection can reach
        pinned_tree = solvable_tree(pinned)
        found.append(finalize(pinned, greedy_dag_choice(pinned, pinned_tree, deadline, frozen), pinned_tree, "ilp",
                              started))
    kept = [s for s in found if math.isfinite(s.dag_cost) and ties_hold(s.choice, ties)]
    return min(kept, key=lambda s: s.dag_cost, default=None)


def _pinned(egraph: EGraph, kept: Ties, frozen: frozenset[int]) -> EGraph:
    """`egraph` with every tied node unselectable but the nodes of the pairs `kept`."""
    keep = tied_nodes(kept)
    return egraph.with_costs([math.inf if n in frozen and n not in keep else c for n, c in enumerate(egraph.node_cost)])
