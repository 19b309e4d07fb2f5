"""The ILP's CP-SAT search (OR-tools), part by part: the model of `ilp.py`'s docstring (choice, activity, order,
source and need constraints, the LP pass's path cuts, a memory budget, ties), the warm start as a ceiling on the
objective or a hint, and the budget of each part: CP-SAT's deterministic time (WORK_PER_SECOND), the nodes a model
may take (counted against the extraction's `work.Meter`), the wall clock only as a safety net."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from tapestry.clock import SAFETY_NET_STOP
from tapestry.components import connected_groups
from tapestry.extract.constraints import DeviceBudget, Ties
from tapestry.extract.egraph import EGraph
from tapestry.extract.reduction import Reduced
from tapestry.extract.selection import Selection, children_first
from tapestry.extract.separation import PathCut
from tapestry.extract.work import Deadline

SCALE = 10**9  # the warm-start cost maps to this many integer units
INT64_ROOM = 2**62  # what an objective of int64 node costs may sum to, with room for CP-SAT's own arithmetic
# CP-SAT's subsolver: the full LP relaxation, which with the source constraints is what proves Tapestry's graphs.
# With one worker (SEQUENTIAL) CP-SAT runs the first subsolver named and no other (its log: "1 full problem
# subsolver: [max_lp]", no LNS), so naming "core" and "default_lp" after it, as before, changed nothing
# (tests/test_extract_cpsat.py). As 3 time-sliced workers they had proven a rover file (box_filter_3) that max_lp
# alone left unproven at 10 s (docs/extraction.md, "Workers").
PORTFOLIO = ("max_lp",)
# One presolve pass: repeating them took 4.4 s of a 10 s limit on a 12-layer stack on 8 devices (30,000 nodes),
# leaving the LP no time (gap 93%; one pass: 3.2%); tensat's graphs end as before (vgg proven in 11 s, was 8).
PRESOLVE_PASSES = 1
# CP-SAT runs its subsolvers on one thread, one after another, which makes its search deterministic. Several workers
# are deterministic only interleaved (`interleave_search`: batches synchronised in a fixed order), and so they
# proved 8-15x slower than one thread: the 4-layer stack on 8 devices (LP pass off) in 17.5 CPU s against 1.99, a
# 40-value `layered` graph in 7.8 against 0.20 (the old unsynchronised 3 workers: 0.50).
SEQUENTIAL = 1
# CP-SAT's budget is deterministic time, its own count of work done (in units meant to be about a second of one
# core), never the wall: with a wall-clock limit the same call found other plans under load (issues 24 and 25:
# a 10 s limit gave CP-SAT 2 CPU s at a load of 5 on this 2-core machine, and its plan came from the warm start).
# This many units per second of time limit, calibrated to spend about a quiet run's wall seconds on one core: the
# sequential search did 0.56 units per CPU second on a 4-layer stack on 8 devices (10,136 nodes, LP pass off,
# proven in 1.99 CPU s) and 0.34-0.39 on `layered` test graphs (docs/extraction.md, "Deterministic budgets").
WORK_PER_SECOND = 0.5
# Presolve's search for big linear rows overlapping at-most-ones (`find_big_linear_overlap`), off: the warm
# start's ceiling is one linear row over every objective term, and on Mixtral's training step on 8 devices
# (`benchmarks/cluster.py --models Mixtral --modes training --meshes 8`) the search over it spent 1.7-1.9 units of
# each fit's 2.7-3.5, half or more of the run's deterministic time, and changed nothing: off, each of the four fits'
# CP-SAT runs returned the same solution, variable for variable (docs/benchmarks.md, "Presolve's overlap search").
FIND_BIG_LINEAR_OVERLAP = False
MIN_WORK = 0.01  # the least deterministic time (and wall seconds) a CP-SAT run is given
# The wall-clock stop is a safety net only, this many times CP-SAT's share of the limit (plus WALL_FLOOR): at a
# load of 10 on this 2-core machine CP-SAT's 3 workers got 0.2 of a core together, a tenth of their quiet share, and
# a 10x stop fired. Where it fires, the result depends on the load, and says so (`Selection.stopped_by`).
WALL_SAFETY = 30.0
WALL_FLOOR = 10.0  # seconds the wall-clock stop adds to that, for short limits (presolve alone takes seconds loaded)
WALL_FIRED = 0.99  # share of its wall limit a run must have taken to count as stopped by it
# What can stop the search before a proof, the least reproducible first: `Selection.stopped_by`.
STOPS = (SAFETY_NET_STOP, "nodes", "work")
MIN_COST = 1e-12  # floor for the scale denominator: subnormal costs must not make it infinite
# A CP-SAT run under the warm start's ceiling that found nothing but the warm start (each part found no selection
# within its work, or the warm start's choice on it) is kept (per graph costs and structure, `_Search`), and a later
# run of the same reduced graph, cuts, ties and work whose every constraint is as tight or tighter (a ceiling no
# higher, within CEILING_TOLERANCE; the same memory budget's rows at a limit no higher, with every cut group of the
# earlier; or any budget where the earlier had none) is not made: it keeps the warm start, as the earlier did,
# charged the work that one used. NOT exact: the tighter model is another model (under a budget one part, where
# without it the classes split into parts solved one by one), and CP-SAT could find a selection in it that it did
# not in the looser one (no proof stands behind "found nothing"). What it rests on: on the 70B layer's leaner plans
# on 8x8 (`plan_pipeline`'s S = 8, docs/benchmarks.md "70B on 512 GPUs (8x8x8) at 4M tokens per step") each of the
# 8 budgeted runs found nothing within its work (bound 0: not even the root LP) and the 2 unbudgeted ones nothing
# but their warm start, each ran 7-13 CPU s, and 4 of the 8 were such tighter runs. False makes every run.
SKIP_TIGHTER = True
CEILING_TOLERANCE = 1e-9  # the ceiling is a row of about SCALE integer units: closer than one unit, the same row


def solve_parts(
    egraph: EGraph, reduced: Reduced, warm: Selection, admissible: bool, seconds: float, nodes_per_second: float,
    deadline: Deadline, budget: DeviceBudget | None, ties: Ties = (), cuts: Sequence[PathCut] = (),
) -> tuple[list[int] | None, float, bool, str | None]:
    """Solve each independent part on its own, from `warm`: (choice per class, objective bound, optimal, what
    stopped a part unproven: "work" (CP-SAT's), "nodes" (a part past the nodes left to model), SAFETY_NET_STOP,
    or None).

    CP-SAT's budget is WORK_PER_SECOND * `seconds` of deterministic time (a count of its work), so what it
    finds does not depend on the machine's load. Parts are solved smallest first; each gets what is left of the
    work in proportion to its share of the remaining classes, so what a small part does not need passes on. Models
    take `nodes_per_second` * `seconds` candidates in all, counted: a part past what is left of them is not
    modelled where the warm start is `admissible` (it keeps its choice), and a small part always is (by CPU-second
    shares, a 2-class part could be dropped, and the whole selection reported "feasible"). Both are charged to
    `deadline`'s meter; building a model stops at its safety net, and CP-SAT at the wall clock's, WALL_SAFETY *
    `seconds` + WALL_FLOOR for all parts together.
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
    left = sum(map(len, parts))
    work, wall = WORK_PER_SECOND * seconds, time.perf_counter() + WALL_SAFETY * seconds + WALL_FLOOR
    stops = set()
    model_nodes = nodes_per_second * seconds
    searched: list[_Search] = egraph.by_costs(("searched",), lambda _: [])  # runs that found nothing (SKIP_TIGHTER)
    search = _Search(tuple(sorted(reduced.candidates)), warm.dag_cost, budget, tuple(map(tuple, ties)),
                     tuple(cuts), work) if admissible and all(
        warm.choice[c] in reduced.candidates[c] for c in reduced.candidates if c in warm.choice) else None
    looser = None if search is None or not SKIP_TIGHTER else next((s for s in searched if s.covers(search)), None)
    if looser is not None:  # a looser run found nothing: this one is not made, and keeps the warm start as it did
        deadline.meter.charge(sum(len(reduced.candidates[c]) for part in parts for c in part) / nodes_per_second
                              + looser.used / WORK_PER_SECOND)
        for c in (c for part in parts for c in part if c in warm.choice):
            solved[c] = warm.choice[c]
        return solved, bound, False, "work"
    spent, nothing = 0.0, search is not None  # every part found nothing within its work, or only the warm start
    for part in parts:
        share = len(part) / left
        left -= len(part)
        nodes = sum(len(reduced.candidates[c]) for c in part)
        if admissible and nodes > model_nodes:
            choice, part_bound, part_optimal, used, stop = None, 0.0, False, 0.0, "nodes"
        else:
            model_nodes -= nodes
            deadline.meter.charge(nodes / nodes_per_second)
            choice, part_bound, part_optimal, used, stop = _solve_part(
                egraph, reduced, part, required, (warm.choice, position), scale, work * share,
                wall - time.perf_counter(), deadline, budget, ties, cuts, admissible)
            deadline.meter.charge(used / WORK_PER_SECOND)
        if stop == SAFETY_NET_STOP:
            deadline.meter.fired = True
        kept = {c: warm.choice[c] for c in part if c in warm.choice}  # the warm start's choice on the part
        nothing = nothing and (choice == kept or choice is None and part_bound == 0.0 and stop == "work")
        spent += used
        work = max(work - used, 0.0)
        stops.add(stop)
        if choice is None and (part_bound == math.inf or not admissible):
            return None, part_bound, False, None
        for c, n in (kept if choice is None else choice).items():
            solved[c] = n
        bound += part_bound
        optimal = optimal and part_optimal
    if nothing:
        searched.append(replace(search, used=spent))
    return solved, bound, optimal, next((s for s in STOPS if s in stops), None)


@dataclass(frozen=True)
class _Search:
    """A CP-SAT run (all its parts) under the warm start's ceiling, and the work it used (SKIP_TIGHTER)."""

    classes: tuple[int, ...]  # the reduced graph's candidate classes
    ceiling: float  # the warm start's cost
    budget: DeviceBudget | None
    ties: tuple[tuple[int, ...], ...]
    cuts: tuple[PathCut, ...]
    work: float
    used: float = 0.0

    def covers(self, tighter: _Search) -> bool:
        """Whether `tighter` is this run's model with constraints as tight or tighter: every selection it admits,
        this one admitted."""
        return (self.classes == tighter.classes and self.work == tighter.work and self.ties == tighter.ties
                and tighter.ceiling <= self.ceiling * (1 + CEILING_TOLERANCE) and self.cuts == tighter.cuts
                and _within(tighter.budget, self.budget))


def _within(tight: DeviceBudget | None, loose: DeviceBudget | None) -> bool:
    """Whether every selection `tight` admits, `loose` admits: no budget admits all; else the same rows at a limit
    no higher, with every cut group of the looser one."""
    if loose is None:
        return True
    return tight is not None and tight.resident is loose.resident and tight.transient is loose.transient and \
        tight.limit <= loose.limit and all(group in tight.groups for group in loose.groups)


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
    deadline: Deadline,
    budget: DeviceBudget | None = None,
    ties: Ties = (),
    cuts: Sequence[PathCut] = (),
    warm_admissible: bool = True,
) -> tuple[dict[int, int] | None, float, bool, float, str | None]:
    """One CP-SAT run over the classes of `part`: (chosen node per active class or None, bound, proven optimal,
    deterministic time used, what stopped it unproven: a `STOPS` name or None); the bound is inf when the budget
    or ties are proven infeasible, 0 when nothing is known.

    `warm` is the warm-start choice and its children-first position per class. CP-SAT stops after `work` units
    of deterministic time, or `wall` seconds of the wall clock, the safety net, whichever comes first.
    Building the model stops at `deadline`'s safety net (None, 0.0, False).
    """
    try:
        model, variables, weights = _model(egraph, reduced, part, required, scale, budget, ties, deadline, cuts,
                                           warm_admissible)
    except _OutOfTime:
        return None, 0.0, False, 0.0, SAFETY_NET_STOP
    if warm_admissible and all(warm[0][c] in variables.x for c in part if c in warm[0]):
        _ceiling(model, warm[0], part, variables, weights)
    else:  # CP-SAT must repair it: a selection that keeps the budget and ties can be dearer
        _hint(model, *warm, variables, egraph, reduced)
    solver = cp_model.CpSolver()
    wall = max(MIN_WORK, wall)
    solver.parameters.max_deterministic_time = max(MIN_WORK, work)
    solver.parameters.max_time_in_seconds = wall
    # one thread (SEQUENTIAL), so no thread schedule decides what the search sees
    solver.parameters.num_workers = SEQUENTIAL
    solver.parameters.subsolvers.extend(PORTFOLIO)
    solver.parameters.max_presolve_iterations = PRESOLVE_PASSES
    solver.parameters.find_big_linear_overlap = FIND_BIG_LINEAR_OVERLAP
    status = solver.solve(model)
    used = solver.response_proto.deterministic_time
    stop = None if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE) else \
        SAFETY_NET_STOP if solver.wall_time >= WALL_FIRED * wall else "work"
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
    """Building a model passed its safety net."""


def _model(
    egraph: EGraph,
    reduced: Reduced,
    part: list[int],
    required: set[int],
    scale: float,
    budget: DeviceBudget | None,
    ties: Ties,
    deadline: Deadline,
    cuts: Sequence[PathCut] = (),
    warm_admissible: bool = True,
) -> tuple[cp_model.CpModel, _Variables, dict[int, int]]:
    """The CP-SAT model of one part (module docstring): the model, its variables, and each node's integer cost.
    Raises _OutOfTime past `deadline`'s safety net. Costs are clamped so the objective cannot overflow int64: at
    twice the warm start where it keeps the budget and ties (a dearer node is in no better selection), else only
    at what int64 leaves each node (the best admissible selection can be far dearer than a warm start that breaks a
    tie)."""

    def check_time() -> None:
        if deadline.safety():
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
