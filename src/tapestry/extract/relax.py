"""The ILP's LP relaxation, tightened with path cuts (HiGHS) before CP-SAT searches.

The LP is the CP-SAT model of `ilp.py` less its order variables: choice, activity, source, reader and need
constraints. Its bound is weak where a value has alternative derivations that meet again below (a linear, or a
matmul then an add; a layer norm replicated or sharded): the LP chooses each at a fraction and pays what they
share by that fraction. Path cuts repair it. If block B' needs block B (`Reduced.needs`), the source of B' reads,
through chosen nodes, a class of B: a selection has a path of chosen nodes from an entry node of B up to the
source of B'. So for every cut C of the graph of such paths, u_B' <= sum of x_n over the nodes in C (a node's
capacity is x_n, a source's s_n). Separation is a max flow per pair of blocks (B', B) under the LP solution; a
flow below u_B' gives the violated cut. On a transformer block on 8 devices they take the LP bound from 99.0% of
the optimum to the optimum; the LP solution rounded (each class's largest x) is then often a selection that
meets the bound, so optimal outright.

Every cut holds for every acyclic selection, so adding them to the CP-SAT model cuts no selection.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

# SciPy's own HiGHS: the highspy wheel's library and OR-tools' clash in one process (undefined symbols)
from scipy.optimize._highspy import _core as highs

from tapestry.extract.egraph import EGraph

TOLERANCE = 1e-6  # a cut counts as violated by more than this
SLACK = 1e-9  # share shaved off the Lagrangian bound (`_Lp.solve`) for rounding in its sums
PROVEN = 1e-6  # a selection within this share of the bound counts as optimal
# A round of cuts that closes less than this share of the gap between the bound and the incumbent ends the
# loop if it is the first round or follows another such round: on a 2x4 mesh the path cuts move the bound by
# 0-5% of the gap a round (its gap is of another kind) and a re-solve of a 4-layer stack's LP takes 0.5-1 s;
# on mesh 8 the first round closes 15-50% of it, and a round that closes none is followed by one that closes
# much (one layer: 1.15%, 0.97%, 0.97%, 0.58%, 0 above greedy-dag).
STALL = 0.05


class _OutOfTime(Exception):
    """Building the LP or its flow graphs passed the deadline."""


@dataclass(frozen=True)
class PathCut:
    """u of block `reader` <= sum of x over `nodes` + sum of the source variables of `sources` (entry nodes of
    the reader: s_n in a cyclic block, x_n in a class alone)."""

    reader: int
    nodes: tuple[int, ...]
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Relaxation:
    """What the tightened LP gave: its cuts and its bound."""

    cuts: tuple[PathCut, ...]
    bound: float  # lower bound on the cost of every acyclic selection (0 when the LP did not solve)
    rounds: int


@dataclass(frozen=True)
class _Flow:
    """One pair (B', B): the path graph, vertices 0 (s), 1 (t), then classes and nodes with several children.
    An edge is unbounded, or has a capacity: the sum of x over its nodes and of s over its sources."""

    reader: int
    vertices: int
    unbounded: tuple[tuple[int, int], ...]
    capacities: Mapping[tuple[int, int], tuple[list[int], list[int]]]  # edge -> (nodes, sources)


def relax(
    egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
    needs: Mapping[int, Sequence[int]], deadline: float, ties: Sequence[tuple[int, int]] = (),
    offer: Callable[[list[int]], float] = lambda _: math.inf,
) -> Relaxation:
    """Solve the LP of `candidates` (class -> nodes), adding violated path cuts until none is left, the bound
    proves the incumbent optimal (within `PROVEN`), a round closes too little of the gap to it (`STALL`), or
    `deadline` passes. Each LP solution, rounded to a choice per class (its candidate of largest x, -1 for
    classes without one), is passed to `offer`, which returns the incumbent's cost (inf for none yet).
    `block` maps each class to its block (cyclic component id, or -1 - class), `needs` is `Reduced.needs`."""
    cuts: list[PathCut] = []
    rounds, stalled, productive = 0, False, False
    bound, values = 0.0, None  # the last LP solved; out of time, it and the cuts found so far still hold
    try:
        lp = _Lp(egraph, candidates, block, needs, ties, deadline)
        bound, values = lp.solve(deadline)
        flows: list[_Flow] | None = None  # built once the LP without cuts has proven nothing
        previous = None  # the bound before the last round of cuts
        while values is not None:
            incumbent = offer(_rounded(egraph, candidates, lp, values))
            if math.isfinite(incumbent) and incumbent <= _shaved(bound) + PROVEN * incumbent:
                break
            if previous is not None:
                small = math.isfinite(incumbent) and bound - previous < STALL * (incumbent - previous)
                if small and (stalled or not productive):
                    break
                stalled, productive = small, productive or not small
            if flows is None:
                flows = _flows(egraph, candidates, block, needs, deadline)
            found = []
            for flow in flows:
                if time.perf_counter() > deadline:
                    raise _OutOfTime
                cut = _separate(flow, values, lp)
                if cut is not None:
                    found.append(cut)
            if not found:
                break
            rounds += 1
            cuts += found
            lp.add(found)
            solved = lp.solve(deadline)
            if solved[1] is None:
                break
            previous, (bound, values) = bound, solved
    except _OutOfTime:
        pass
    return Relaxation(tuple(cuts), 0.0 if values is None else _shaved(bound), rounds)


def _shaved(bound: float) -> float:
    """The Lagrangian bound lowered by `SLACK`: a bound despite float rounding."""
    return max(0.0, bound - SLACK * abs(bound))


def _rounded(egraph: EGraph, candidates: Mapping[int, Sequence[int]], lp: _Lp, values: Sequence[float]) -> list[int]:
    """Per class, its candidate of largest x in `values` (-1 for a class without candidates)."""
    choice = [-1] * egraph.num_classes
    for c, nodes in candidates.items():
        choice[c] = max(nodes, key=lambda n: values[lp.x[n]])
    return choice


class _Lp:
    """The LP in HiGHS, rows added as cuts are found (a warm re-solve)."""

    def __init__(self, egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                 needs: Mapping[int, Sequence[int]], ties: Sequence[tuple[int, int]], deadline: float) -> None:
        child_sets = egraph.child_sets
        if time.perf_counter() > deadline:
            raise _OutOfTime
        self.x = {n: i for i, n in enumerate(n for c in candidates for n in candidates[c])}
        count = len(self.x)
        self.active = {c: count + i for i, c in enumerate(candidates)}
        count += len(candidates)
        blocks: dict[int, list[int]] = {}
        for c in candidates:
            blocks.setdefault(block[c], []).append(c)
        self.used: dict[int, int] = {}
        self.source: dict[int, int] = {}  # entry node of a cyclic block -> its s variable
        rows: list[tuple[dict[int, float], float, float]] = []
        for c, nodes in candidates.items():
            if time.perf_counter() > deadline:
                raise _OutOfTime
            rows.append(({**{self.x[n]: 1.0 for n in nodes}, self.active[c]: -1.0}, 0.0, 0.0))
            for n in nodes:
                for d in child_sets[n]:
                    rows.append(({self.x[n]: 1.0, self.active[d]: -1.0}, -math.inf, 0.0))
        if time.perf_counter() > deadline:
            raise _OutOfTime
        readers: dict[tuple[int, int], list[int]] = {}
        for b, classes in blocks.items():
            if time.perf_counter() > deadline:
                raise _OutOfTime
            if len(classes) == 1:
                self.used[b] = self.active[classes[0]]
                entries = {n: self.x[n] for n in candidates[classes[0]]}
            else:
                self.used[b] = count
                count += 1
                rows.append(({self.used[b]: 1.0, **{self.active[c]: -1.0 for c in classes}}, -math.inf, 0.0))
                for c in classes:
                    rows.append(({self.active[c]: 1.0, self.used[b]: -1.0}, -math.inf, 0.0))
                entries = {}
                for c in classes:
                    for n in candidates[c]:
                        if all(block[d] != b for d in child_sets[n]):
                            entries[n] = self.source[n] = count
                            count += 1
                            rows.append(({count - 1: 1.0, self.x[n]: -1.0}, -math.inf, 0.0))
                rows.append(({**{v: 1.0 for v in entries.values()}, self.used[b]: -1.0}, 0.0, 0.0))
            for n, var in entries.items():
                for read in {block[d] for d in child_sets[n]}:
                    readers.setdefault((b, read), []).append(var)
        for (_, read), sources in readers.items():
            if len(sources) > 1:
                rows.append(({**{v: 1.0 for v in sources}, self.used[read]: -1.0}, -math.inf, 0.0))
        for b, needed in needs.items():
            for d in needed:
                if b in self.used and d in self.used:
                    rows.append(({self.used[b]: 1.0, self.used[d]: -1.0}, -math.inf, 0.0))
        for a, b in ties:
            if a in self.x and b in self.x:
                rows.append(({self.x[a]: 1.0, self.x[b]: -1.0}, 0.0, 0.0))
        if time.perf_counter() > deadline:
            raise _OutOfTime
        self.lower = np.zeros(count)
        for root in egraph.roots:
            self.lower[self.active[root]] = 1.0
        self.cost = np.zeros(count)
        for n, i in self.x.items():
            self.cost[i] = egraph.node_cost[n]
        positive = self.cost[self.cost > 0]
        self.unit = float(positive.mean()) if positive.size else 1.0  # costs in HiGHS are O(1): see `solve`
        self.highs = highs._Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.addVars(count, self.lower, np.ones(count))
        self.highs.changeColsCost(count, np.arange(count, dtype=np.int32), self.cost / self.unit)
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.entries: tuple[list[int], list[int], list[float]] = ([], [], [])  # row, column, coefficient
        self._add_rows(rows)

    def _add_rows(self, rows: Sequence[tuple[dict[int, float], float, float]]) -> None:
        starts, indices, values = [], [], []
        for coef, low, high in rows:
            starts.append(len(indices))
            indices.extend(coef)
            values.extend(coef.values())
            self.entries[0].extend([len(self.row_lower)] * len(coef))
            self.row_lower.append(low)
            self.row_upper.append(high)
        self.entries[1].extend(indices)
        self.entries[2].extend(values)
        self.highs.addRows(len(rows), np.array([r[1] for r in rows]), np.array([r[2] for r in rows]),
                           len(indices), np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32),
                           np.array(values))

    def variable(self, node: int, source: bool) -> int:
        return self.source.get(node, self.x[node]) if source else self.x[node]

    def add(self, cuts: Sequence[PathCut]) -> None:
        rows = []
        for cut in cuts:
            coef: dict[int, float] = {self.used[cut.reader]: 1.0}
            for n in cut.nodes:
                coef[self.x[n]] = coef.get(self.x[n], 0.0) - 1.0
            for n in cut.sources:
                var = self.variable(n, True)
                coef[var] = coef.get(var, 0.0) - 1.0
            rows.append((coef, -math.inf, 0.0))
        self._add_rows(rows)

    def solve(self, deadline: float) -> tuple[float, list[float] | None]:
        """(bound, solution), or (0, None) if HiGHS did not solve it to optimality by `deadline`.

        The bound is not HiGHS's objective: "optimal" allows reduced costs down to -1e-7, so the primal
        objective of a transformer block (costs ~1e-6 s) came out 2.6e-4 of the optimum above it, in 2 runs of
        3. Costs go to HiGHS in units of their mean, and the bound is Lagrangian: for the row duals y (each sign
        kept only where its side of the row is finite), min over the box of (c - A'y)x + the rows' bounds by y,
        a lower bound for every y (Neumaier and Shcherbina, Math. Prog. 2004), equal to the optimum at the
        optimal y."""
        left = deadline - time.perf_counter()
        if left <= 0:
            return 0.0, None
        self.highs.setOptionValue("time_limit", self.highs.getRunTime() + left)  # HiGHS counts its whole life
        self.highs.run()
        if self.highs.getModelStatus() != highs.HighsModelStatus.kOptimal:
            return 0.0, None
        solution = self.highs.getSolution()
        return self.dual_bound(np.array(solution.row_dual) * self.unit), list(solution.col_value)

    def dual_bound(self, dual: np.ndarray) -> float:
        """The Lagrangian bound of the row duals `dual` (in cost units): below the LP optimum for any `dual`."""
        rows, columns, coefficients = self.entries
        matrix = sparse.csr_matrix((coefficients, (rows, columns)), shape=(len(self.row_lower), len(self.cost)))
        low, high = np.array(self.row_lower), np.array(self.row_upper)
        dual = np.where(((dual > 0) & np.isfinite(low)) | ((dual < 0) & np.isfinite(high)), dual, 0.0)
        reduced = self.cost - matrix.T @ dual  # the columns' bounds are [lower, 1]
        return (float(dual[dual > 0] @ low[dual > 0]) + float(dual[dual < 0] @ high[dual < 0])
                + float(reduced[reduced > 0] @ self.lower[reduced > 0]) + float(reduced[reduced < 0].sum()))


def _flows(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
           needs: Mapping[int, Sequence[int]], deadline: float) -> list[_Flow]:
    """The path graph of every pair (B', B) with B in needs(B'): classes of the blocks between them (below B',
    above B), each node an edge from its child classes in that region into its class (through a vertex of its
    own when it has several), an entry of B an edge from s, the source of B' an edge into t."""
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
    flows = []
    for reader, needed in needs.items():
        if reader not in members:
            continue
        if time.perf_counter() > deadline:
            raise _OutOfTime
        for target in needed:  # the region lies between them in a children-first order
            low, high = position[target], position[reader]
            region = (_closure(reader, below, lambda b, low=low: position[b] >= low)
                      & _closure(target, above, lambda b, high=high: position[b] <= high))
            flows.append(_flow(egraph, candidates, block, members, reader, target, region))
    return flows


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


def _flow(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
          members: Mapping[int, list[int]], reader: int, target: int, region: set[int]) -> _Flow:
    """The path graph of (`reader`, `target`) over the blocks of `region` (`_flows`)."""
    child_sets = egraph.child_sets
    vertex: dict[int, int] = {}
    for r in region:
        for c in members[r]:
            vertex[c] = 2 + len(vertex)
    count = 2 + len(vertex)
    edges: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    unbounded: set[tuple[int, int]] = set()

    def capacity(u: int, v: int, node: int, source: bool) -> None:
        xs, ss = edges.setdefault((u, v), ([], []))
        (ss if source else xs).append(node)

    for r in region:
        for c in members[r]:
            for n in candidates[c]:
                inside = [vertex[d] for d in child_sets[n] if d in vertex]
                entry = all(block[d] != r for d in child_sets[n])
                if r == reader:
                    if not entry:
                        continue  # only the source of B' ends a path
                    head, source = 1, True
                else:
                    head, source = vertex[c], False
                if r == target and entry:
                    capacity(0, head, n, source)
                elif len(set(inside)) == 1:
                    capacity(inside[0], head, n, source)
                elif inside:
                    count += 1
                    for u in set(inside):
                        unbounded.add((u, count - 1))
                    capacity(count - 1, head, n, source)
    return _Flow(reader, count, tuple(unbounded), edges)


def _separate(flow: _Flow, values: Sequence[float], lp: _Lp) -> PathCut | None:
    """The min cut of `flow` under the LP `values` if its capacity is below u_B' (Edmonds-Karp: the graphs are
    a few hundred edges)."""
    demand = values[lp.used[flow.reader]]
    if demand <= TOLERANCE:
        return None
    adjacency: list[list[int]] = [[] for _ in range(flow.vertices)]
    head: list[int] = []
    residual: list[float] = []
    edges = [(u, v, math.inf) for u, v in flow.unbounded] + [
        (u, v, sum(values[lp.x[n]] for n in xs) + sum(values[lp.variable(n, True)] for n in ss))
        for (u, v), (xs, ss) in flow.capacities.items()]
    for u, v, cap in edges:  # edge e and its reverse e ^ 1
        for a, b, c in ((u, v, cap), (v, u, 0.0)):
            adjacency[a].append(len(head))
            head.append(b)
            residual.append(c)
    total = 0.0
    while total < demand - TOLERANCE:
        parent = [-1] * flow.vertices
        parent[0] = -2
        queue = deque([0])
        while queue and parent[1] == -1:
            u = queue.popleft()
            for e in adjacency[u]:
                if residual[e] > 1e-12 and parent[head[e]] == -1:
                    parent[head[e]] = e
                    queue.append(head[e])
        if parent[1] == -1:
            break
        path, v = [], 1
        while v != 0:
            e = parent[v]
            path.append(e)
            v = head[e ^ 1]
        push = min(residual[e] for e in path)
        for e in path:
            residual[e] -= push
            residual[e ^ 1] += push
        total += push
    if total >= demand - TOLERANCE:
        return None
    side = {0}
    queue = deque([0])
    while queue:
        u = queue.popleft()
        for e in adjacency[u]:
            if residual[e] > 1e-12 and head[e] not in side:
                side.add(head[e])
                queue.append(head[e])
    nodes: list[int] = []
    sources: list[int] = []
    for (u, v), (xs, ss) in flow.capacities.items():
        if u in side and v not in side:
            nodes += xs
            sources += ss
    return PathCut(flow.reader, tuple(nodes), tuple(sources))
