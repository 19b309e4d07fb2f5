"""The extraction problem reduced before it is modelled (`ilp.py`, `relax.py`, `contract.py` share it): nodes that
are never needed dropped, the cyclic components found, and the blocks every use of a block needs.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tapestry.extract.egraph import EGraph
from tapestry.extract.structure import strongly_connected_components
from tapestry.extract.tree import TreeChoice

SUBSETS_LOOKED_UP = 6  # most child classes whose subsets `reduce` looks up one by one (64) rather than scan


@dataclass(frozen=True)
class Reduced:
    """The problem after preprocessing: candidate nodes per reachable class, the cyclic components, and the
    blocks each block needs (`needed_blocks`)."""

    candidates: Mapping[int, tuple[int, ...]]
    component: Mapping[int, int]  # class -> id of its non-trivial strongly connected component
    replacement: Mapping[int, int]  # dropped (dominated) node -> node that dominates it
    needs: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # block -> blocks it needs (reduced)

    def block(self, c: int) -> int:
        """A class's block: its cyclic component (ids >= 0), or the class alone (-1 - c)."""
        return self.component.get(c, -1 - c)


def reduce(egraph: EGraph, tree: TreeChoice, tied: frozenset[int] = frozenset()) -> Reduced:
    """Drop nodes that are never chosen in some optimal selection, then keep what the roots reach, and find
    the cyclic components and each block's needs (`needed_blocks`).

    Removed: subsumed or infinite-cost nodes, self-loops, nodes with a child that has no
    finite choice, and dominated nodes (another node of the class has a subset of its
    child classes and no higher cost; swapping it in never adds a cycle or cost). A
    `tied` node is kept and dominates nothing: choosing it chooses its partner too.
    """
    child_sets = egraph.child_sets
    classes, nodes = viable_nodes(egraph, tree)
    held = np.fromiter((n in tied for n in nodes.tolist()), dtype=bool, count=len(nodes)) if tied else \
        np.zeros(len(nodes), dtype=bool)
    dominator = _dominators(egraph, classes, nodes, held)
    dominated = dominator < len(nodes)
    replacement = dict(zip(nodes[dominated].tolist(), nodes[dominator[dominated]].tolist()))
    per_class: dict[int, list[int]] = {c: [] for c in np.flatnonzero(np.array(tree.node) >= 0).tolist()}
    for chosen in (~dominated & ~held, held):  # each class's kept nodes, then its tied ones
        for c, n in zip(classes[chosen].tolist(), nodes[chosen].tolist()):
            per_class[c].append(n)

    candidates: dict[int, tuple[int, ...]] = {}
    successors: dict[int, set[int]] = {}
    stack = list(egraph.roots)
    while stack:
        c = stack.pop()
        if c in candidates:
            continue
        candidates[c] = nodes = tuple(per_class[c])
        below = [d for n in nodes for d in child_sets[n]]
        successors[c] = set(below)
        stack.extend(d for d in below if d not in candidates)

    component: dict[int, int] = {}
    components = strongly_connected_components(candidates, successors.__getitem__)  # children first
    for index, comp in enumerate(components):
        if len(comp) > 1:
            component.update((c, index) for c in comp)
    reduced = Reduced(candidates, component, replacement)
    return replace(reduced, needs=needed_blocks(egraph, reduced, components))


def needed_blocks(egraph: EGraph, reduced: Reduced, components: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Per block (`_block`), the blocks every acyclic selection that uses it also uses, transitively reduced.

    A used block has a chosen entry node (one with no child in the block; the source constraints), whose
    child blocks are used too. So block B needs block D when every entry node of B has a child in D or in a
    block that needs D. The constraint u_B <= u_D cuts no selection, yet without it the LP splits a value
    between alternative derivations (a linear, or a matmul then an add) that meet again below, and pays for
    what they share by halves: 67% of the optimum on a transformer block, 99% with it. `components` are the
    strongly connected components children first (Tarjan's order), so a block's needs are known before it.
    Needs are bit sets over positions in that order; dropping what a kept need already needs leaves few.
    """
    child_sets = egraph.child_sets
    position = {c: i for i, comp in enumerate(components) for c in comp}  # a class's block's
    need = [0] * len(components)
    for i, comp in enumerate(components):
        common = -1  # all bits: the intersection over no entry yet
        for c in comp:
            for n in reduced.candidates[c]:
                children = child_sets[n]
                if len(children) == 1:  # most nodes: a reshard
                    j = position[children[0]]
                    if j != i:
                        common &= (1 << j) | need[j]
                    continue
                below = {position[d] for d in children}
                if i in below:
                    continue  # not an entry: it reads its own block
                reach = 0
                for j in below:
                    reach |= (1 << j) | need[j]
                common &= reach
        need[i] = max(common, 0)  # no entry at all: the block is never used, needs nothing
    blocks = [reduced.block(comp[0]) for comp in components]
    result: dict[int, tuple[int, ...]] = {}
    for i, b in enumerate(blocks):
        kept, rest = [], need[i]
        while rest:
            j = rest.bit_length() - 1  # the latest need left; what it needs comes earlier
            kept.append(blocks[j])
            rest &= ~((1 << j) | need[j])
        if kept:
            result[b] = tuple(kept)
    return result


def viable_nodes(egraph: EGraph, tree: TreeChoice) -> tuple[np.ndarray, np.ndarray]:
    """(class, node) of the nodes `reduce` may keep, class by class (in class order): selectable, reading neither
    its own class nor one without a finite choice; in a class cheapest first, then fewest child classes, then in
    the class's order. Sorted with numpy over the graph's flat arrays: a Python sort per class took a third of the
    ILP's passes on a 2x2 decoder's ~80,000 nodes."""
    chosen = np.array(tree.node, dtype=np.int64)
    node_class = np.array(egraph.node_class, dtype=np.int64)
    counts, flat = egraph.child_arrays
    reader = np.repeat(np.arange(egraph.num_nodes), counts)
    barred = np.zeros(egraph.num_nodes, dtype=bool)
    barred[reader[(chosen[flat] < 0) | (flat == node_class[reader])]] = True
    members = np.fromiter(itertools.chain.from_iterable(egraph.class_nodes), dtype=np.int64,
                          count=sum(map(len, egraph.class_nodes)))
    member_class = np.repeat(np.arange(egraph.num_classes), [len(nodes) for nodes in egraph.class_nodes])
    keep = np.array(egraph.selectable_nodes, dtype=bool)[members] & ~barred[members] & (chosen[member_class] >= 0)
    position = np.flatnonzero(keep)  # in class order, each class's nodes in its own order
    members, member_class = members[position], member_class[position]
    order = np.lexsort((position, counts[members], np.array(egraph.node_cost)[members], member_class))
    return member_class[order], members[order]


def _dominators(egraph: EGraph, classes: np.ndarray, nodes: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per position of `viable_nodes`' arrays, the first position before it in its class whose node's child
    classes are a subset of its own (len(nodes) where none is, or it is `held`: tied, it neither dominates nor is
    dominated). That node is itself undominated (what dominated it would come first), so it is the one `reduce`
    keeps. Nodes with no child class and with one (a reshard: most nodes) with numpy; those with more one by one,
    their subsets looked up (scanned past SUBSETS_LOOKED_UP child classes)."""
    size, width = len(nodes), egraph.num_classes
    position = np.arange(size)
    counts, flat = egraph.child_arrays
    count = np.where(held, -1, counts[nodes])
    first_empty = np.full(width, size)
    np.minimum.at(first_empty, classes[count == 0], position[count == 0])
    before = first_empty[classes]
    dominator = np.where((before < position) & ~held, before, size)
    one = np.flatnonzero(count == 1)
    pairs = classes[one] * width + flat[(np.cumsum(counts) - counts)[nodes[one]]]  # (class, child)
    keys, first_index, inverse = np.unique(pairs, return_index=True, return_inverse=True)
    first = one[first_index]  # the first position of each (class, child)
    dominator[one] = np.minimum(dominator[one], np.where(first[inverse] < one, first[inverse], size))
    first_single = dict(zip(keys.tolist(), first.tolist()))
    child_sets, first_empty_of = egraph.child_sets, first_empty.tolist()
    first_set: dict[int, dict[frozenset[int], int]] = {}  # per class, the first position of each set of children
    many = np.flatnonzero(count >= 2)
    for p, c, n in zip(many.tolist(), classes[many].tolist(), nodes[many].tolist()):
        children = child_sets[n]
        found = [first_empty_of[c]] if first_empty_of[c] < p else []
        found += [at for d in children if (at := first_single.get(c * width + d, size)) < p]
        sets = first_set.setdefault(c, {})
        if len(children) > SUBSETS_LOOKED_UP:
            whole = frozenset(children)
            found += [at for made, at in sets.items() if made <= whole]
        else:
            found += [sets[subset] for k in range(2, len(children) + 1)
                      for subset in map(frozenset, itertools.combinations(children, k)) if subset in sets]
        sets.setdefault(frozenset(children), p)
        dominator[p] = min(found, default=size)
    return dominator
