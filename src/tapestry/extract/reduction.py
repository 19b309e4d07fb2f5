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
    replacement: dict[int, int] = {}
    per_class: dict[int, list[int]] = {}
    for c, viable in viable_nodes(egraph, tree).items():
        kept: list[int] = []
        first = _Firsts()
        for n in viable:
            if n in tied:
                continue
            at = first.subset_of(child_sets[n])
            if at is None:
                first.add(child_sets[n], len(kept))
                kept.append(n)
            else:
                replacement[n] = kept[at]
        per_class[c] = kept + [n for n in viable if n in tied]

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


def viable_nodes(egraph: EGraph, tree: TreeChoice) -> dict[int, list[int]]:
    """Per class with a finite choice (in class order), its nodes `reduce` may keep: selectable, reading neither
    its own class nor one without a finite choice; cheapest first, then fewest child classes, then in the class's
    order. Sorted with numpy over the graph's flat arrays: a Python sort per class took a third of the ILP's
    passes on a 2x2 decoder's ~80,000 nodes."""
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
    viable: dict[int, list[int]] = {c: [] for c in np.flatnonzero(chosen >= 0).tolist()}
    for c, n in zip(member_class[order].tolist(), members[order].tolist()):
        viable[c].append(n)
    return viable


class _Firsts:
    """Of the nodes kept so far in a class, per set of child classes, the position of the first with it: looked
    up subset by subset (a 2x2x2 mesh's classes hold hundreds of reshards, each with one child), or scanned past
    SUBSETS_LOOKED_UP child classes. Sets of none and of one class kept apart, the most of them."""

    __slots__ = ("empty", "single", "multi")

    def __init__(self) -> None:
        self.empty: int | None = None
        self.single: dict[int, int] = {}
        self.multi: dict[frozenset[int], int] = {}

    def subset_of(self, children: Sequence[int]) -> int | None:
        """The earliest position of a set within `children` (distinct classes), or None."""
        if len(children) == 1:  # most nodes: a reshard
            at = self.single.get(children[0])
            return self.empty if at is None or (self.empty is not None and self.empty < at) else at
        found = [] if self.empty is None else [self.empty]
        found += [self.single[d] for d in children if d in self.single]
        if len(children) > 1 and self.multi:
            if len(children) > SUBSETS_LOOKED_UP:
                whole = frozenset(children)
                found += [at for made, at in self.multi.items() if made <= whole]
            else:
                found += [self.multi[subset] for k in range(2, len(children) + 1)
                          for subset in map(frozenset, itertools.combinations(children, k)) if subset in self.multi]
        return min(found, default=None)

    def add(self, children: Sequence[int], at: int) -> None:
        """`children` (distinct classes, no set within them added yet) first held at position `at`."""
        if not children:
            self.empty = at
        elif len(children) == 1:
            self.single[children[0]] = at
        else:
            self.multi[frozenset(children)] = at
