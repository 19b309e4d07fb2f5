"""The lightest-derivation searches (`tree_choice`, greedy-dag's `greedy_choice`) queue a node only where it is the
least of its class so far, and greedy-dag's local search (`improve`) prices a move without (class, step) pairs:
exact cuts, so on random e-graphs (reshard-like chains, ties, cycles, infinite and subsumed nodes) each returns
what the code before them did (tests/greedy_reference.py), choice for choice, and charges the same tries."""
from __future__ import annotations

import math
import random

import pytest

import greedy_reference as reference
from tapestry.extract import EGraph, Node
from tapestry.extract.greedy_dag import greedy_choice, improve
from tapestry.extract.selection import finalize
from tapestry.extract.tree import tree_choice
from tapestry.extract.work import Meter


def random_egraph(seed: int) -> EGraph:
    """Classes with ~`fan` nodes each: most read one class (a reshard from another layout), some two or three; costs
    drawn from few values (ties), some infinite or subsumed; children anywhere (cycles)."""
    draw = random.Random(seed)
    num_classes = draw.randint(3, 40)
    classes = [f"c{i}" for i in range(num_classes)]
    nodes = []
    for i, c in enumerate(classes):
        for j in range(draw.randint(1, 6)):
            arity = draw.choices((0, 1, 2, 3), (2, 12, 3, 1))[0]
            below = classes[:i] or classes  # mostly acyclic, sometimes not
            pool = classes if draw.random() < 0.1 else below
            cost = draw.choice((0.0, 1.0, 2.0, 3.0, 0.5, math.inf, draw.uniform(0, 4)))
            nodes.append(Node(f"{c}.{j}", "f", c, cost, tuple(draw.choice(pool) for _ in range(arity)),
                              subsumed=draw.random() < 0.05))
    roots = draw.sample(classes[num_classes // 2:], k=min(2, num_classes - num_classes // 2))
    return EGraph.from_nodes(nodes, roots)


@pytest.mark.parametrize("seed", range(300))
def test_the_cut_searches_choose_as_before(seed: int) -> None:
    egraph = random_egraph(seed)
    tree = tree_choice(egraph)
    assert tree == reference.tree_choice(egraph)
    greedy = greedy_choice(egraph)
    assert greedy == reference.greedy_choice(egraph)
    if any(not tree.extractable(r) for r in egraph.roots):
        return
    start = finalize(egraph, greedy, tree, "greedy-dag", 0.0).choice
    full = [start.get(c, g if g >= 0 else t) for c, (g, t) in enumerate(zip(greedy, tree.node))]
    frozen = frozenset(list(start.values())[:1]) if seed % 3 == 0 else frozenset()
    meters = Meter(10.0), Meter(10.0)
    cut = improve(egraph, full, tree, meters[0].until(10.0), frozen)
    before = reference.improve(egraph, full, tree, meters[1].until(10.0), frozen)
    assert cut == before
    assert meters[0].spent == meters[1].spent


def test_selectable_nodes_are_each_graphs_own() -> None:
    """Made once per graph, as the tree choice is: a repriced copy (`with_costs`, which shares the structure)
    makes its own, so a pin that makes a node infinite is not chosen from a stale one."""
    egraph = EGraph.from_nodes([Node("a.0", "f", "a", 1.0), Node("a.1", "f", "a", 0.5)], ["a"])
    assert egraph.selectable_nodes == (True, True)
    pinned = egraph.with_costs([1.0, math.inf])
    assert pinned.selectable_nodes == (True, False)
    assert tree_choice(pinned).node == (0,) and tree_choice(egraph).node == (1,)
