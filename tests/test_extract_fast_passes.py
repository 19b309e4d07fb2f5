"""The ILP's passes made fast (numpy over the node arrays, lookups hoisted out of per-node loops) compute what
their plain Python forms did: on random e-graphs (cycles, self-loops, duplicate children, subsumed and
infinite-cost nodes, equal costs, tied nodes, nodes with more child classes than `reduction.SUBSETS_LOOKED_UP`) and
on Tapestry-shaped ones (`extract_helpers.layered`), `reduce` keeps, replaces and orders exactly the nodes, classes,
components and needs that the slow forms below (the code before the change, kept here as the specification) do."""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from extract_helpers import layered
from tapestry.extract import EGraph, Node
from tapestry.extract.reduction import SUBSETS_LOOKED_UP, Reduced, reduce
from tapestry.extract.structure import strongly_connected_components
from tapestry.extract.tree import TreeChoice, tree_choice


@st.composite
def egraphs(draw: st.DrawFn) -> EGraph:
    names = [f"c{i}" for i in range(draw(st.integers(1, SUBSETS_LOOKED_UP + 3)))]
    cost = st.one_of(st.sampled_from([0.0, 1.0, 2.0, math.inf]), st.floats(0, 10, allow_nan=False))
    nodes = [Node(f"{c}.{i}", "f", c, draw(cost), tuple(draw(st.lists(st.sampled_from(names), max_size=len(names)))),
                  draw(st.booleans()) and draw(st.booleans()))
             for c in names for i in range(draw(st.integers(1, 6)))]
    roots = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    return EGraph.from_nodes(nodes, roots)


def slow_reduce(egraph: EGraph, tree: TreeChoice, tied: frozenset[int] = frozenset()) -> Reduced:
    """`reduction.reduce` before numpy: a sort per class and a subset lookup per node."""
    child_sets, cost = egraph.child_sets, egraph.node_cost
    replacement: dict[int, int] = {}
    per_class: dict[int, list[int]] = {}
    for c, nodes in enumerate(egraph.class_nodes):
        if not tree.extractable(c):
            continue
        viable = sorted((n for n in nodes if egraph.selectable(n) and c not in child_sets[n]
                         and all(tree.extractable(d) for d in child_sets[n])),
                        key=lambda n: (cost[n], len(child_sets[n])))
        kept: list[int] = []
        first: dict[frozenset[int], int] = {}
        for n in viable:
            if n in tied:
                continue
            children = frozenset(child_sets[n])
            at = _slow_first_subset(children, first)
            if at is None:
                first[children] = len(kept)
                kept.append(n)
            else:
                replacement[n] = kept[at]
        per_class[c] = kept + [n for n in viable if n in tied]
    candidates: dict[int, tuple[int, ...]] = {}
    stack = list(egraph.roots)
    while stack:
        c = stack.pop()
        if c in candidates:
            continue
        candidates[c] = tuple(per_class[c])
        stack.extend(d for n in candidates[c] for d in child_sets[n] if d not in candidates)
    successors = {c: {d for n in nodes for d in child_sets[n]} for c, nodes in candidates.items()}
    component: dict[int, int] = {}
    components = strongly_connected_components(candidates, successors.__getitem__)
    for index, comp in enumerate(components):
        if len(comp) > 1:
            component.update((c, index) for c in comp)
    reduced = Reduced(candidates, component, replacement)
    return Reduced(candidates, component, replacement, _slow_needed_blocks(egraph, reduced, components))


def _slow_needed_blocks(egraph: EGraph, reduced: Reduced,
                        components: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    child_sets = egraph.child_sets
    position = {reduced.block(comp[0]): i for i, comp in enumerate(components)}
    need = [0] * len(components)
    for i, comp in enumerate(components):
        common = -1
        for c in comp:
            for n in reduced.candidates[c]:
                below = {position[reduced.block(d)] for d in child_sets[n]}
                if i in below:
                    continue
                reach = 0
                for j in below:
                    reach |= (1 << j) | need[j]
                common &= reach
        need[i] = max(common, 0)
    blocks = [reduced.block(comp[0]) for comp in components]
    result: dict[int, tuple[int, ...]] = {}
    for i, b in enumerate(blocks):
        kept, rest = [], need[i]
        while rest:
            j = rest.bit_length() - 1
            kept.append(blocks[j])
            rest &= ~((1 << j) | need[j])
        if kept:
            result[b] = tuple(kept)
    return result


def _slow_first_subset(children: frozenset[int], first: Mapping[frozenset[int], int]) -> int | None:
    if len(children) > SUBSETS_LOOKED_UP:
        return min((at for made, at in first.items() if made <= children), default=None)
    found = [first[subset] for k in range(len(children) + 1)
             for subset in map(frozenset, itertools.combinations(children, k)) if subset in first]
    return min(found, default=None)


def same(fast: Reduced, slow: Reduced) -> None:
    """Equal, orders included: the LP's columns and rows follow them."""
    assert list(fast.candidates.items()) == list(slow.candidates.items())
    assert list(fast.component.items()) == list(slow.component.items())
    assert fast.replacement == slow.replacement
    assert list(fast.needs.items()) == list(slow.needs.items())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(egraph=egraphs(), data=st.data())
def test_reduce_equals_its_slow_form_on_random_egraphs(egraph: EGraph, data: st.DataObject) -> None:
    tree = tree_choice(egraph)
    tied = frozenset(data.draw(st.sets(st.integers(0, egraph.num_nodes - 1), max_size=3)))
    assume(all(tree.extractable(r) for r in egraph.roots))  # else no extractor reduces it (`solvable_tree`)
    same(reduce(egraph, tree, tied), slow_reduce(egraph, tree, tied))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(3, 2), (4, 3), (6, 4)]), seed=st.integers(0, 10**6))
def test_reduce_equals_its_slow_form_on_layered_egraphs(shape: tuple[int, int], seed: int) -> None:
    egraph = layered(*shape, seed=seed)
    tree = tree_choice(egraph)
    same(reduce(egraph, tree), slow_reduce(egraph, tree))
