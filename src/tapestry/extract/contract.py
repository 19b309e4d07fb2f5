"""A cheap lower bound for large e-graphs: the LP of a contracted problem (docs/extraction.md, "Contracted bound").

On Tapestry's e-graphs most candidates are reshards between the layouts of one value: 39,490 of the 41,850 that
the 2-layer LLaMA on `Mesh(2, 2)` leaves after `reduction.reduce`, and the ILP's first LP (relax.py) takes 5-11 s on
them. A node that reads a class of its own block (`Reduced.block`: one value's layouts) is an *inner* node; it is
never its block's entry. Contracted, each class's inner nodes become one node that costs the cheapest of them and
reads only its own class (so it needs no other layout active, and is still no entry). Every selection of the
e-graph maps to a selection of the contracted problem that costs no more and keeps every constraint of the LP:
each chosen inner node becomes its class's contracted node; entries, hence sources, readers and needs, are the
same nodes reading the same classes. So the contracted LP's optimum is at most the e-graph's LP optimum (with
the same blocks), and a lower bound on every selection's cost. Path cuts are left out: they follow chains of
reshards, which the contraction cuts. It keeps a quarter of LLaMA's candidates and 42% of GPT-NeoX's (whose
reshards from one strongly connected component of a value's layouts into another are entries, kept); its LP took
0.45 and 1.23 CPU s where the full one took 6.43 and 16.79 (`benchmarks/contract.py`, docs/extraction.md).

Its LP's source constraints group classes by value (`value_blocks`), not by cycle: a layout that nothing moves
out of (a footprint: what one reader reads of a fused value, `egraph.decode`) is a block of its own among the
cycles, and the LP then fed a reader's twelve alternatives from twelve such footprints at 1/12 each, all from one
value used at 1/12: Phi-3 on 2x2 paid 1/12 of its fused projections, a bound 5.9% below the plan (0.30% by value).
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components

from tapestry.extract.egraph import EGraph
from tapestry.extract.relax import LpBound, lp_bound
from tapestry.extract.work import Deadline


def contracted(egraph: EGraph, candidates: Mapping[int, Sequence[int]],
               block: Mapping[int, int]) -> tuple[EGraph, dict[int, tuple[int, ...]]]:
    """The contracted problem: the e-graph with one node appended per class that has inner nodes (its cheapest
    inner cost, its own class as its child), and the candidates per class with those nodes in the inner ones'
    place."""
    cost = egraph.node_cost
    inner = iter(_inner(egraph, candidates, block))
    kept: dict[int, tuple[int, ...]] = {}
    added: list[tuple[int, float]] = []  # (class, cost) of each contracted node, numbered after egraph's
    for c, nodes in candidates.items():
        flags = [next(inner) for _ in nodes]
        if not any(flags):
            kept[c] = tuple(nodes)
            continue
        kept[c] = (*(n for n, flag in zip(nodes, flags) if not flag), egraph.num_nodes + len(added))
        added.append((c, min(cost[n] for n, flag in zip(nodes, flags) if flag)))
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
    graph._structure["child_sets"] = egraph.child_sets + tuple((c,) for c, _ in added)  # as made from the children
    return graph, kept


def _inner(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int]) -> list[bool]:
    """Whether each candidate (class by class, in `candidates`' order) reads a class of its own class's block:
    numpy over the graph's child arrays (~80,000 candidates on a 2x2 decoder)."""
    nodes = np.fromiter(itertools.chain.from_iterable(candidates.values()), dtype=np.int64,
                        count=sum(map(len, candidates.values())))
    block_of = np.full(egraph.num_classes, np.iinfo(np.int64).min, dtype=np.int64)  # no block: equals none
    block_of[list(block)] = list(block.values())
    own = np.repeat(block_of[list(candidates)], [len(members) for members in candidates.values()])
    counts, flat = egraph.child_arrays
    reads = counts[nodes]
    reader = np.repeat(np.arange(len(nodes)), reads)
    at = np.repeat(np.cumsum(counts)[nodes] - reads - np.cumsum(reads) + reads, reads) + np.arange(reads.sum())
    inner = np.zeros(len(nodes), dtype=bool)
    inner[reader[block_of[flat[at]] == own[reader]]] = True
    return inner.tolist()


MOVE = "Reshard"  # the op of a node that moves a value between layouts (egraph.decode): one value's two classes


def value_blocks(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                 needs: Mapping[int, Sequence[int]]) -> tuple[dict[int, int], dict[int, tuple[int, ...]]]:
    """Blocks grown to whole values, and the needs that still hold between them: (block per class, needs).

    Classes joined by a MOVE node are layouts of one value, and the blocks they touch become one (the largest id
    of them names it). The source constraints hold for any grouping of classes into blocks (the classes of a used
    block that an acyclic selection activates have one whose chosen node reads none of them: an entry), and the
    contracted nodes, which read their own class, stay no entries. A need of block B for D becomes B's for D's
    value block if B is a value block on its own; a grown block's needs are left out."""
    grown = dict(block)
    grown.update(zip(candidates, _grown(egraph, candidates, block)))
    new = {block[c]: grown[c] for c in candidates}
    before, after = Counter(block[c] for c in candidates), Counter(grown.values())
    return grown, {new[b]: tuple(dict.fromkeys(new[d] for d in needed if d in new)) for b, needed in needs.items()
                   if b in new and before[b] == after[new[b]]}


def _grown(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int]) -> list[int]:
    """Per class of `candidates` (in its order), the largest block id among the classes joined to it by a block or
    a MOVE node: connected components with scipy (a union-find in Python over ~80,000 links took as long as the
    contracted problem's LP set-up)."""
    index = np.full(egraph.num_classes, -1, dtype=np.int64)
    index[list(candidates)] = np.arange(len(candidates))
    blocks = np.fromiter((block[c] for c in candidates), dtype=np.int64, count=len(candidates))
    _, first = np.unique(blocks, return_inverse=True)  # a block stays whole: each class linked to its block's
    moves = [(c, n) for c, nodes in candidates.items() for n in nodes if egraph.node_ops[n] == MOVE]
    counts, flat = egraph.child_arrays
    movers = np.array([n for _, n in moves], dtype=np.int64)
    reads = counts[movers]
    at = np.repeat(np.cumsum(counts)[movers] - reads - np.cumsum(reads) + reads, reads) + np.arange(reads.sum())
    rows = np.concatenate([np.arange(len(candidates)), np.repeat(index[[c for c, _ in moves]], reads)])
    columns = np.concatenate([len(candidates) + first, index[flat[at]]])
    size = len(candidates) + first.max(initial=-1) + 1
    links = sparse.coo_matrix((np.ones(len(rows)), (rows, columns)), shape=(size, size))
    _, group = connected_components(links, directed=False)
    named = np.full(group.max(initial=-1) + 1, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(named, group[:len(candidates)], blocks)
    return named[group[:len(candidates)]].tolist()


def contracted_bound(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                     needs: Mapping[int, Sequence[int]], deadline: Deadline, solver: str = "",
                     fallback: float = 0.0) -> LpBound:
    """A lower bound on every selection's cost: the contracted problem's LP (`relax.lp_bound`, with its `solver` and
    `fallback`; bound 0 when not solved by `deadline`, in simplex iterations), its values those of `egraph`'s nodes
    (the contracted nodes left out).
    `candidates`, `block` and `needs` are the ILP's (`ilp.Reduced`); the LP's blocks are `value_blocks`."""
    graph, kept = contracted(egraph, candidates, block)
    solved = lp_bound(graph, kept, *value_blocks(egraph, candidates, block, needs), deadline, solver, fallback)
    if solved.values is None:
        return solved
    return LpBound(solved.bound, {n: x for n, x in solved.values.items() if n < egraph.num_nodes})
