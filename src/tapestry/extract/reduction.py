"""The extraction problem reduced before it is modelled (`ilp.py`, `relax.py`, `contract.py` share it): nodes that
are never needed dropped, the cyclic components found, and the blocks every use of a block needs.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tapestry.extract.egraph import EGraph
from tapestry.extract.structure import strongly_connected_components
from tapestry.extract.tree import TreeChoice

SUBSETS_LOOKED_UP = 6  # most child classes whose subsets `reduce` looks up one by one (64) rather than scan
_NO_CHILDREN: frozenset[int] = frozenset()


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
    child_sets, cost = egraph.child_sets, egraph.node_cost
    replacement: dict[int, int] = {}
    per_class: dict[int, list[int]] = {}
    for c, nodes in enumerate(egraph.class_nodes):
        if not tree.extractable(c):
            continue
        viable = sorted(
            (
                n
                for n in nodes
                if egraph.selectable(n)
                and c not in child_sets[n]
                and all(tree.extractable(d) for d in child_sets[n])
            ),
            key=lambda n: (cost[n], len(child_sets[n])),
        )
        kept: list[int] = []
        first: dict[frozenset[int], int] = {}  # child classes -> position in `kept` of the first node with them
        for n in viable:
            if n in tied:
                continue
            children = frozenset(child_sets[n])
            at = _first_subset(children, first)
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
    position = {reduced.block(comp[0]): i for i, comp in enumerate(components)}
    need = [0] * len(components)
    for i, comp in enumerate(components):
        common = -1  # all bits: the intersection over no entry yet
        for c in comp:
            for n in reduced.candidates[c]:
                below = {position[reduced.block(d)] for d in child_sets[n]}
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


def _first_subset(children: frozenset[int], first: Mapping[frozenset[int], int]) -> int | None:
    """The earliest position in `first` of a child-class set inside `children`: looked up subset by subset when
    there are few (a 2x2x2 mesh's classes hold hundreds of reshards, each with one child), else scanned."""
    if len(children) > SUBSETS_LOOKED_UP:
        return min((at for made, at in first.items() if made <= children), default=None)
    if len(children) <= 1:  # a reshard's one child (most nodes): no subsets to enumerate
        return min((first[subset] for subset in (_NO_CHILDREN, children) if subset in first), default=None)
    found = [first[subset] for k in range(len(children) + 1)
             for subset in map(frozenset, itertools.combinations(children, k)) if subset in first]
    return min(found, default=None)
