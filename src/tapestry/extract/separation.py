"""Path-cut separation for the ILP's LP relaxation (`relax.py`): which pairs of blocks to separate, their path
graphs, and the max flows that find violated cuts.

If block B' needs block B (`Reduced.needs`), every selection has a path of chosen nodes from an entry node of B up
to the source of B', so for every cut C of the graph of such paths u_B' <= sum of x_n over C. Separation is a max
flow per pair under the LP solution, all pairs of a batch in one graph (`FlowBatch`); a flow below u_B' gives the
violated cut.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from tapestry.extract.egraph import EGraph
from tapestry.extract.work import Deadline

TOLERANCE = 1e-6  # a cut counts as violated by more than this
# Path cuts for a block and the blocks it needs within this many steps (needs are transitively reduced): on a
# 12-layer stack on 16 devices, 1 step took 10 rounds to the optimum, 2 steps 5, 3 steps 4, 4 and 5 steps 4.
NEED_HOPS = 3
# Path-graph nodes built per second, and the share of the LP pass's time that building them may take, so that
# rounds (re-solves and separations) have the rest: pairs are taken a whole step at a time while they fit, and
# the pass is skipped if the 1-step pairs do not (without cuts the LP is CP-SAT's own root LP). Built at
# 225,000 a second on Rover's fir_8_tap_5 (1.4 million: its LP with 1-step cuts then proves the optimum in 18 s)
# and 350,000 on 12 layers on 16 devices (350,000 at 3 steps); Tensat's bert and nasrnn need 18 and 10 million
# at 1 step (their regions span the graph) and building them had taken the LP pass's whole share.
PATH_NODES_PER_SECOND = 250_000
PATH_SHARE = 0.3
# Entries of the flow graphs (`FlowBatch`: edges and their capacities' terms) a separation round runs its max flows
# over per second of work (`work.Meter`), beside the path graphs' edges made (PATH_NODES_PER_SECOND): a round on
# Mixtral's 2-layer training step on 8 devices made 23,941 edges and ran 51,500 entries in 0.245 CPU s at load ~19
# (`python benchmarks/extract_work.py --cluster Mixtral training 8`).
FLOW_ENTRIES_PER_SECOND = 500_000
FLOW_UNIT = 2**20  # max flow runs on integer capacities: LP values in these units
BATCH = 512  # path graphs per max flow: their demands (at most 1 each) sum to at most 2^29 units
UNBOUNDED = 2**30  # an unbounded edge's capacity in those units: more than a batch's whole flow


class OutOfTime(Exception):
    """Building the LP or its flow graphs passed the safety net (`work.Deadline.safety`)."""


class LpColumns(Protocol):
    """What separation reads of the LP (`relax.Lp`): its columns, per node, class and source."""

    x: Mapping[int, int]  # node -> its choice column
    used: Mapping[int, int]  # class -> its use column
    cost: np.ndarray  # per column

    def variable(self, node: int, source: bool) -> int: ...


@dataclass(frozen=True)
class PathCut:
    """u of block `reader` <= sum of x over `nodes` + sum of the source variables of `sources` (entry nodes of
    the reader: s_n in a cyclic block, x_n in a class alone)."""

    reader: int
    nodes: tuple[int, ...]
    sources: tuple[int, ...]


@dataclass(frozen=True)
class PathFlow:
    """One pair (B', B): the path graph, vertices 0 (s), 1 (t), then classes and nodes with several children.
    Each edge has the LP variables its capacity sums (x over its nodes, s over its sources), or none: then it
    is unbounded."""

    reader: int
    vertices: int
    edges: tuple[tuple[int, int], ...]
    terms: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per edge: (nodes, sources) of its capacity
    variables: tuple[tuple[int, ...], ...]  # per edge


@dataclass(frozen=True)
class FlowBatch:
    """Path graphs side by side in one graph, for one max flow: vertex 0 feeds each pair's s through an edge of
    capacity its demand u_B', each pair's t feeds vertex 1. The pairs share no other vertex, so the max flow is
    each pair's, capped at its demand, and a pair short of its demand has its min cut in the residual graph."""

    flows: tuple[PathFlow, ...]
    graph: sparse.csr_matrix  # capacities filled in per separation
    row: np.ndarray  # per CSR entry: its row of `capacity`, -1 for the edges from 0 and into 1
    owner: np.ndarray  # per CSR entry: its flow, -1 for the edges from 0 and into 1
    bounded: np.ndarray  # per CSR entry: an edge with a capacity (not from 0, into 1, or unbounded)
    feeds: np.ndarray  # per flow: the CSR entry of its edge from vertex 0
    starts: np.ndarray  # per flow: its s vertex
    first: np.ndarray  # per flow: the row of `capacity` of its first edge
    capacity: sparse.csr_matrix  # edge x LP variable

    @staticmethod
    def of(flows: Sequence[PathFlow], columns: int) -> FlowBatch:
        tails, heads, rows, owners, variables, starts, first = [], [], [], [], [], [], []
        vertices = 2
        for i, flow in enumerate(flows):
            starts.append(vertices)
            first.append(len(variables))
            tails += [0, vertices + 1]
            heads += [vertices, 1]
            rows += [-1, -1]
            owners += [-1, -1]
            for (u, v), used in zip(flow.edges, flow.variables):
                tails.append(vertices + u)
                heads.append(vertices + v)
                rows.append(len(variables))
                owners.append(i)
                variables.append(used)
            vertices += flow.vertices
        order = np.lexsort((heads, tails))  # CSR order
        tail, head = np.array(tails)[order], np.array(heads, dtype=np.int32)[order]
        graph = sparse.csr_matrix((np.zeros(len(order), dtype=np.int32), head,
                                   np.searchsorted(tail, np.arange(vertices + 1)).astype(np.int32)),
                                  shape=(vertices, vertices))
        row = np.array(rows)[order]
        lengths = np.array([len(v) for v in variables], dtype=np.int64)
        capacity = sparse.csr_matrix(
            (np.ones(lengths.sum()), np.fromiter((c for v in variables for c in v), np.int64, lengths.sum()),
             np.concatenate(([0], np.cumsum(lengths)))), shape=(len(variables), columns))
        bounded = row >= 0
        bounded[bounded] = lengths[row[bounded]] > 0
        return FlowBatch(tuple(flows), graph, row, np.array(owners)[order], bounded,
                      np.flatnonzero(tail == 0), np.array(starts), np.array(first), capacity)

    def separate(self, values: np.ndarray, demands: np.ndarray) -> list[PathCut]:
        """The violated min cuts under the LP `values`, where pair i's reader has u = `demands[i]`: those whose
        capacity is below it by more than `TOLERANCE`. SciPy's max flow takes integers: capacities go in
        units of 1 / `FLOW_UNIT` rounded down, and a cut's capacity is then summed exactly, so rounding can
        miss a cut, never add one that is not violated."""
        return [cut for _, cut in self.violated(values, demands)]

    def violated(self, values: np.ndarray, demands: np.ndarray) -> list[tuple[int, PathCut]]:
        """`separate`'s cuts, each with its flow's place in the batch."""
        exact = self.capacity @ values
        data = np.full(self.graph.nnz, UNBOUNDED, dtype=np.int64)
        data[self.bounded] = np.minimum(np.floor(exact[self.row[self.bounded]] * FLOW_UNIT), UNBOUNDED)
        data[self.feeds] = np.floor(np.clip(demands, 0.0, 1.0) * FLOW_UNIT)
        self.graph.data = data.astype(np.int32)
        residual = self.graph - maximum_flow(self.graph, 0, 1, method="dinic").flow
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        side = np.zeros(self.graph.shape[0], dtype=bool)
        side[breadth_first_order(residual, 0, return_predecessors=False)] = True
        short = side[self.starts] & (demands > TOLERANCE)  # s still reachable: the pair is below its demand
        tails = np.repeat(np.arange(self.graph.shape[0]), np.diff(self.graph.indptr))
        crossing = np.flatnonzero((self.row >= 0) & side[tails] & ~side[self.graph.indices])
        crossing = crossing[short[self.owner[crossing]]]
        found = []
        for i in np.unique(self.owner[crossing]):
            rows = self.row[crossing[self.owner[crossing] == i]]
            if demands[i] - exact[rows].sum() > TOLERANCE:
                terms = [self.flows[i].terms[e] for e in rows - self.first[i]]
                found.append((int(i), PathCut(self.flows[i].reader, tuple(n for nodes, _ in terms for n in nodes),
                                              tuple(n for _, sources in terms for n in sources))))
        return found


@dataclass(frozen=True)
class NeedPairs:
    """The pairs (B', B) to separate, each with its region (the blocks a path from B up to B' can cross), and
    each block's classes."""

    pairs: tuple[tuple[int, int, frozenset[int]], ...]  # (reader, target, region)
    members: Mapping[int, list[int]]


def need_pairs(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
               needs: Mapping[int, Sequence[int]], deadline: Deadline, steps: int = NEED_HOPS) -> NeedPairs | None:
    """Every pair (B', B) with B one step of needs from B', then two, .. `steps`, while their path graphs
    can be built in `PATH_SHARE` of the work left to `deadline` (PATH_NODES_PER_SECOND; whole steps only); None
    when the one-step pairs alone cannot. The region of (B', B): the blocks below B' and above B."""
    child_sets = egraph.child_sets
    members: dict[int, list[int]] = {}
    for c in candidates:
        members.setdefault(block[c], []).append(c)
    below: dict[int, set[int]] = {b: set() for b in members}
    above: dict[int, set[int]] = {b: set() for b in members}
    for c, nodes in candidates.items():
        for d in {block[d] for n in nodes for d in child_sets[n]} - {block[c]}:
            below[block[c]].add(d)
            above[d].add(block[c])
    position = {b: i for i, b in enumerate(_children_first(below))}
    size = {b: sum(len(candidates[c]) for c in classes) for b, classes in members.items()}
    room = PATH_NODES_PER_SECOND * PATH_SHARE * deadline.left()
    readers = [b for b in needs if b in members]
    reached = {b: {b} for b in readers}  # per reader, itself and the blocks of the steps so far
    frontier = {b: {b} for b in readers}
    pairs: list[tuple[int, int, frozenset[int]]] = []
    for hops in range(steps):
        step = []
        for reader in readers:
            frontier[reader] = {d for b in frontier[reader] for d in needs.get(b, ())} - reached[reader]
            reached[reader] |= frontier[reader]
            for target in frontier[reader]:  # the region lies between them, children first
                if deadline.safety():
                    raise OutOfTime
                low = position[target]
                down = _closure(reader, below, lambda b, low=low: position[b] >= low)
                region = frozenset(_closure(target, above, down.__contains__))
                room -= sum(size[b] for b in region)
                if room < 0:
                    return NeedPairs(tuple(pairs), members) if hops else None
                step.append((reader, target, region))
        pairs += step
    return NeedPairs(tuple(pairs), members)


class PathGraphs:
    """The pairs' path graphs in batches, each pair's made the first time its reader is used (u_B' above
    `TOLERANCE`): no other pair can fall short of its demand. On Mixtral on 2x2 a third of the 786 one-step
    pairs were; making them all took 0.37 CPU s, most of its path-cut round. Cuts come in the order of the pairs,
    as if every pair had been made at once."""

    def __init__(self, egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                 pairs: NeedPairs, lp: LpColumns) -> None:
        self.egraph, self.candidates, self.block, self.pairs, self.lp = egraph, candidates, block, pairs, lp
        self.readers = np.array([lp.used[reader] for reader, _, _ in pairs.pairs], dtype=np.int64)
        self.made = np.zeros(len(pairs.pairs), dtype=bool)
        self.prepared: dict[int, list[tuple[int, tuple[int, ...], bool, int, int]]] = {}
        self.inner: dict[int, _Inner] = {}
        self.batches: list[tuple[FlowBatch, np.ndarray]] = []  # each with its flows' pairs

    def separate(self, values: np.ndarray, deadline: Deadline) -> list[PathCut]:
        """The violated cuts under the LP `values` (`FlowBatch.separate`), in the order of their pairs; the flow
        graphs made (PATH_NODES_PER_SECOND) and the max flows run (FLOW_ENTRIES_PER_SECOND) charged to `deadline`'s
        meter."""
        new = np.flatnonzero(~self.made & (values[self.readers] > TOLERANCE))
        if new.size:
            self.made[new] = True
            flows = path_flows(self.egraph, self.candidates, self.block, self.pairs, self.lp, deadline, new.tolist(),
                           self.prepared, self.inner)
            self.batches += zip(_batches(flows, len(self.lp.cost), deadline),
                                (new[i:i + BATCH] for i in range(0, new.size, BATCH)))
        found = []
        for batch, pairs in self.batches:
            if deadline.safety():
                raise OutOfTime
            found += [(pairs[i], cut) for i, cut in batch.violated(values, values[self.readers[pairs]])]
            deadline.meter.charge((batch.graph.nnz + batch.capacity.nnz) / FLOW_ENTRIES_PER_SECOND)
        return [cut for _, cut in sorted(found, key=lambda pair_cut: pair_cut[0])]


def path_flows(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int], pairs: NeedPairs,
           lp: LpColumns, deadline: Deadline, chosen: Sequence[int] | None = None,
           prepared: dict[int, list[tuple[int, tuple[int, ...], bool, int, int]]] | None = None,
           inner: dict[int, _Inner] | None = None) -> list[PathFlow]:
    """The path graph of every pair (or of the `chosen` ones, by index): classes of its region, each node an edge
    from its child classes in the region into its class (through a vertex of its own when it has several), an
    entry of B an edge from s, the source of B' an edge into t. `prepared` and `inner` keep, per class and per
    block, what the regions made so far share (`_flow`)."""
    child_sets = egraph.child_sets
    prepared = {} if prepared is None else prepared
    inner = {} if inner is None else inner
    chosen = range(len(pairs.pairs)) if chosen is None else chosen
    for b in set().union(*(pairs.pairs[i][2] for i in chosen)) - inner.keys():
        for c in pairs.members[b]:
            prepared[c] = [(n, child_sets[n], all(block[d] != block[c] for d in child_sets[n]), lp.x[n],
                            lp.variable(n, True)) for n in candidates[c]]
        inner[b] = _Inner.of(prepared, pairs.members[b])
    flows = []
    for i in chosen:
        if deadline.safety():
            raise OutOfTime
        flows.append(_flow(prepared, pairs.members, inner, *pairs.pairs[i]))
        deadline.meter.charge(len(flows[-1].edges) / PATH_NODES_PER_SECOND)
    return flows


@dataclass(frozen=True)
class _Inner:
    """A block's edges that need no region, made once for every pair: most of every region is reshards between
    one value's layouts. `edges` are (child's place, class's place among the block's classes, nodes, x variables)
    of its nodes with one child, in the block; `entries` per class (its place, nodes, x variables) of its entry
    nodes, the edge from s where the block is a pair's target; `rest` per class (class, nodes) what is left to
    place pair by pair elsewhere: its entry nodes, whose edges depend on the region, or all its nodes where one of
    several children is in the block (that node's edge can meet an inner one's): those classes are also `whole`."""

    edges: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]
    entries: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    rest: tuple[tuple[int, tuple[tuple[int, tuple[int, ...], bool, int, int], ...]], ...]
    whole: tuple[tuple[int, tuple[tuple[int, tuple[int, ...], bool, int, int], ...]], ...]

    @staticmethod
    def of(prepared: Mapping[int, list[tuple[int, tuple[int, ...], bool, int, int]]],
           classes: Sequence[int]) -> _Inner:
        place = {c: i for i, c in enumerate(classes)}
        grouped: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        entries, rest, whole = [], [], []
        for c in classes:
            nodes = prepared[c]
            if any(len(children) > 1 and any(d in place for d in children) for _, children, *_ in nodes):
                whole.append((c, tuple(nodes)))
                rest.append(whole[-1])
                continue
            for n, children, entry, x, _ in nodes:
                if not entry:  # one child, in the block
                    listed = grouped.setdefault((place[children[0]], place[c]), ([], []))
                    listed[0].append(n)
                    listed[1].append(x)
            entered = tuple(node for node in nodes if node[2])
            entries.append((place[c], tuple(n for n, *_ in entered), tuple(node[3] for node in entered)))
            rest.append((c, entered))
        return _Inner(tuple((j, i, tuple(ns), tuple(xs)) for (j, i), (ns, xs) in grouped.items()),
                      tuple(e for e in entries if e[1]), tuple(rest), tuple(whole))


def _batches(flows: Sequence[PathFlow], columns: int, deadline: Deadline) -> list[FlowBatch]:
    """`flows` in batches of `BATCH` (their demands sum to at most that, so flows stay within int32)."""
    batches = []
    for i in range(0, len(flows), BATCH):
        if deadline.safety():
            raise OutOfTime
        batches.append(FlowBatch.of(flows[i:i + BATCH], columns))
    return batches


def _children_first(below: Mapping[int, set[int]]) -> list[int]:
    """The blocks, each after every block below it (`below` is acyclic: blocks are components)."""
    order: list[int] = []
    done: set[int] = set()
    for start in below:
        stack = [(start, False)]
        while stack:
            b, expanded = stack.pop()
            if expanded:
                order.append(b)
            elif b not in done:
                done.add(b)
                stack.append((b, True))
                stack.extend((d, False) for d in below[b] if d not in done)
    return order


def _closure(start: int, edges: Mapping[int, set[int]], keep: Callable[[int], bool]) -> set[int]:
    """What `start` reaches through `edges`, visiting only blocks that `keep` accepts."""
    seen, stack = {start}, [start]
    while stack:
        for d in edges[stack.pop()]:
            if d not in seen and keep(d):
                seen.add(d)
                stack.append(d)
    return seen


def _flow(prepared: Mapping[int, list[tuple[int, tuple[int, ...], bool, int, int]]],
          members: Mapping[int, list[int]], inner: Mapping[int, _Inner], reader: int, target: int,
          region: frozenset[int]) -> PathFlow:
    """The path graph of (`reader`, `target`) over the blocks of `region` (`path_flows`). `prepared` has per class
    its candidates: (node, child classes, entry of its block, x variable, source variable); `inner` per block
    the edges that need no region. Edges are in no particular order (a batch sorts them)."""
    vertex: dict[int, int] = {}
    keys: list[tuple[int, int]] = []  # the edges from `inner`, each made by one class's nodes alone
    terms: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    variables: list[tuple[int, ...]] = []
    for r in region:
        base = 2 + len(vertex)
        for c in members[r]:
            vertex[c] = 2 + len(vertex)
        if r != reader:
            for j, i, nodes, xs in inner[r].edges:
                keys.append((base + j, base + i))
                terms.append((nodes, ()))
                variables.append(xs)
        if r == target:
            for i, nodes, xs in inner[r].entries:
                keys.append((0, base + i))
                terms.append((nodes, ()))
                variables.append(xs)
    count = 2 + len(vertex)
    edges: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}  # -> nodes, sources, variables
    unbounded: list[tuple[int, int]] = []
    for r in region:
        if r == reader:
            per_node: Iterable[tuple[int, Sequence[tuple[int, tuple[int, ...], bool, int, int]]]] = (
                (c, prepared[c]) for c in members[r])
        else:
            per_node = inner[r].whole if r == target else inner[r].rest
        for c, nodes in per_node:
            for n, children, entry, x, s in nodes:
                if r == reader:
                    if not entry:
                        continue  # only the source of B' ends a path
                    head, source, variable = 1, True, s
                else:
                    head, source, variable = vertex[c], False, x
                if r == target and entry:
                    tail = 0
                else:
                    inside = {vertex[d] for d in children if d in vertex}
                    if not inside:
                        continue
                    if len(inside) == 1:
                        (tail,) = inside
                    else:
                        tail, count = count, count + 1
                        unbounded += [(u, tail) for u in inside]
                if (found := edges.get((tail, head))) is None:
                    found = edges[tail, head] = ([], [], [])
                found[source].append(n)
                found[2].append(variable)
    return PathFlow(reader, count, (*keys, *edges, *unbounded),
                 (*terms, *((tuple(xs), tuple(ss)) for xs, ss, _ in edges.values()), *(((), ()),) * len(unbounded)),
                 (*variables, *(tuple(v) for _, _, v in edges.values()), *((),) * len(unbounded)))
