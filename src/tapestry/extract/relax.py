"""The ILP's LP relaxation, tightened with path cuts (HiGHS) before CP-SAT searches.

The LP is the CP-SAT model of `ilp.py` less its order variables: choice, activity, source, reader and need
constraints. Its bound is weak where a value has alternative derivations that meet again below (a linear, or a
matmul then an add; a layer norm replicated or sharded): the LP chooses each at a fraction and pays what they
share by that fraction. Path cuts repair it. If block B' needs block B (`Reduced.needs`), the source of B' reads,
through chosen nodes, a class of B: a selection has a path of chosen nodes from an entry node of B up to the
source of B'. So for every cut C of the graph of such paths, u_B' <= sum of x_n over the nodes in C (a node's
capacity is x_n, a source's s_n). The same holds for B reached from B' through several steps of needs: pairs up
to `NEED_HOPS` steps apart take a 12-layer stack on 16 devices to its optimum in 4 rounds (one step: 10).
Separation is a max flow per pair under the LP solution, all pairs in one graph (`FlowBatch`); a flow below u_B'
gives the violated cut. On a transformer block on 8 devices they take the LP bound from 99.0% of
the optimum to the optimum; the LP solution rounded (each class's largest x) is then often a selection that
meets the bound, so optimal outright.

Every cut holds for every acyclic selection, so adding them to the CP-SAT model cuts no selection.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

# SciPy's own HiGHS: the highspy wheel's library and OR-tools' clash in one process (undefined symbols)
from scipy.optimize._highspy import _core as highs
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from tapestry.clock import clock
from tapestry.extract.egraph import EGraph

TOLERANCE = 1e-6  # a cut counts as violated by more than this
SLACK = 1e-9  # share shaved off the Lagrangian bound (`Lp.solve`) for rounding in its sums
PROVEN = 1e-6  # a selection within this share of the bound counts as optimal
# A round of cuts that closes less than this share of the gap between the bound and the incumbent ends the
# loop if it is the first round or follows another such round: on a 2x4 mesh the path cuts move the bound by
# 0-5% of the gap a round (its gap is of another kind) and a re-solve of a 4-layer stack's LP takes 0.5-1 s;
# on mesh 8 the first round closes 15-50% of it, and a round that closes none is followed by one that closes
# much (one layer: 1.15%, 0.97%, 0.97%, 0.58%, 0 above greedy-dag).
STALL = 0.05
# Path cuts for a block and the blocks it needs within this many steps (needs are transitively reduced): on a
# 12-layer stack on 16 devices, 1 step took 10 rounds to the optimum, 2 steps 5, 3 steps 4, 4 and 5 steps 4.
NEED_HOPS = 3
# Steps of needs where the pass ends at a gap (`enough` above PROVEN) rather than a proof: fewer cuts a round, but
# that is all such a pass needs. Mixtral on 2x2 ends within its 1% stop gap after one round either way (0.89%
# with one step, 0.85% with three), and its path graphs took 0.77 of its 3.2 CPU s in the ILP at three.
GAP_HOPS = 1
# Path-graph nodes built per second, and the share of the LP pass's time that building them may take, so that
# rounds (re-solves and separations) have the rest: pairs are taken a whole step at a time while they fit, and
# the pass is skipped if the 1-step pairs do not (without cuts the LP is CP-SAT's own root LP). Built at
# 225,000 a second on Rover's fir_8_tap_5 (1.4 million: its LP with 1-step cuts then proves the optimum in 18 s)
# and 350,000 on 12 layers on 16 devices (350,000 at 3 steps); Tensat's bert and nasrnn need 18 and 10 million
# at 1 step (their regions span the graph) and building them had taken the LP pass's whole share.
PATH_NODES_PER_SECOND = 250_000
PATH_SHARE = 0.3
FLOW_UNIT = 2**20  # max flow runs on integer capacities: LP values in these units
BATCH = 512  # path graphs per max flow: their demands (at most 1 each) sum to at most 2^29 units
UNBOUNDED = 2**30  # an unbounded edge's capacity in those units: more than a batch's whole flow
DEVEX = 1  # HiGHS's simplex_dual_edge_weight_strategy value for Devex pricing


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


def relax(
    egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
    needs: Mapping[int, Sequence[int]], deadline: float, ties: Sequence[tuple[int, int]] = (),
    offer: Callable[[list[int]], float] = lambda _: math.inf, enough: float = PROVEN, reads: bool = False,
) -> Relaxation:
    """Solve the LP of `candidates` (class -> nodes), then, with `reads`, with read rows (`Lp.add_reads`; not
    under ties or a negative cost), adding violated path cuts (`NEED_HOPS` steps of needs apart, `GAP_HOPS` where
    `enough` is a gap, not a proof) until none is left, the bound
    comes within `enough` of the incumbent (at `PROVEN` that proves it optimal), a round closes too little of the
    gap to it (`STALL`), or `deadline` passes. Each LP solution, rounded to a choice per class (its candidate of
    largest x, -1 for classes without one), is passed to `offer`, which returns the incumbent's cost (inf for
    none yet).
    `block` maps each class to its block (cyclic component id, or -1 - class), `needs` is `Reduced.needs`.
    When the path graphs would take too long to build (`PATH_SHARE`), nothing is solved (bound 0, no cuts), or with
    `reads` the LP and its read rows alone."""
    cuts: list[PathCut] = []
    rounds, stalled, productive = 0, False, False
    bound, values = 0.0, None  # the last LP solved; out of time, it and the cuts found so far still hold
    try:
        reads = reads and not ties and all(egraph.node_cost[n] >= 0 for nodes in candidates.values() for n in nodes)
        pairs = need_pairs(egraph, candidates, block, needs, deadline, NEED_HOPS if enough <= PROVEN else GAP_HOPS)
        if pairs is None and not reads:  # no cuts to afford: the LP alone is CP-SAT's own root LP
            return Relaxation((), 0.0, 0)
        lp = Lp(egraph, candidates, block, needs, ties, deadline)
        bound, values = lp.solve(deadline)
        graphs: PathGraphs | None = None  # made once the LP without cuts has proven nothing
        previous = None  # the bound before the last round of cuts
        while values is not None:
            incumbent = offer(_rounded(egraph, candidates, lp, values))
            if math.isfinite(incumbent) and incumbent <= _shaved(bound) + enough * incumbent:
                break
            if reads:  # once the first solution is offered: rounded, it made Mixtral's plan, the tighter LP's did not
                reads = False
                lp.add_reads(egraph, candidates)
                solved = lp.solve(deadline)
                if solved[1] is None:
                    break
                bound, values = solved
                continue
            if pairs is None:  # no path cuts to afford
                break
            if previous is not None:
                small = math.isfinite(incumbent) and bound - previous < STALL * (incumbent - previous)
                if small and (stalled or not productive):
                    break
                stalled, productive = small, productive or not small
            if graphs is None:
                graphs = PathGraphs(egraph, candidates, block, pairs, lp)
            found = graphs.separate(np.asarray(values), deadline)
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


def lp_bound(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
             needs: Mapping[int, Sequence[int]], deadline: float) -> float:
    """The bound of the LP alone, without cuts or rounding (0 when it is not solved by `deadline`): what
    `contract.py` asks of a relaxed problem, whose LP solutions are no selections of the e-graph it bounds."""
    try:
        bound, values = Lp(egraph, candidates, block, needs, (), deadline).solve(deadline)
    except _OutOfTime:
        return 0.0
    return 0.0 if values is None else _shaved(bound)


@dataclass(frozen=True)
class ReadRowsBound:
    """The LP's bound alone and with read rows, and the CPU seconds of the warm re-solve that added them: what
    read rows buy a graph's bound and at what price (benchmarks/lp_bound.py)."""

    without: float
    bound: float
    resolve_cpu_s: float


def read_rows_bound(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                    needs: Mapping[int, Sequence[int]]) -> ReadRowsBound:
    """The LP of `candidates` without cuts, solved, then with its read rows (`Lp.add_reads`) solved again warm,
    as `relax(..., reads=True)` does before any path cut; no deadline."""
    lp = Lp(egraph, candidates, block, needs, (), math.inf)
    without, _ = lp.solve(math.inf)
    lp.add_reads(egraph, candidates)
    started = clock()
    bound, _ = lp.solve(math.inf)
    return ReadRowsBound(_shaved(without), _shaved(bound), clock() - started)


def _shaved(bound: float) -> float:
    """The Lagrangian bound lowered by `SLACK`: a bound despite float rounding."""
    return max(0.0, bound - SLACK * abs(bound))


def _rounded(egraph: EGraph, candidates: Mapping[int, Sequence[int]], lp: Lp, values: Sequence[float]) -> list[int]:
    """Per class, its candidate of largest x in `values` (-1 for a class without candidates)."""
    choice = [-1] * egraph.num_classes
    for c, nodes in candidates.items():
        choice[c] = max(nodes, key=lambda n: values[lp.x[n]])
    return choice


class _Rows:
    """Rows for HiGHS as flat lists (columns and coefficients one row after another, and each row's bounds):
    building a dict per row took most of the LP's set-up, which for Mixtral on 2x2 builds 54,000 rows."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.columns: list[int] = []
        self.coefficients: list[float] = []
        self.low: list[float] = []
        self.high: list[float] = []

    def add(self, columns: Sequence[int], coefficients: Sequence[float], low: float, high: float) -> None:
        """A row; its `columns` distinct."""
        self.starts.append(len(self.columns))
        self.columns += columns
        self.coefficients += coefficients
        self.low.append(low)
        self.high.append(high)

    def add_sum(self, coefficients: Mapping[int, float], low: float, high: float) -> None:
        """A row of coefficients per column."""
        self.add(list(coefficients), list(coefficients.values()), low, high)


PAIR = (1.0, -1.0)  # x_i - x_j


class Lp:
    """The LP in HiGHS, rows added as cuts are found (a warm re-solve)."""

    def __init__(self, egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                 needs: Mapping[int, Sequence[int]], ties: Sequence[tuple[int, int]], deadline: float) -> None:
        child_sets = egraph.child_sets
        if clock() > deadline:
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
        rows = _Rows()
        x, active = self.x, self.active
        for c, nodes in candidates.items():
            if clock() > deadline:
                raise _OutOfTime
            rows.add([*(x[n] for n in nodes), active[c]], [*(1.0 for _ in nodes), -1.0], 0.0, 0.0)
            for n in nodes:
                for d in child_sets[n]:
                    rows.add([x[n], active[d]], PAIR, -math.inf, 0.0)
        if clock() > deadline:
            raise _OutOfTime
        readers: dict[tuple[int, int], list[int]] = {}
        for b, classes in blocks.items():
            if clock() > deadline:
                raise _OutOfTime
            if len(classes) == 1:
                self.used[b] = active[classes[0]]
                entries = {n: x[n] for n in candidates[classes[0]]}
            else:
                self.used[b] = count
                count += 1
                rows.add([count - 1, *(active[c] for c in classes)], [1.0, *(-1.0 for _ in classes)], -math.inf, 0.0)
                for c in classes:
                    rows.add([active[c], count - 1], PAIR, -math.inf, 0.0)
                entries = {}
                for c in classes:
                    for n in candidates[c]:
                        if all(block[d] != b for d in child_sets[n]):
                            entries[n] = self.source[n] = count
                            count += 1
                            rows.add([count - 1, x[n]], PAIR, -math.inf, 0.0)
                rows.add([*entries.values(), self.used[b]], [*(1.0 for _ in entries), -1.0], 0.0, 0.0)
            for n, var in entries.items():
                for read in {block[d] for d in child_sets[n]}:
                    readers.setdefault((b, read), []).append(var)
        for (_, read), sources in readers.items():
            if len(sources) > 1:
                rows.add_sum({**{v: 1.0 for v in sources}, self.used[read]: -1.0}, -math.inf, 0.0)
        for b, needed in needs.items():
            for d in needed:
                if b in self.used and d in self.used:
                    rows.add_sum({self.used[b]: 1.0, self.used[d]: -1.0}, -math.inf, 0.0)
        for a, b in ties:
            if a in x and b in x:
                rows.add_sum({x[a]: 1.0, x[b]: -1.0}, 0.0, 0.0)
        if clock() > deadline:
            raise _OutOfTime
        self.lower = np.zeros(count)
        for root in egraph.roots:
            self.lower[active[root]] = 1.0
        self.cost = np.zeros(count)
        for n, i in x.items():
            self.cost[i] = egraph.node_cost[n]
        positive = self.cost[self.cost > 0]
        self.unit = float(positive.mean()) if positive.size else 1.0  # costs in HiGHS are O(1): see `solve`
        self.highs = highs._Highs()
        self.highs.setOptionValue("output_flag", False)
        # Devex pricing, not dual steepest edge: its iterations are cheaper, most of all in the warm re-solves
        # after rows are added, which run on the LP unpresolved (Mixtral on 2x2: read rows 0.55 -> 0.23 CPU s,
        # the first solve 0.63 -> 0.48; the same bounds)
        self.highs.setOptionValue("simplex_dual_edge_weight_strategy", DEVEX)
        self.highs.addVars(count, self.lower, np.ones(count))
        self.highs.changeColsCost(count, np.arange(count, dtype=np.int32), self.cost / self.unit)
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.entries: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])  # row, column, coef
        self.matrix: sparse.csr_matrix | None = None  # the rows' matrix, made by `dual_bound` once rows change
        self._add_rows(rows)

    def _add_rows(self, rows: _Rows) -> None:
        starts = np.array(rows.starts, dtype=np.int32)
        columns = np.array(rows.columns, dtype=np.int32)
        coefficients = np.array(rows.coefficients, dtype=np.float64)
        lengths = np.diff(np.append(starts, len(columns)))
        self.entries[0].append(np.repeat(np.arange(len(self.row_lower), len(self.row_lower) + len(starts)), lengths))
        self.entries[1].append(columns)
        self.entries[2].append(coefficients)
        self.row_lower += rows.low
        self.row_upper += rows.high
        self.matrix = None
        self.highs.addRows(len(starts), np.array(rows.low, dtype=np.float64), np.array(rows.high, dtype=np.float64),
                           len(columns), starts, columns, coefficients)

    def add_reads(self, egraph: EGraph, candidates: Mapping[int, Sequence[int]]) -> None:
        """Read rows: a class that is no root is active only as far as nodes of other classes that read it are
        chosen. Not every selection keeps them (an active class nothing reads is allowed), but with no negative
        cost dropping what the roots do not reach leaves a selection no dearer that does, and that keeps every
        other row and cut; with ties it might break one, so they are not added then. Without them the LP made a
        value's block used through an entry nothing reads: Mixtral's expert grouped_mm computed partial (a sum
        left pending, a third of the replicated price) and never reduced, its readers' layouts fed from the
        replicated one at a fraction; the bound was 7.5% under the plan on 2x2, with them 1.0%."""
        found: dict[int, dict[int, None]] = {c: {} for c in candidates}
        for c, nodes in candidates.items():
            for n in nodes:
                for d in egraph.child_sets[n]:
                    if d != c:
                        found[d][self.x[n]] = None
        roots = set(egraph.roots)
        rows = _Rows()
        for c, readers in found.items():
            if c not in roots:
                rows.add([self.active[c], *readers], [1.0, *(-1.0 for _ in readers)], -math.inf, 0.0)
        self._add_rows(rows)

    def variable(self, node: int, source: bool) -> int:
        return self.source.get(node, self.x[node]) if source else self.x[node]

    def add(self, cuts: Sequence[PathCut]) -> None:
        rows = _Rows()
        for cut in cuts:
            coef: dict[int, float] = {self.used[cut.reader]: 1.0}
            for n in cut.nodes:
                coef[self.x[n]] = coef.get(self.x[n], 0.0) - 1.0
            for n in cut.sources:
                var = self.variable(n, True)
                coef[var] = coef.get(var, 0.0) - 1.0
            rows.add_sum(coef, -math.inf, 0.0)
        self._add_rows(rows)

    def solve(self, deadline: float) -> tuple[float, list[float] | None]:
        """(bound, solution), or (0, None) if HiGHS did not solve it to optimality by `deadline`.

        The bound is not HiGHS's objective: "optimal" allows reduced costs down to -1e-7, so the primal
        objective of a transformer block (costs ~1e-6 s) came out 2.6e-4 of the optimum above it, in 2 runs of
        3. Costs go to HiGHS in units of their mean, and the bound is Lagrangian: for the row duals y (each sign
        kept only where its side of the row is finite), min over the box of (c - A'y)x + the rows' bounds by y,
        a lower bound for every y (Neumaier and Shcherbina, Math. Prog. 2004), equal to the optimum at the
        optimal y."""
        left = deadline - clock()
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
        if self.matrix is None:
            rows, columns, coefficients = (np.concatenate(chunks) for chunks in self.entries)
            self.matrix = sparse.csr_matrix((coefficients, (rows, columns)),
                                            shape=(len(self.row_lower), len(self.cost)))
        matrix = self.matrix
        low, high = np.array(self.row_lower), np.array(self.row_upper)
        dual = np.where(((dual > 0) & np.isfinite(low)) | ((dual < 0) & np.isfinite(high)), dual, 0.0)
        reduced = self.cost - matrix.T @ dual  # the columns' bounds are [lower, 1]
        return (float(dual[dual > 0] @ low[dual > 0]) + float(dual[dual < 0] @ high[dual < 0])
                + float(reduced[reduced > 0] @ self.lower[reduced > 0]) + float(reduced[reduced < 0].sum()))


@dataclass(frozen=True)
class NeedPairs:
    """The pairs (B', B) to separate, each with its region (the blocks a path from B up to B' can cross), and
    each block's classes."""

    pairs: tuple[tuple[int, int, frozenset[int]], ...]  # (reader, target, region)
    members: Mapping[int, list[int]]


def need_pairs(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
               needs: Mapping[int, Sequence[int]], deadline: float, steps: int = NEED_HOPS) -> NeedPairs | None:
    """Every pair (B', B) with B one step of needs from B', then two, .. `steps`, while their path graphs
    can be built in `PATH_SHARE` of the time to `deadline` (whole steps only); None when the one-step pairs
    alone cannot. The region of (B', B): the blocks below B' and above B."""
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
    room = PATH_NODES_PER_SECOND * PATH_SHARE * (deadline - clock())
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
                if clock() > deadline:
                    raise _OutOfTime
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
                 pairs: NeedPairs, lp: Lp) -> None:
        self.egraph, self.candidates, self.block, self.pairs, self.lp = egraph, candidates, block, pairs, lp
        self.readers = np.array([lp.used[reader] for reader, _, _ in pairs.pairs], dtype=np.int64)
        self.made = np.zeros(len(pairs.pairs), dtype=bool)
        self.prepared: dict[int, list[tuple[int, tuple[int, ...], bool, int, int]]] = {}
        self.inner: dict[int, _Inner] = {}
        self.batches: list[tuple[FlowBatch, np.ndarray]] = []  # each with its flows' pairs

    def separate(self, values: np.ndarray, deadline: float) -> list[PathCut]:
        """The violated cuts under the LP `values` (`FlowBatch.separate`), in the order of their pairs."""
        new = np.flatnonzero(~self.made & (values[self.readers] > TOLERANCE))
        if new.size:
            self.made[new] = True
            flows = path_flows(self.egraph, self.candidates, self.block, self.pairs, self.lp, deadline, new.tolist(),
                           self.prepared, self.inner)
            self.batches += zip(_batches(flows, len(self.lp.cost), deadline),
                                (new[i:i + BATCH] for i in range(0, new.size, BATCH)))
        found = []
        for batch, pairs in self.batches:
            if clock() > deadline:
                raise _OutOfTime
            found += [(pairs[i], cut) for i, cut in batch.violated(values, values[self.readers[pairs]])]
        return [cut for _, cut in sorted(found, key=lambda pair_cut: pair_cut[0])]


def path_flows(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int], pairs: NeedPairs,
           lp: Lp, deadline: float, chosen: Sequence[int] | None = None,
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
        if clock() > deadline:
            raise _OutOfTime
        flows.append(_flow(prepared, pairs.members, inner, *pairs.pairs[i]))
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


def _batches(flows: Sequence[PathFlow], columns: int, deadline: float) -> list[FlowBatch]:
    """`flows` in batches of `BATCH` (their demands sum to at most that, so flows stay within int32)."""
    batches = []
    for i in range(0, len(flows), BATCH):
        if clock() > deadline:
            raise _OutOfTime
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
