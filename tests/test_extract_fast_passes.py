"""The ILP's passes made fast (numpy over the node arrays, lookups hoisted out of per-node loops) compute what
their plain Python forms did: on random e-graphs (cycles, self-loops, duplicate children, subsumed and
infinite-cost nodes, equal costs, tied nodes, nodes with more child classes than `reduction.SUBSETS_LOOKED_UP`) and
on Tapestry-shaped ones (`extract_helpers.layered`), `reduce` keeps, replaces and orders exactly the nodes, classes,
components and needs that the slow forms below (the code before the change, kept here as the specification) do;
so do the contracted problem and its value blocks, and `EGraph.from_nodes` (by way of `from_columns`, which the
decoder calls) builds the same graph or raises the same error."""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from extract_helpers import build, layered
from tapestry.components import connected_groups
from tapestry.extract import EGraph, Node
from tapestry.extract.egraph import EGraphError, _check_cost
from tapestry.extract.contract import MOVE, contracted, value_blocks
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


def slow_contracted(egraph: EGraph, candidates: Mapping[int, Sequence[int]],
                    block: Mapping[int, int]) -> tuple[EGraph, dict[int, tuple[int, ...]]]:
    """`contract.contracted` before numpy: a set of inner nodes per class."""
    child_sets, cost = egraph.child_sets, egraph.node_cost
    kept: dict[int, tuple[int, ...]] = {}
    added: list[tuple[int, float]] = []
    for c, nodes in candidates.items():
        inner = {n for n in nodes if any(block[d] == block[c] for d in child_sets[n])}
        if not inner:
            kept[c] = tuple(nodes)
            continue
        kept[c] = (*(n for n in nodes if n not in inner), egraph.num_nodes + len(added))
        added.append((c, min(cost[n] for n in inner)))
    members = [list(nodes) for nodes in egraph.class_nodes]
    for i, (c, _) in enumerate(added):
        members[c].append(egraph.num_nodes + i)
    graph = replace(
        egraph,
        node_ids=egraph.node_ids + tuple(f"{egraph.class_ids[c]}.contracted" for c, _ in added),
        node_ops=egraph.node_ops + ("contracted",) * len(added),
        node_class=egraph.node_class + tuple(c for c, _ in added),
        node_cost=egraph.node_cost + tuple(k for _, k in added),
        node_children=egraph.node_children + tuple((c,) for c, _ in added),
        node_subsumed=egraph.node_subsumed + (False,) * len(added),
        class_nodes=tuple(map(tuple, members)),
    )
    return graph, kept


def slow_value_blocks(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                      needs: Mapping[int, Sequence[int]]) -> tuple[dict[int, int], dict[int, tuple[int, ...]]]:
    """`contract.value_blocks` before scipy: a union-find in Python."""
    first: dict[int, int] = {}
    links = [(c, first.setdefault(block[c], c)) for c in candidates]
    links += [(c, d) for c, nodes in candidates.items() for n in nodes if egraph.node_ops[n] == MOVE
              for d in egraph.child_sets[n]]
    grown = dict(block)
    for group in connected_groups(candidates, links):
        named = max(block[c] for c in group)
        grown.update((c, named) for c in group)
    new = {block[c]: grown[c] for c in candidates}
    before, after = Counter(block[c] for c in candidates), Counter(grown.values())
    return grown, {new[b]: tuple(dict.fromkeys(new[d] for d in needed if d in new)) for b, needed in needs.items()
                   if b in new and before[b] == after[new[b]]}


def slow_from_nodes(nodes: Sequence[Node], roots: Sequence[str]) -> EGraph:
    """`EGraph.from_nodes` before `from_columns`: a loop over the nodes, each cost checked alone."""
    class_index: dict[str, int] = {}
    for node in nodes:
        class_index.setdefault(node.eclass, len(class_index))
    members: list[list[int]] = [[] for _ in class_index]
    children: list[tuple[int, ...]] = []
    for i, node in enumerate(nodes):
        members[class_index[node.eclass]].append(i)
        try:
            children.append(tuple(class_index[c] for c in node.children))
        except KeyError as err:
            raise EGraphError(f"node {node.id!r} has child class {err.args[0]!r}, which has no nodes") from None
    missing_roots = [r for r in roots if r not in class_index]
    if missing_roots:
        raise EGraphError(f"root class {missing_roots[0]!r} has no nodes")
    node_ids = tuple(n.id for n in nodes)
    if len(set(node_ids)) != len(node_ids):
        raise EGraphError("node ids are not unique")
    return EGraph(
        class_ids=tuple(class_index), node_ids=node_ids, node_ops=tuple(n.op for n in nodes),
        node_class=tuple(class_index[n.eclass] for n in nodes),
        node_cost=tuple(_check_cost(n.id, n.cost) for n in nodes), node_children=tuple(children),
        node_subsumed=tuple(bool(n.subsumed) for n in nodes), roots=tuple(dict.fromkeys(class_index[r] for r in roots)),
        class_nodes=tuple(tuple(m) for m in members), class_data={})


def same(fast: Reduced, slow: Reduced) -> None:
    """Equal, orders included: the LP's columns and rows follow them."""
    assert list(fast.candidates.items()) == list(slow.candidates.items())
    assert list(fast.component.items()) == list(slow.component.items())
    assert fast.replacement == slow.replacement
    assert list(fast.needs.items()) == list(slow.needs.items())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(egraph=egraphs(), data=st.data())
def test_the_contracted_problem_and_value_blocks_equal_their_slow_forms(egraph: EGraph, data: st.DataObject) -> None:
    """Random nodes are moves (`contract.MOVE`), so value blocks join classes across cycles too."""
    moves = data.draw(st.sets(st.integers(0, egraph.num_nodes - 1)))
    egraph = replace(egraph, node_ops=tuple(MOVE if n in moves else op for n, op in enumerate(egraph.node_ops)))
    tree = tree_choice(egraph)
    assume(all(tree.extractable(r) for r in egraph.roots))
    reduced = reduce(egraph, tree)
    block = {c: reduced.block(c) for c in reduced.candidates}
    (graph, kept), (slow_graph, slow_kept) = contracted(egraph, reduced.candidates, block), slow_contracted(
        egraph, reduced.candidates, block)
    assert graph == slow_graph and list(kept.items()) == list(slow_kept.items())
    assert graph.child_sets == replace(slow_graph).child_sets  # made from the children, as a fresh graph makes it
    (grown, needs), (slow_grown, slow_needs) = (value_blocks(egraph, reduced.candidates, block, reduced.needs),
                                                slow_value_blocks(egraph, reduced.candidates, block, reduced.needs))
    assert list(grown.items()) == list(slow_grown.items()) and list(needs.items()) == list(slow_needs.items())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(3, 2), (4, 3), (6, 4)]), seed=st.integers(0, 10**6))
def test_the_contracted_problem_and_value_blocks_equal_their_slow_forms_on_layered_egraphs(
        shape: tuple[int, int], seed: int) -> None:
    egraph = layered(*shape, seed=seed)
    value = [class_id.split(".")[0] for class_id in egraph.class_ids]
    egraph = replace(egraph, node_ops=tuple(
        MOVE if [value[d] for d in egraph.child_sets[n]] == [value[egraph.node_class[n]]] else op
        for n, op in enumerate(egraph.node_ops)))
    reduced = reduce(egraph, tree_choice(egraph))
    block = {c: reduced.block(c) for c in reduced.candidates}
    (graph, kept), (slow_graph, slow_kept) = contracted(egraph, reduced.candidates, block), slow_contracted(
        egraph, reduced.candidates, block)
    assert graph == slow_graph and list(kept.items()) == list(slow_kept.items())
    assert list(value_blocks(egraph, reduced.candidates, block, reduced.needs)[0].items()) == list(
        slow_value_blocks(egraph, reduced.candidates, block, reduced.needs)[0].items())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_from_nodes_builds_what_its_slow_form_built_or_raises_its_error(data: st.DataObject) -> None:
    """Children and roots may name classes without nodes, ids repeat, costs are negative or NaN."""
    names = [f"c{i}" for i in range(data.draw(st.integers(1, 5)))]
    cost = st.one_of(st.sampled_from([0.0, -0.0, 1.0, math.inf, -1.0, math.nan, 2]), st.floats(0, 10, allow_nan=False))
    classes = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=8))
    nodes = [Node("same" if data.draw(st.booleans()) and data.draw(st.booleans()) else f"{c}.{i}", "f", c,
                  data.draw(cost), tuple(data.draw(st.lists(st.sampled_from([*names, "nowhere"]), max_size=3))),
                  data.draw(st.booleans()))
             for c in classes for i in range(2)]
    roots = data.draw(st.lists(st.sampled_from([*names, "nowhere"]), min_size=1, max_size=3))
    try:
        slow = slow_from_nodes(nodes, roots)
    except EGraphError as err:
        with pytest.raises(EGraphError) as raised:
            EGraph.from_nodes(nodes, roots)
        assert str(raised.value) == str(err)
        return
    fast = EGraph.from_nodes(nodes, roots)
    assert fast == slow and [str(c) for c in fast.node_cost] == [str(c) for c in slow.node_cost]  # -0.0 kept
    assert fast.child_sets == tuple(tuple(dict.fromkeys(children)) for children in slow.node_children)
    assert EGraph.from_columns([n.id for n in nodes], [n.op for n in nodes], [n.eclass for n in nodes],
                               [n.cost for n in nodes], [n.children for n in nodes], roots,
                               [n.subsumed for n in nodes]) == slow


def test_past_subsets_looked_up_a_node_is_dominated_by_an_earlier_one_with_the_same_or_fewer_children() -> None:
    """Sets of more than SUBSETS_LOOKED_UP child classes are scanned, not looked up: equal sets and subsets."""
    wide = [f"l{i}" for i in range(SUBSETS_LOOKED_UP + 2)]
    spec = {**{leaf: [(0.0, [])] for leaf in wide},
            "r": [(2.0, wide), (1.0, wide[:-1]), (1.0, wide[:-1]), (1.5, [*wide[1:], wide[0]]), (0.5, wide[1:])]}
    egraph = build(spec, ["r"])
    tree = tree_choice(egraph)
    reduced = reduce(egraph, tree)
    same(reduced, slow_reduce(egraph, tree))
    r = egraph.class_ids.index("r")
    assert reduced.candidates[r] == tuple(egraph.class_nodes[r][i] for i in (4, 1))
    node = egraph.class_nodes[r]  # sorted 4, 1, 2, 3, 0: each dominated by the first subset of its children
    assert reduced.replacement == {node[2]: node[1], node[3]: node[4], node[0]: node[4]}
