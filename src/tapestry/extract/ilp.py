"""Exact extraction with OR-tools CP-SAT, warm-started from the greedy DAG result (`warm.py`).

Variables: x_n (node n chosen) and a_c (class c active; a_c is x_n itself when the
class has one candidate). Constraints: a_root = 1; sum of x_n over c = a_c; x_n implies
a_d for each child class d. Acyclicity: integer order t_c only for classes in a
non-trivial strongly connected component of the class graph, and x_n implies
t_c > t_d only for children d in the same component; edges between components can
never close a cycle. Objective: minimize sum cost_n x_n, scaled to integers.
The warm start (greedy-dag's, or a cheaper admissible start) is returned whenever CP-SAT
finds nothing cheaper, so the ILP is never worse than greedy-dag. Where it keeps the budget and
ties, its cost is a ceiling on CP-SAT's objective (`_ceiling`); where it does not, it is a
complete hint for CP-SAT to repair (`_hint`).

Source constraints tighten the LP relaxation (they hold for every acyclic selection,
so they cut no solution). A block is a cyclic component, or a class on its own; on
Tapestry's e-graphs a component is one value's layouts, joined by reshards. u_B says
whether block B has an active class. An acyclic selection enters B through an entry
node (one with no child in B), so one entry node is B's source: s_n implies x_n, and
the s_n of B sum to u_B. The source of B reads the blocks of its children, so per
pair of blocks (B, B') the sources of B with a child in B' sum to at most u_B'. Without
them the LP spreads each value over its layouts and its producers over the inputs'
layouts, and its bound shrinks by that spread per layer (2% of the optimum on a
transformer block); with them it is about two thirds of the optimum.

Need constraints (`reduction.needed_blocks`): u_B <= u_D when every selection that uses block B
uses block D. Without them the LP splits a value between alternative derivations that
meet again below and pays for what they share by halves (the bound was 67% of the
optimum on a transformer block; with them 99%). An LP pass before CP-SAT (`relax.py`:
HiGHS with path cuts; a selection meeting its bound is optimal at once) adds its cuts to
the CP-SAT model and its bound to CP-SAT's. On a graph of more than CONTRACT_FROM candidates and with a stop gap
(the default there), a cheaper bound comes first, the LP of a contracted problem (`contract.py`), and a warm
start within the stop gap of it ends the search.

The bound is honest: each part's CP-SAT bound is clamped at 0, lowered by the most
that rounding costs to integers can add, and summed with the costs of classes
whose choice is forced; the LP bound is Lagrangian, from HiGHS's duals (`relax.Lp.solve`),
so HiGHS's tolerances cannot lift it; the larger is taken. `Selection.gap` = (cost - bound) / cost is in [0, 1].

With a `DeviceBudget`, per device d: sum of resident_n[d] x_n over all nodes,
plus transient_m[d] for any chosen m, stays within the limit; and for each of its
`groups` (bytes per node), sum of bytes_n x_n stays within it too. The whole problem
is then one part (the budget couples every class), and the greedy start counts
only if it fits.

Budgets (docs/extraction.md, "Deterministic budgets"): the warm start's local search, the LP pass and building the
CP-SAT model stop on shares of the time limit in CPU seconds (`tapestry.clock`), which a loaded machine stretches
in wall time only; CP-SAT stops on its own deterministic time, WORK_PER_SECOND units per second, its subsolvers
run in turn on one thread, so the same call gives the same selection at any load. A
wall-clock stop many times longer is a safety net, reported where it fires.

With `ties` (pairs of nodes chosen together or not at all: a training step's
placed weight and its delivered update, so the step repeats), x_a = x_b. Tied
nodes neither dominate nor are dominated, tied classes share a part, and the
greedy start counts only if it keeps every tie.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from tapestry.clock import clock
from tapestry.components import connected_groups
from tapestry.extract.contract import contracted_bound
from tapestry.extract.egraph import EGraph, NoFiniteChoiceError
from tapestry.extract.greedy_dag import improve
from tapestry.extract.periodic import Repeated
from tapestry.extract.reduction import Reduced, reduce
from tapestry.extract.relax import PROVEN, relax
from tapestry.extract.selection import Selection, children_first, dag_cost, finalize
from tapestry.extract.separation import PathCut
from tapestry.extract.tree import solvable_tree
from tapestry.extract.warm import undominate, warm_start

SCALE = 10**9  # the warm-start cost maps to this many integer units
INT64_ROOM = 2**62  # what an objective of int64 node costs may sum to, with room for CP-SAT's own arithmetic
# CP-SAT's subsolvers, run in turn by one thread (SEQUENTIAL): the full LP relaxation (with the source
# constraints it is what proves Tapestry's graphs), core-based search, and the default LP worker. As 3 workers
# time-sliced on the 2 cores, side by side under load (10-20 s limits) against the default 8-worker portfolio: a
# 4-layer stack on 8 devices proven in 7 s (8 workers: gap 0.9% at 20 s), nasneta proven in 9 s (8 workers: 8-17%
# dearer than its optimum at 30 s), vgg in 2 s, a rover file in 2 s (without default_lp: unproven at 10 s).
PORTFOLIO = ("max_lp", "core", "default_lp")
# One presolve pass: repeating them took 4.4 s of a 10 s limit on a 12-layer stack on 8 devices (30,000 nodes),
# leaving the LP no time (gap 93%; one pass: 3.2%); tensat's graphs end as before (vgg proven in 11 s, was 8).
PRESOLVE_PASSES = 1
# CP-SAT runs its subsolvers on one thread, one after another, which makes its search deterministic. Several workers
# are deterministic only interleaved (`interleave_search`: batches synchronised in a fixed order), and so they
# proved 8-15x slower than one thread: the 4-layer stack on 8 devices (LP pass off) in 17.5 CPU s against 1.99, a
# 40-value `layered` graph in 7.8 against 0.20 (the old unsynchronised 3 workers: 0.50).
SEQUENTIAL = 1
RESERVE = 0.05  # share of the time limit kept for CP-SAT stopping its workers (0.5 s seen under load) and read-back
# CP-SAT's budget is deterministic time, its own count of work done (in units meant to be about a second of one
# core), never the wall: with a wall-clock limit the same call found other plans under load (issues 24 and 25:
# a 10 s limit gave CP-SAT 2 CPU s at a load of 5 on this 2-core machine, and its plan came from the warm start).
# This many units per second of time limit, calibrated to spend about a quiet run's wall seconds on one core: the
# sequential search did 0.56 units per CPU second on a 4-layer stack on 8 devices (10,136 nodes, LP pass off,
# proven in 1.99 CPU s) and 0.34-0.39 on `layered` test graphs (docs/extraction.md, "Deterministic budgets").
WORK_PER_SECOND = 0.5
MIN_WORK = 0.01  # the least deterministic time (and wall seconds) a CP-SAT run is given
# The wall-clock stop is a safety net only, this many times CP-SAT's share of the limit (plus WALL_FLOOR): at a
# load of 10 on this 2-core machine CP-SAT's 3 workers got 0.2 of a core together, a tenth of their quiet share, and
# a 10x stop fired. Where it fires, the result depends on the load, and says so (`Selection.stopped_by`).
WALL_SAFETY = 30.0
WALL_FLOOR = 10.0  # seconds the wall-clock stop adds to that, for short limits (presolve alone takes seconds loaded)
WALL_FIRED = 0.99  # share of its wall limit a run must have taken to count as stopped by it
# What can stop the search before a proof, the least reproducible first: `Selection.stopped_by`.
STOPS = ("wall clock", "cpu clock", "work")
MIN_COST = 1e-12  # floor for the scale denominator: subnormal costs must not make it infinite
# Of the time limit, the most the LP with path cuts (relax.py) may take before CP-SAT. A selection meeting its
# bound needs no CP-SAT, and `relax.STALL` ends a pass whose rounds stop closing the gap: on 12 layers on 16
# devices the LP proves in 8 s the optimum CP-SAT alone proves in 67 s (at 0.6 it stopped 1 round short).
RELAX_SHARE = 0.9
# Nodes the ILP can reduce and model per second of its time limit: past it, only the warm start comes back. On
# 2x4 (162,000 nodes) and 2x2x2 meshes (285,000 and more) a 10 s limit never let CP-SAT better or bound the
# warm start (docs/benchmarks.md, Saturation: gap 1.0), and reducing a 2x2x2 12-layer graph (820,000 nodes)
# alone took 7 s of its 10 s.
MODEL_NODES_PER_SECOND = 20_000
# Candidate nodes the LP pass takes on per second of its share (0 turns it off): the first LP ran at 27,000 a
# second on a 12-layer stack on 8 devices, 13,000-20,000 on 4 layers on 2x4; on a 2x2x2 mesh's 1.1 million nodes
# building it ran 5 s past a 10 s limit.
LP_NODES_PER_SECOND = 15_000
# By default the ILP proves its plan on graphs of up to CONTRACT_FROM candidates. A caller may accept a selection
# within `stop_gap` (a share) of the LP bound, unproven ("feasible", its gap reported): tiny LLaMA on 2x2 came
# within 0.046% of the bound after the first LP, and CP-SAT then took 27 s to prove that same plan optimal
# (docs/benchmarks.md). A plan reported "optimal" is one the solver proved, and tests and users read it so.
STOP_GAP = 0.0
# Candidates from which the default stop gap is LARGE_STOP_GAP, and the first bound, with a stop gap, the
# contracted LP's (contract.py). Below it the full LP is quick (at LLaMA's rate, 41,850 candidates in 6.4 CPU s
# on the loaded 2-core machine, about 1.5 s) and proves the 1-D meshes' zoo models optimal. Above it, on 2x2, the
# full LP took 6.4 CPU s (LLaMA) and 16.8 (GPT-NeoX), the contracted one 0.45 (bound 0.25% below greedy-dag's
# plan) and 1.23 (0.36%) (benchmarks/contract.py).
CONTRACT_FROM = 10_000
# The default stop gap past CONTRACT_FROM: the cost model's own error is larger than a percent (predicted and
# measured step times in docs/benchmarks.md differ by more), and a plan within it of a proven bound is reported
# "feasible" with its gap, never "optimal".
LARGE_STOP_GAP = 0.01


@dataclass(frozen=True)
class DeviceBudget:
    """Linear per-device memory constraints: `resident[n]` (bytes per device) is held for the whole program by
    every chosen node n, and `transient[m]` on top of it while chosen node m runs; neither may pass `limit`. (A
    tuple's entries may stand for sets of devices alike, the most of theirs: `egraph.budget.alike_devices`.)
    Each of `groups` (bytes per node, on one device) is a set of nodes whose chosen members' bytes may not pass
    `limit` together either: what a caller learnt held memory at once (the optimizer's cuts)."""

    limit: int
    resident: Mapping[int, tuple[int, ...]]
    transient: Mapping[int, tuple[int, ...]]
    groups: tuple[Mapping[int, int], ...] = ()

    def usage(self, choice: Mapping[int, int]) -> tuple[int, ...]:
        """Per device, the bytes the constraints charge a selection (at its worst node)."""
        nodes = set(choice.values())
        devices = len(next(iter((*self.resident.values(), *self.transient.values())), ()))
        return tuple(
            sum(self.resident[n][d] for n in nodes if n in self.resident)
            + max((self.transient[n][d] for n in nodes if n in self.transient), default=0)
            for d in range(devices)
        )

    def fits(self, choice: Mapping[int, int]) -> bool:
        nodes = set(choice.values())
        return all(u <= self.limit for u in self.usage(choice)) and all(
            sum(b for n, b in group.items() if n in nodes) <= self.limit for group in self.groups)


Ties = Sequence[tuple[int, int]]  # node pairs whose x must be equal


def tied_nodes(ties: Ties) -> frozenset[int]:
    return frozenset(n for pair in ties for n in pair)


def ties_hold(choice: Mapping[int, int], ties: Ties) -> bool:
    """Every tied pair is chosen together or not at all."""
    chosen = set(choice.values())
    return all((a in chosen) == (b in chosen) for a, b in ties)


def models_in(egraph: EGraph, time_limit: float) -> bool:
    """Whether `time_limit` leaves the ILP time to model `egraph` (MODEL_NODES_PER_SECOND) before any warm start:
    past it, `extract_ilp` returns a warm start, its own local search's or the caller's."""
    return egraph.num_nodes <= MODEL_NODES_PER_SECOND * (1 - RESERVE) * time_limit


def extract_ilp(egraph: EGraph, time_limit: float = 60.0, budget: DeviceBudget | None = None, ties: Ties = (),
                repeated: Repeated | None = None, stop_gap: float | None = None,
                start: Selection | None = None) -> Selection:
    """Best selection CP-SAT finds within `time_limit`; never worse than the greedy warm start. The limit is a
    budget, not a wall-clock bound: the phases before CP-SAT get shares of it in CPU seconds (`tapestry.clock`),
    CP-SAT WORK_PER_SECOND units of deterministic time per second of it, so the selection does not depend on the
    machine's load (`Selection.stopped_by` says which budget ended an unproven search). A
    selection within `stop_gap` of the LP bound is returned as it is ("feasible" with that gap); by default
    `stop_gap` is STOP_GAP, or LARGE_STOP_GAP on a graph of more than CONTRACT_FROM candidates.
    Under `budget` and `ties`, the best that satisfies them; NoFiniteChoiceError if none does.
    CP-SAT runs the `PORTFOLIO` workers. With `repeated` (and no budget or ties), the best periodic selection
    (`periodic.py`, solved in `warm.PERIODIC_SHARE` of the limit) is a second warm start, kept if it is cheaper.
    A caller's `start` (a choice that may name classes nothing reachable reads, as a tie can ask) is one too,
    where it keeps the budget and ties: greedy-dag's start rarely keeps ties, and without an admissible start the
    LP pass's rounding and CP-SAT must find one alone.
    """
    started = clock()
    deadline = started + (1 - RESERVE) * time_limit
    tree = solvable_tree(egraph)
    greedy, folded = warm_start(  # the LP pass's window moves on by the seconds the fold took
        egraph, tree, started, time_limit, repeated if budget is None and not ties else None,
        lambda graph, seconds, fold_ties: extract_ilp(graph, seconds, ties=fold_ties), MODEL_NODES_PER_SECOND)

    def admissible(selection: Selection) -> bool:
        return (budget is None or budget.fits(selection.choice)) and ties_hold(selection.choice, ties)

    if egraph.num_nodes > MODEL_NODES_PER_SECOND * (deadline - clock()):
        # No time to reduce the graph and model it: the warm start, its local search given the time left (cut
        # at WARM_SHARE, it could end dearer than greedy-dag's), or the caller's start where it is cheaper, unproven.
        given = None if start is None else _undominated(egraph, start, {}, started)  # priced on this graph
        if ties and budget is None and not ties_hold(finalize(egraph, greedy, tree, "ilp", started).choice, ties):
            # the local search keeps no tie, and CP-SAT would get what modelling left: on the folded 7B training
            # step on 8x8 (`benchmarks/cluster.py --arch hf --models 7B --layers 32 --meshes 8x8`) it found no tied
            # selection in it
            if given is not None and ties_hold(given.choice, ties):
                return _result(given, False, 0.0, started, "cpu clock")
            raise NoFiniteChoiceError(f"no time to model {egraph.num_nodes:,} nodes, and the warm start breaks "
                                      f"the ties")
        if clock() < deadline:  # setting the search up alone takes seconds on millions of nodes
            greedy = improve(egraph, greedy, tree, deadline)
        unsolved = finalize(egraph, greedy, tree, "ilp", started)
        if given is not None and admissible(given) and (not admissible(unsolved) or given.dag_cost < unsolved.dag_cost):
            unsolved = given
        if admissible(unsolved):
            return _result(unsolved, False, 0.0, started, "cpu clock")
    reduced = reduce(egraph, tree, tied_nodes(ties))
    warm = finalize(egraph, undominate(egraph, greedy, reduced.replacement), tree, "ilp", started)
    best = warm if admissible(warm) else None
    if start is not None:
        given = _undominated(egraph, start, reduced.replacement, started)
        if admissible(given) and (best is None or given.dag_cost < best.dag_cost):
            best = warm = given
    proven, bound, lp_bound, cuts = best is not None and best.dag_cost == 0, 0.0, 0.0, ()

    def offer(choice: list[int]) -> float:
        """An LP solution rounded: made a selection, and that improved by greedy-dag's local search; the
        cheapest admissible of them is kept if it is the best yet."""
        nonlocal best, warm
        choice = undominate(egraph, choice, reduced.replacement)
        rounded = finalize(egraph, choice, tree, "ilp", started)
        # classes the selection leaves out keep the LP's choice, so a move that brings them in is priced by it
        full = [rounded.choice.get(c, n if n >= 0 else t) for c, (n, t) in enumerate(zip(choice, tree.node))]
        improved = finalize(egraph, undominate(egraph, improve(egraph, full, tree, relax_deadline),
                                               reduced.replacement), tree, "ilp", started)
        for candidate in (rounded, improved):
            if admissible(candidate) and (best is None or candidate.dag_cost < best.dag_cost):
                best = warm = candidate
        return math.inf if best is None else best.dag_cost

    relax_deadline = min(started + RELAX_SHARE * time_limit + folded, deadline)
    size = sum(map(len, reduced.candidates.values()))
    if stop_gap is None:
        stop_gap = LARGE_STOP_GAP if size > CONTRACT_FROM else STOP_GAP
    block = {c: reduced.block(c) for c in reduced.candidates}

    def close(share: float) -> bool:
        return best is not None and best.dag_cost <= lp_bound + share * best.dag_cost

    if not proven and size > CONTRACT_FROM and stop_gap > 0:  # else the full LP's bound is the one asked for
        lp_bound = contracted_bound(egraph, reduced.candidates, block, reduced.needs, relax_deadline)
        proven = close(PROVEN)
    if not proven and not close(stop_gap) and size <= LP_NODES_PER_SECOND * (relax_deadline - clock()):
        # read rows only where a stop gap is asked: below CONTRACT_FROM the path cuts prove the 1-D meshes' zoo
        # models as they are, and after read rows Mixtral's on Mesh(4) stalled 1.4e-6 short of its proof
        relaxation = relax(egraph, reduced.candidates, block, reduced.needs, relax_deadline, ties, offer,
                           max(stop_gap, PROVEN), reads=stop_gap > 0)
        lp_bound, cuts = max(lp_bound, relaxation.bound), relaxation.cuts
        proven = close(PROVEN)
    stopped_by = None
    if not proven and not close(stop_gap) and (clock() < deadline or best is None):
        solved, bound, optimal, stopped_by = _solve(egraph, reduced, warm, best is not None,
                                                    (1 - RESERVE) * time_limit, budget, ties, cuts)
        if solved is not None:
            candidate = _with_tied(egraph, finalize(egraph, solved, tree, "ilp", started), solved, ties)
            better = admissible(candidate) and (best is None or candidate.dag_cost <= best.dag_cost)
            proven = optimal and better
            best = candidate if better else best
    if best is None:
        asked = "the ties" if budget is None else f"the budget of {budget.limit:,} per device"
        raise NoFiniteChoiceError(f"no selection keeps {asked}" if bound == math.inf
                                  else f"the solver found no selection that keeps {asked} in time")
    return _result(best, proven, max(bound, lp_bound), started, stopped_by)


def _with_tied(egraph: EGraph, selection: Selection, solved: Sequence[int], ties: Ties) -> Selection:
    """`selection` (the roots' reach of `solved`) with each tied node CP-SAT chose that nothing reached reads, and
    what it reads, as `solved` chooses them, priced: a folded graph's copy 0 output in a layout only copy 2 would
    read is tied to its twin in copy 1 (Layered.twins), and the tie holds only where both stay chosen. Added
    children first, each class once, so no cycle; one whose reads `solved` leaves open is not added."""
    choice = dict(selection.choice)
    chosen = {n for n in solved if n >= 0}
    stack = [(c, False) for c in sorted({egraph.node_class[n] for n in tied_nodes(ties) if n in chosen})]
    seen: set[int] = set()
    while stack:
        c, expanded = stack.pop()
        if c in choice:
            continue
        if expanded:
            if all(d in choice for d in egraph.child_sets[solved[c]]):
                choice[c] = solved[c]
        elif solved[c] >= 0 and c not in seen:
            seen.add(c)
            stack.append((c, True))
            stack.extend((d, False) for d in egraph.child_sets[solved[c]] if d not in choice)
    return replace(selection, choice=choice, dag_cost=dag_cost(egraph, choice))


def _undominated(egraph: EGraph, start: Selection, replacement: Mapping[int, int], started: float) -> Selection:
    """`start`'s choice on the nodes preprocessing kept (a dominator has a subset of the children: no cycle),
    priced over every class it names, reachable or not."""
    choice = [-1] * egraph.num_classes
    for c, n in start.choice.items():
        choice[c] = n
    kept = {c: n for c, n in enumerate(undominate(egraph, choice, replacement)) if n >= 0}
    return Selection(kept, dag_cost(egraph, kept), "ilp", clock() - started)


def _result(best: Selection, proven: bool, bound: float, started: float, stopped_by: str | None = None) -> Selection:
    """The ILP's selection with its status, and a bound and gap that are honest: the bound clamped to [0, cost];
    `stopped_by` is the budget that ended CP-SAT unproven ("work" or "wall clock"), if one did."""
    bound = best.dag_cost if proven else min(max(bound, 0.0), best.dag_cost)
    return Selection(
        choice=best.choice,
        dag_cost=best.dag_cost,
        extractor="ilp",
        seconds=clock() - started,
        status="optimal" if proven else "feasible",
        bound=bound,
        gap=0.0 if proven or best.dag_cost == 0 else (best.dag_cost - bound) / best.dag_cost,
        stopped_by=None if proven else stopped_by,
    )


def _solve(
    egraph: EGraph, reduced: Reduced, warm: Selection, admissible: bool, seconds: float,
    budget: DeviceBudget | None, ties: Ties = (), cuts: Sequence[PathCut] = (),
) -> tuple[list[int] | None, float, bool, str | None]:
    """Solve each independent part on its own, hinted with `warm`: (choice per class, objective bound, optimal,
    the budget that stopped a part unproven: "work", "wall clock" where that fired, or None).

    CP-SAT's budget is WORK_PER_SECOND * `seconds` of deterministic time (a count of its work), so what it
    finds does not depend on the machine's load; building each part's model gets its share (by classes) of
    `seconds` of CPU (CP-SAT's own threads spend CPU too, so it is not what is left), and the wall-clock stop, for
    all parts together, is WALL_SAFETY * `seconds` + WALL_FLOOR. Parts are solved smallest first; each gets what is
    left of the work in proportion to its share of the remaining classes, so what a small part does not need
    passes on.
    A part CP-SAT finds no solution for in time keeps the warm start's choice (bound 0)
    if the warm start is `admissible` (keeps the budget and ties), else nothing is solved.
    """
    scale = SCALE / max(warm.dag_cost, MIN_COST)
    required, parts = _parts(egraph, reduced, ties)
    if budget is not None:
        parts = [sorted(reduced.candidates)]  # the budget couples every class
    solved = [-1] * egraph.num_classes
    bound, optimal = 0.0, True
    for c in required.difference(*parts):  # forced: a required class with one candidate, in no part
        solved[c] = reduced.candidates[c][0]
        bound += egraph.node_cost[solved[c]]
    position = {c: i for i, c in enumerate(children_first(egraph, warm.choice))}
    left = total = sum(map(len, parts))
    work, wall = WORK_PER_SECOND * seconds, time.perf_counter() + WALL_SAFETY * seconds + WALL_FLOOR
    stops = set()
    for part in parts:
        share = len(part) / left
        left -= len(part)
        choice, part_bound, part_optimal, used, stop = _solve_part(
            egraph, reduced, part, required, (warm.choice, position), scale, work * share,
            wall - time.perf_counter(), budget, ties,
            give_up=clock() + seconds * len(part) / total if admissible else math.inf, cuts=cuts,
            warm_admissible=admissible,
        )
        work = max(work - used, 0.0)
        stops.add(stop)
        if choice is None and (part_bound == math.inf or not admissible):
            return None, part_bound, False, None
        if choice is None:
            choice = {c: warm.choice[c] for c in part if c in warm.choice}
        for c, n in choice.items():
            solved[c] = n
        bound += part_bound
        optimal = optimal and part_optimal
    return solved, bound, optimal, next((s for s in STOPS if s in stops), None)


def _parts(egraph: EGraph, reduced: Reduced, ties: Ties = ()) -> tuple[set[int], list[list[int]]]:
    """Classes every selection needs, and the independent parts of the rest, smallest first.

    A root is required, and so is every child of a required class's only candidate.
    Fixing those, two classes share a constraint only through a node of one that
    has the other as a child when the child is not required, through an order
    constraint inside a cyclic component, or through a tie; parts are the connected
    classes (union-find). A class with a tied candidate is always in a part.
    """
    candidates, child_sets = reduced.candidates, egraph.child_sets
    required: set[int] = set()
    stack = list(egraph.roots)
    while stack:
        c = stack.pop()
        if c not in required:
            required.add(c)
            if len(candidates[c]) == 1:
                stack.extend(child_sets[candidates[c][0]])
    links: list[tuple[int, int]] = []
    for c, nodes in candidates.items():
        for n in nodes:
            for d in child_sets[n]:
                same_cycle = c in reduced.component and reduced.component.get(d) == reduced.component[c]
                if d not in required or same_cycle:
                    links.append((c, d))
    tied_classes = set()
    for a, b in ties:
        ca, cb = egraph.node_class[a], egraph.node_class[b]
        if ca in candidates and cb in candidates:
            links.append((ca, cb))
        tied_classes.update(c for c in (ca, cb) if c in candidates)
    groups = connected_groups(candidates, links)
    def free(c: int) -> bool:
        return c not in required or len(candidates[c]) > 1 or c in reduced.component or c in tied_classes

    parts = [group for group in groups if any(map(free, group))]
    return required, sorted(parts, key=len)


@dataclass(frozen=True)
class _Variables:
    """A part's CP-SAT variables, for the hint."""

    x: Mapping[int, cp_model.IntVar]  # per node
    active: Mapping[int, cp_model.IntVar]  # per class
    order: Mapping[int, cp_model.IntVar]  # per class in a cyclic component
    members: Mapping[int, list[int]]  # cyclic component -> its classes in the part
    used: Mapping[int, cp_model.IntVar]  # per block
    source: Mapping[int, cp_model.IntVar]  # per entry node of a cyclic block


def _solve_part(
    egraph: EGraph,
    reduced: Reduced,
    part: list[int],
    required: set[int],
    warm: tuple[Mapping[int, int], Mapping[int, int]],
    scale: float,
    work: float,
    wall: float,
    budget: DeviceBudget | None = None,
    ties: Ties = (),
    give_up: float = math.inf,
    cuts: Sequence[PathCut] = (),
    warm_admissible: bool = True,
) -> tuple[dict[int, int] | None, float, bool, float, str | None]:
    """One CP-SAT run over the classes of `part`: (chosen node per active class or None, bound, proven optimal,
    deterministic time used, what stopped it unproven: a `STOPS` name or None); the bound is inf when the budget
    or ties are proven infeasible, 0 when nothing is known.

    `warm` is the warm-start choice and its children-first position per class. CP-SAT stops after `work` units
    of deterministic time, or `wall` seconds of the wall clock, the safety net, whichever comes first.
    Building the model of a 100,000-node part takes seconds: past `give_up` (a `clock()` time) it is abandoned
    (None, 0.0, False), so the time limit holds.
    """
    try:
        model, variables, weights = _model(egraph, reduced, part, required, scale, budget, ties, give_up, cuts,
                                           warm_admissible)
    except _OutOfTime:
        return None, 0.0, False, 0.0, "cpu clock"
    if warm_admissible and all(warm[0][c] in variables.x for c in part if c in warm[0]):
        _ceiling(model, warm[0], part, variables, weights)
    else:  # CP-SAT must repair it: a selection that keeps the budget and ties can be dearer
        _hint(model, *warm, variables, egraph, reduced)
    solver = cp_model.CpSolver()
    wall = max(MIN_WORK, wall)
    solver.parameters.max_deterministic_time = max(MIN_WORK, work)
    solver.parameters.max_time_in_seconds = wall
    # one thread runs the subsolvers in turn (SEQUENTIAL), so no thread schedule decides what a worker sees
    solver.parameters.num_workers = SEQUENTIAL
    solver.parameters.subsolvers.extend(PORTFOLIO)
    solver.parameters.max_presolve_iterations = PRESOLVE_PASSES
    status = solver.solve(model)
    used = solver.response_proto.deterministic_time
    stop = None if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE) else \
        "wall clock" if solver.wall_time >= WALL_FIRED * wall else "work"
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, math.inf if status == cp_model.INFEASIBLE else 0.0, False, used, stop
    choice = {c: n for c in part for n in reduced.candidates[c] if solver.boolean_value(variables.x[n])}
    # Rounding up a cost can make any selection look dearer by at most `excess`; clamping only makes it cheaper,
    # so the bound holds, but a choice holding a clamped node is optimal only for the clamped costs
    excess = sum(max(0.0, w - egraph.node_cost[n] * scale) for n, w in weights.items())
    clamped = any(weights[n] < egraph.node_cost[n] * scale - 1 for n in choice.values())
    optimal = status == cp_model.OPTIMAL and not clamped
    return choice, max(0.0, solver.best_objective_bound - excess) / scale, optimal, used, stop


class _OutOfTime(Exception):
    """Building a model passed its time."""


def _model(
    egraph: EGraph,
    reduced: Reduced,
    part: list[int],
    required: set[int],
    scale: float,
    budget: DeviceBudget | None,
    ties: Ties,
    give_up: float,
    cuts: Sequence[PathCut] = (),
    warm_admissible: bool = True,
) -> tuple[cp_model.CpModel, _Variables, dict[int, int]]:
    """The CP-SAT model of one part (module docstring): the model, its variables, and each node's integer cost.
    Raises _OutOfTime past `give_up`. Costs are clamped so the objective cannot overflow int64: at twice the warm
    start where it keeps the budget and ties (a dearer node is in no better selection), else only at what int64
    leaves each node (the best admissible selection can be far dearer than a warm start that breaks a tie)."""

    def check_time() -> None:
        if clock() > give_up:
            raise _OutOfTime

    model = cp_model.CpModel()
    x = {n: model.new_bool_var("") for c in part for n in reduced.candidates[c]}
    active = {}
    for c in part:
        nodes = reduced.candidates[c]
        if len(nodes) == 1:
            active[c] = x[nodes[0]]
        else:
            active[c] = model.new_bool_var("")
            model.add(sum(x[n] for n in nodes) == active[c])
        if c in required:
            model.add(active[c] == 1)
    members: dict[int, list[int]] = {}
    for c in part:
        if c in reduced.component:
            members.setdefault(reduced.component[c], []).append(c)
    order = {c: model.new_int_var(0, len(group) - 1, "") for group in members.values() for c in group}
    check_time()
    for c in part:
        check_time()
        for n in reduced.candidates[c]:
            for d in egraph.child_sets[n]:
                if d in active:
                    model.add_implication(x[n], active[d])
                if c in order and reduced.component.get(d) == reduced.component[c]:
                    model.add(order[c] > order[d]).only_enforce_if(x[n])
    used, source = _sources(model, egraph, reduced, part, x, active, check_time)
    for cut in cuts:  # those of other parts name variables this part lacks
        terms = [x.get(n) for n in cut.nodes] + [source.get(n, x.get(n)) for n in cut.sources]
        if cut.reader in used and all(term is not None for term in terms):
            model.add(used[cut.reader] <= sum(terms))
    if budget is not None:
        _limit(model, budget, x)
    _tie(model, ties, x, {n for nodes in reduced.candidates.values() for n in nodes})
    cap = 2 * SCALE if warm_admissible else INT64_ROOM // max(1, len(x))
    weights = {n: min(round(egraph.node_cost[n] * scale), cap) for n in x}
    model.minimize(sum(weights[n] * var for n, var in x.items()))
    check_time()
    return model, _Variables(x, active, order, members, used, source), weights


def _sources(
    model: cp_model.CpModel,
    egraph: EGraph,
    reduced: Reduced,
    part: list[int],
    x: Mapping[int, cp_model.IntVar],
    active: Mapping[int, cp_model.IntVar],
    check_time: Callable[[], None],
) -> tuple[dict[int, cp_model.IntVar], dict[int, cp_model.IntVar]]:
    """The source constraints of the module docstring: (u per block, s per entry node of a cyclic block).

    A class alone is its own block: u is a_c, and every node is an entry, its own source.
    """
    block = {c: reduced.block(c) for c in active}
    blocks: dict[int, list[int]] = {}
    for c in part:
        blocks.setdefault(block[c], []).append(c)
    used: dict[int, cp_model.IntVar] = {}
    source: dict[int, cp_model.IntVar] = {}
    readers: dict[tuple[int, int], list[cp_model.IntVar]] = {}
    for b, classes in blocks.items():
        check_time()
        if len(classes) == 1:
            used[b] = active[classes[0]]
            entries = {n: x[n] for n in reduced.candidates[classes[0]]}
        else:
            used[b] = model.new_bool_var("")
            for c in classes:
                model.add_implication(active[c], used[b])
            model.add_bool_or([active[c] for c in classes]).only_enforce_if(used[b])
            entries = {
                n: model.new_bool_var("")
                for c in classes
                for n in reduced.candidates[c]
                if all(block.get(d) != b for d in egraph.child_sets[n])
            }
            for n, var in entries.items():
                model.add_implication(var, x[n])
                source[n] = var
            model.add(sum(entries.values()) == used[b])
        for n, var in entries.items():
            for read in {block[d] for d in egraph.child_sets[n] if d in block}:
                readers.setdefault((b, read), []).append(var)
    for (_, read), sources in readers.items():
        if len(sources) > 1:  # one source already implies its children's classes, hence their block
            model.add(sum(sources) <= used[read])
    for b, needed in reduced.needs.items():
        if b in used:
            for d in needed:
                if d in used:  # a block outside the part is required: always used
                    model.add_implication(used[b], used[d])
    return used, source


def _limit(model: cp_model.CpModel, budget: DeviceBudget, x: Mapping[int, cp_model.IntVar]) -> None:
    """The budget per device, in units of limit / 2^20 bytes, every term rounded down: a relaxation, so it
    never excludes a selection that meets the exact constraint."""
    unit = max(1, budget.limit >> 20)
    limit = budget.limit // unit
    devices = len(next(iter((*budget.resident.values(), *budget.transient.values())), ()))
    for d in range(devices):
        held = model.new_int_var(0, limit, f"held{d}")
        model.add(held == sum((budget.resident[n][d] // unit) * var for n, var in x.items() if n in budget.resident))
        for n, var in x.items():
            extra = budget.transient.get(n, (0,) * devices)[d] // unit
            if extra:
                model.add(held + extra * var <= limit)
    for group in budget.groups:  # rounded up, unlike the rest: the selection a group came from stays excluded
        model.add(sum(-(-b // unit) * x[n] for n, b in group.items() if n in x) <= limit)


def _tie(model: cp_model.CpModel, ties: Ties, x: Mapping[int, cp_model.IntVar], candidates: set[int]) -> None:
    """x_a = x_b for the pairs in this part; a node that is no candidate (unreachable, unselectable) is never
    chosen, so neither is its partner."""
    for a, b in ties:
        if a in x and b in x:
            model.add(x[a] == x[b])
        elif a in x and b not in candidates:
            model.add(x[a] == 0)
        elif b in x and a not in candidates:
            model.add(x[b] == 0)


def _ceiling(model: cp_model.CpModel, choice: Mapping[int, int], part: Sequence[int], variables: _Variables,
             weights: Mapping[int, int]) -> None:
    """The admissible warm start's cost on `part` as a ceiling on the objective, in place of a hint: every
    selection CP-SAT returns is then no dearer than it, and the warm start itself meets it. As a complete hint
    CP-SAT's one sequential search followed it: on Mixtral's 2-layer training step on 8 devices (15,468
    candidates, `benchmarks/cluster.py --models Mixtral --modes training --meshes 8`) a hinted run spent its 4.75
    units of work, 55 CPU s, and stopped 1.3% above the optimum that the same model, unhinted, proved in 6.5
    (docs/benchmarks.md, "CP-SAT's hint")."""
    nodes = list(variables.x)
    model.add(cp_model.LinearExpr.weighted_sum([variables.x[n] for n in nodes], [weights[n] for n in nodes])
              <= sum(weights[choice[c]] for c in part if c in choice))


def _hint(
    model: cp_model.CpModel,
    choice: Mapping[int, int],
    position: Mapping[int, int],
    variables: _Variables,
    egraph: EGraph,
    reduced: Reduced,
) -> None:
    """A complete hint: chosen nodes, active classes and blocks, order values from the children-first
    `position`, and as each used cyclic block's source its chosen entry node that comes first."""
    chosen = set(choice.values())
    hints: dict[int, int] = {}  # variable index -> value, written to the proto at once (add_hint is slow)

    def hint(var: cp_model.IntVar, value: int | bool) -> None:
        hints.setdefault(var.index, int(value))

    for n, var in variables.x.items():
        hint(var, n in chosen)
    for c, var in variables.active.items():
        hint(var, c in choice)
    for group in variables.members.values():
        for value, c in enumerate(sorted(group, key=lambda c: position.get(c, -1))):
            hint(variables.order[c], value)
        hint(variables.used[reduced.component[group[0]]], any(c in choice for c in group))
    first: dict[int, int] = {}
    for n in variables.source:
        c = egraph.node_class[n]
        if choice.get(c) == n:
            b = reduced.component[c]
            if b not in first or position.get(c, len(position)) < position.get(egraph.node_class[first[b]],
                                                                            len(position)):
                first[b] = n
    for n, var in variables.source.items():
        hint(var, first.get(reduced.component[egraph.node_class[n]]) == n)
    model.proto.solution_hint.vars.extend(list(hints))
    model.proto.solution_hint.values.extend(list(hints.values()))
