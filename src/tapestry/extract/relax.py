"""The ILP's LP relaxation, tightened with path cuts (HiGHS) before CP-SAT searches.

The LP is the CP-SAT model of `ilp.py` less its order variables: choice, activity, source, reader and need
constraints. Its bound is weak where a value has alternative derivations that meet again below (a linear, or a
matmul then an add; a layer norm replicated or sharded): the LP chooses each at a fraction and pays what they
share by that fraction. Path cuts repair it. If block B' needs block B (`Reduced.needs`), the source of B' reads,
through chosen nodes, a class of B: a selection has a path of chosen nodes from an entry node of B up to the
source of B'. So for every cut C of the graph of such paths, u_B' <= sum of x_n over the nodes in C (a node's
capacity is x_n, a source's s_n). The same holds for B reached from B' through several steps of needs: pairs up
to `NEED_HOPS` steps apart take a 12-layer stack on 16 devices to its optimum in 4 rounds (one step: 10).
Separation (`separation.py`) is a max flow per pair under the LP solution; a flow below u_B' gives the violated
cut. On a transformer block on 8 devices they take the LP bound from 99.0% of
the optimum to the optimum; the LP solution rounded (each class's largest x) is then often a selection that
meets the bound, so optimal outright.

Every cut holds for every acyclic selection, so adding them to the CP-SAT model cuts no selection.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

# SciPy's own HiGHS: the highspy wheel's library and OR-tools' clash in one process (undefined symbols)
from scipy.optimize._highspy import _core as highs

from tapestry.clock import clock
from tapestry.extract.egraph import EGraph
from tapestry.extract.separation import (
    NEED_HOPS,
    NeedPairs,
    OutOfTime,
    PathCut,
    PathGraphs,
    need_pairs,
)
from tapestry.extract.work import Deadline, unbounded

SLACK = 1e-9  # share shaved off the Lagrangian bound (`Lp.solve`) for rounding in its sums
PROVEN = 1e-6  # a selection within this share of the bound counts as optimal
# A round of cuts that closes less than this share of the gap between the bound and the incumbent ends the
# loop if it is the first round or follows another such round: on a 2x4 mesh the path cuts move the bound by
# 0-5% of the gap a round (its gap is of another kind) and a re-solve of a 4-layer stack's LP takes 0.5-1 s;
# on mesh 8 the first round closes 15-50% of it, and a round that closes none is followed by one that closes
# much (one layer: 1.15%, 0.97%, 0.97%, 0.58%, 0 above greedy-dag).
STALL = 0.05
# Steps of needs where the pass ends at a gap (`enough` above PROVEN) rather than a proof: fewer cuts a round, but
# that is all such a pass needs. Mixtral on 2x2 ends within its 1% stop gap after one round either way (0.89%
# with one step, 0.85% with three), and its path graphs took 0.77 of its 3.2 CPU s in the ILP at three.
GAP_HOPS = 1
DEVEX = 1  # HiGHS's simplex_dual_edge_weight_strategy value for Devex pricing
# The LP's work (`work.Meter`): building it, columns and rows per second, and HiGHS's simplex iterations per second,
# its limit per solve (`simplex_iteration_limit`, a count: the same stop at any load). CPU seconds at load ~14 of the
# contracted LP of Mixtral's 2-layer training step on 8 devices (16,911 columns and 25,689 rows, built in 0.13 s;
# 10,074 iterations in 0.52 s) and of `layered` graphs' LPs (1,000-2,000 columns: 1,077 iterations in 0.028 s), timed
# around `Lp.__init__` and `Lp.solve` (a scratch script; `python benchmarks/extract_work.py --cluster Mixtral
# training 8` times the pass as a whole).
LP_ENTRIES_PER_SECOND = 300_000
ITERATIONS_PER_SECOND = 20_000
ITERATION_CAP = 2**31 - 1  # HiGHS's limit is an int32


@dataclass(frozen=True)
class Relaxation:
    """What the tightened LP gave: its cuts and its bound."""

    cuts: tuple[PathCut, ...]
    bound: float  # lower bound on the cost of every acyclic selection (0 when the LP did not solve)
    rounds: int


def relax(
    egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
    needs: Mapping[int, Sequence[int]], deadline: Deadline, ties: Sequence[tuple[int, int]] = (),
    offer: Callable[[list[int]], float] = lambda _: math.inf, enough: float = PROVEN, reads: bool = False,
) -> Relaxation:
    """Solve the LP of `candidates` (class -> nodes), then, with `reads`, with read rows (`Lp.add_reads`; not
    under ties or a negative cost), adding violated path cuts (`NEED_HOPS` steps of needs apart, `GAP_HOPS` where
    `enough` is a gap, not a proof) until none is left, the bound
    comes within `enough` of the incumbent (at `PROVEN` that proves it optimal), a round closes too little of the
    gap to it (`STALL`), or the work charged reaches `deadline`. Each LP solution, rounded to a choice per class
    (its candidate of largest x, -1 for classes without one), is passed to `offer`, which returns the incumbent's
    cost (inf for none yet).
    `block` maps each class to its block (cyclic component id, or -1 - class), `needs` is `Reduced.needs`.
    When the path graphs would take too long to build (`PATH_SHARE`), nothing is solved (bound 0, no cuts), or with
    `reads` the LP and its read rows alone. `LpPass.run` of a pass of its own."""
    return LpPass(egraph, candidates, block, needs, ties, enough, reads).run(deadline, offer)


@dataclass(frozen=True)
class _Step:
    """One step of an LP pass: what it added and the LP solution it ended with (None: the pass ends there)."""

    cuts: tuple[PathCut, ...]
    solution: tuple[float, list[int]] | None  # the LP's bound and its solution rounded (`_rounded`)
    spent: float  # the meter's work when the step began
    charged: float  # the work it charged

    @property
    def rounds(self) -> int:
        """Rounds of path cuts it added: one where it found cuts."""
        return 1 if self.cuts else 0


class Diverged(Exception):
    """A replayed step began at other work than when it was made: only where the safety net stopped a phase."""


class LpPass:
    """`relax`'s LP and its solutions in order (the LP, its read rows, then rounds of path cuts), made as far as a
    run asks and replayed after. No step depends on the incumbent: what `offer` returns decides only where a run
    stops (`run`), and the steps' work is counted (`work.Meter`), so a run that begins at the same work (and
    makes the same offers, which charge alike) takes the same steps: a replayed step charges its work again and
    returns what it returned. A memory budget's cut rounds and a pipeline layer's leaner plans run the ILP's pass
    on the graphs the fastest plan's solved, at the same costs (`ilp._relaxed`); HiGHS ran each again (2.4-4.7 CPU s
    a call on the 70B layer on 8x8)."""

    def __init__(self, egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
                 needs: Mapping[int, Sequence[int]], ties: Sequence[tuple[int, int]], enough: float,
                 reads: bool) -> None:
        self.egraph, self.candidates, self.block, self.needs, self.ties = egraph, candidates, block, needs, ties
        self.enough = enough
        self.reads = reads and not ties and all(egraph.node_cost[n] >= 0 for nodes in candidates.values()
                                                for n in nodes)
        self.steps: list[_Step] = []
        self.fired = False  # the safety net stopped a step: what it made depends on the load, and is not replayed
        self._lp: Lp | None = None
        self._pairs: NeedPairs | None = None
        self._graphs: PathGraphs | None = None
        self._values: list[float] | None = None

    def run(self, deadline: Deadline, offer: Callable[[list[int]], float]) -> Relaxation:
        """The pass to where the incumbents `offer` returns stop it (`relax`), each step replayed where made."""
        cuts: list[PathCut] = []
        rounds, stalled, productive = 0, False, False
        bound, previous, k = 0.0, None, 0  # the last LP solved and the bound before the last round of cuts
        step = self._step(0, deadline)
        while step.solution is not None:
            bound, rounded = step.solution
            incumbent = offer(list(rounded))
            if math.isfinite(incumbent) and incumbent <= rounding_safe(bound) + self.enough * incumbent:
                break
            reading = self.reads and k == 0  # once the first solution is offered: rounded, it made Mixtral's plan
            if not reading and previous is not None:
                small = math.isfinite(incumbent) and bound - previous < STALL * (incumbent - previous)
                if small and (stalled or not productive):
                    break
                stalled, productive = small, productive or not small
            k += 1
            step = self._step(k, deadline)
            cuts += step.cuts
            rounds += step.rounds
            if step.solution is not None and not reading:
                previous = bound
        return Relaxation(tuple(cuts), 0.0 if k == 0 and step.solution is None else rounding_safe(bound), rounds)

    def _step(self, k: int, deadline: Deadline) -> _Step:
        """Step `k`: replayed where made (its work charged again), else made (only the next is ever asked)."""
        meter = deadline.meter
        if k < len(self.steps):
            made = self.steps[k]
            if made.spent != meter.spent:
                raise Diverged(f"LP pass step {k} began at {meter.spent} s of work, made at {made.spent}")
            meter.charge(made.charged)
            return made
        spent, fired = meter.spent, meter.fired
        added: list[PathCut] = []
        try:
            solution = self._made(k, deadline, added)
        except OutOfTime:
            solution = None
        self.fired = self.fired or (meter.fired and not fired)
        step = _Step(tuple(added), solution, spent, meter.spent - spent)
        self.steps.append(step)
        return step

    def _made(self, k: int, deadline: Deadline, added: list[PathCut]) -> tuple[float, list[int]] | None:
        """Step `k` made on the live LP: the first solve, the read rows' or a round of path cuts' (whose cuts go
        into `added` as soon as they are found, as they hold even if the LP then runs out of time)."""
        if k == 0:
            self._pairs = need_pairs(self.egraph, self.candidates, self.block, self.needs, deadline,
                                     NEED_HOPS if self.enough <= PROVEN else GAP_HOPS)
            if self._pairs is None and not self.reads:  # no cuts to afford: the LP alone is CP-SAT's own root LP
                return None
            self._lp = Lp(self.egraph, self.candidates, self.block, self.needs, self.ties, deadline)
        elif k == 1 and self.reads:
            self._lp.add_reads(self.egraph, self.candidates)
        else:
            if self._pairs is None:  # no path cuts to afford
                return None
            if self._graphs is None:  # made once the LP without cuts has proven nothing
                self._graphs = PathGraphs(self.egraph, self.candidates, self.block, self._pairs, self._lp)
            found = self._graphs.separate(np.asarray(self._values), deadline)
            if not found:
                return None
            added.extend(found)
            self._lp.add(found)
        bound, values = self._lp.solve(deadline)
        if values is None:
            return None
        self._values = values
        return bound, _rounded(self.egraph, self.candidates, self._lp, values)


@dataclass(frozen=True)
class LpBound:
    """An LP's bound (`rounding_safe`) and its solution, x per node of the e-graph it was made of (`values`: None,
    and the bound 0, where it was not solved by the deadline)."""

    bound: float
    values: Mapping[int, float] | None = None


def lp_bound(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
             needs: Mapping[int, Sequence[int]], deadline: Deadline, solver: str = "",
             fallback: float = 0.0) -> LpBound:
    """The LP alone, without cuts or rounding: what `contract.py` asks of a relaxed problem, whose LP solutions are
    no selections of the e-graph it bounds, and egraph.plan_bound of its weighted node costs. `solver`: HiGHS's
    (its default where empty); where that one stops short of its tolerances (PDLP can), the dual simplex gets up
    to `fallback` seconds more of the deadline's work."""
    try:
        lp = Lp(egraph, candidates, block, needs, (), deadline)
        if solver:
            lp.highs.setOptionValue("solver", solver)
        bound, values = lp.solve(deadline)
        if values is None and fallback > 0.0 and not deadline.passed():
            lp.highs.setOptionValue("solver", "simplex")
            bound, values = lp.solve(Deadline(deadline.meter, min(deadline.end, deadline.meter.spent + fallback)))
    except OutOfTime:
        return LpBound(0.0)
    if values is None:
        return LpBound(0.0)
    return LpBound(rounding_safe(bound), {n: values[i] for n, i in lp.x.items()})


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
    lp = Lp(egraph, candidates, block, needs, (), unbounded())
    without, _ = lp.solve(unbounded())
    lp.add_reads(egraph, candidates)
    started = clock()
    bound, _ = lp.solve(unbounded())
    return ReadRowsBound(rounding_safe(without), rounding_safe(bound), clock() - started)


def rounding_safe(bound: float) -> float:
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
                 needs: Mapping[int, Sequence[int]], ties: Sequence[tuple[int, int]], deadline: Deadline) -> None:
        """Raises OutOfTime where the safety net fires (`deadline`, which the LP is charged to when made)."""
        child_sets = egraph.child_sets
        if deadline.safety():
            raise OutOfTime
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
            if deadline.safety():
                raise OutOfTime
            rows.add([*(x[n] for n in nodes), active[c]], [*(1.0 for _ in nodes), -1.0], 0.0, 0.0)
            for n in nodes:
                for d in child_sets[n]:
                    rows.add([x[n], active[d]], PAIR, -math.inf, 0.0)
        if deadline.safety():
            raise OutOfTime
        readers: dict[tuple[int, int], list[int]] = {}
        for b, classes in blocks.items():
            if deadline.safety():
                raise OutOfTime
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
        if deadline.safety():
            raise OutOfTime
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
        deadline.meter.charge((count + len(self.row_lower)) / LP_ENTRIES_PER_SECOND)

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

    def solve(self, deadline: Deadline) -> tuple[float, list[float] | None]:
        """(bound, solution), or (0, None) if HiGHS did not solve it to optimality in the simplex iterations left
        to `deadline` (ITERATIONS_PER_SECOND; those it made are charged), or by the safety net (in seconds of
        HiGHS's own clock, the wall: recorded on the meter).

        The bound is not HiGHS's objective: "optimal" allows reduced costs down to -1e-7, so the primal
        objective of a transformer block (costs ~1e-6 s) came out 2.6e-4 of the optimum above it, in 2 runs of
        3. Costs go to HiGHS in units of their mean, and the bound is Lagrangian: for the row duals y (each sign
        kept only where its side of the row is finite), min over the box of (c - A'y)x + the rows' bounds by y,
        a lower bound for every y (Neumaier and Shcherbina, Math. Prog. 2004), equal to the optimum at the
        optimal y."""
        iterations = min(deadline.left() * ITERATIONS_PER_SECOND, ITERATION_CAP)
        if iterations < 1 or deadline.safety():
            return 0.0, None
        self.highs.setOptionValue("simplex_iteration_limit", int(iterations))
        # HiGHS counts its whole life
        self.highs.setOptionValue("time_limit", self.highs.getRunTime() + deadline.seconds())
        self.highs.run()
        deadline.meter.charge(self.highs.getInfo().simplex_iteration_count / ITERATIONS_PER_SECOND)
        status = self.highs.getModelStatus()
        if status == highs.HighsModelStatus.kTimeLimit:
            deadline.meter.fired = True
        if status != highs.HighsModelStatus.kOptimal:
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
