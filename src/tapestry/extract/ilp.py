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
so HiGHS's tolerances cannot lift it; the larger is taken. `Selection.gap` = (cost - bound) / cost is in [0, 1],
or None with the bound where no phase bounded the search (`_result`).

With a `DeviceBudget`, per device d: sum of resident_n[d] x_n over all nodes,
plus transient_m[d] for any chosen m, stays within the limit; and for each of its
`groups` (bytes per node), sum of bytes_n x_n stays within it too. The whole problem
is then one part (the budget couples every class), and the greedy start counts
only if it fits.

Budgets (docs/extraction.md, "Deterministic budgets"): the time limit is seconds of counted work (`work.Meter`):
the warm start's local search stops on its tries, the LP pass on HiGHS's simplex iterations and its path and flow
graphs' entries, building the CP-SAT models on their candidates, CP-SAT on its own deterministic time (one thread,
`cpsat.py`), each phase at its share of the limit, so the same call gives the same selection at any load. The CPU
clock (and CP-SAT's and HiGHS's own, the wall) is a safety net many times longer, reported where it fires. Counted
work makes the phases before the budget and start matter (the warm start, the preprocessing, the contracted bound)
the same in every call on a graph at the same costs: a memory budget's cut rounds and a pipeline layer's leaner
plans call the ILP on the graphs its fastest plan's calls solved, and take them as made (`_metered`).

With `ties` (pairs of nodes chosen together or not at all: a training step's
placed weight and its delivered update, so the step repeats), x_a = x_b. Tied
nodes neither dominate nor are dominated, tied classes share a part, and the
greedy start counts only if it keeps every tie.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from typing import Any, TypeVar

from tapestry.clock import clock
from tapestry.extract.constraints import DeviceBudget, Ties, tied_nodes, ties_hold
from tapestry.extract.contract import contracted_bound
from tapestry.extract.cpsat import solve_parts
from tapestry.extract.egraph import EGraph, NoFiniteChoiceError
from tapestry.extract.greedy_dag import improve
from tapestry.extract.periodic import Repeated
from tapestry.extract.reduction import Reduced, reduce
from tapestry.extract.relax import PROVEN, Diverged, LpPass, Relaxation
from tapestry.extract.relax import relax as relax_once
from tapestry.extract.selection import Selection, dag_cost, finalize
from tapestry.extract.tied import tied_search
from tapestry.extract.tree import TreeChoice, solvable_tree
from tapestry.extract.warm import undominate, warm_start
from tapestry.extract.work import Deadline, Meter

T = TypeVar("T")

__all__ = ["DeviceBudget", "Ties", "extract_ilp", "models_in", "tied_nodes", "ties_hold"]

RESERVE = 0.05  # share of the time limit kept for CP-SAT stopping its workers (0.5 s seen under load) and read-back
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


def models_in(egraph: EGraph, time_limit: float) -> bool:
    """Whether `time_limit` leaves the ILP time to model `egraph` (MODEL_NODES_PER_SECOND) before any warm start:
    past it, `extract_ilp` returns a warm start, its own local search's or the caller's."""
    return egraph.num_nodes <= MODEL_NODES_PER_SECOND * (1 - RESERVE) * time_limit


def extract_ilp(egraph: EGraph, time_limit: float = 60.0, budget: DeviceBudget | None = None, ties: Ties = (),
                repeated: Repeated | None = None, stop_gap: float | None = None,
                start: Selection | None = None) -> Selection:
    """Best selection CP-SAT finds within `time_limit`; never worse than the greedy warm start. The limit is a
    budget of counted work, not a clock: each phase stops at its share of it in its own count (`work.Meter`: tries,
    simplex iterations, graph entries, model nodes, CP-SAT's WORK_PER_SECOND units of deterministic time), so the
    selection does not depend on the machine's load (`Selection.stopped_by` says which budget ended an unproven
    search, or that the clock's safety net stopped a phase). A
    selection within `stop_gap` of the LP bound is returned as it is ("feasible" with that gap); by default
    `stop_gap` is STOP_GAP, or LARGE_STOP_GAP on a graph of more than CONTRACT_FROM candidates.
    Under `budget` and `ties`, the best that satisfies them; NoFiniteChoiceError if none does.
    CP-SAT runs the `cpsat.PORTFOLIO` subsolver. With `repeated` (and no budget or ties), the best periodic selection
    (`periodic.py`, solved in `warm.PERIODIC_SHARE` of the limit) is a second warm start, kept if it is cheaper.
    A caller's `start` (a choice that may name classes nothing reachable reads, as a tie can ask) is one too,
    where it keeps the budget and ties: greedy-dag's start rarely keeps ties, and without an admissible start the
    LP pass's rounding and CP-SAT must find one alone.
    """
    return _extract(egraph, Meter(time_limit), budget, ties, repeated, stop_gap, start)


def _extract(egraph: EGraph, meter: Meter, budget: DeviceBudget | None, ties: Ties, repeated: Repeated | None,
             stop_gap: float | None, start: Selection | None) -> Selection:
    """`extract_ilp` with its work counted on `meter` (a fold's extraction on one of its own, `Meter.within`)."""
    time_limit, started = meter.limit, meter.started
    deadline = meter.until((1 - RESERVE) * time_limit)
    tree = solvable_tree(egraph)
    folding = repeated if budget is None and not ties else None
    greedy, folded = warm_start(  # the LP pass's window moves on by the work the fold took
        egraph, tree, meter, folding, lambda graph, seconds, fold_ties: meter.within(
            seconds, lambda inner: _extract(graph, inner, None, fold_ties, None, None, None)),
        MODEL_NODES_PER_SECOND) if folding is not None else _metered(
        egraph, ("warm", meter.limit, meter.spent), meter, lambda: warm_start(
            egraph, tree, meter, None, lambda *_: None, MODEL_NODES_PER_SECOND))
    greedy = list(greedy)

    def admissible(selection: Selection) -> bool:
        return (budget is None or budget.fits(selection.choice)) and ties_hold(selection.choice, ties)

    if egraph.num_nodes > MODEL_NODES_PER_SECOND * deadline.left():
        # No work left to reduce the graph and model it: the warm start, its local search given the work left (cut
        # at WARM_SHARE, it could end dearer than greedy-dag's), or the caller's start where it is cheaper, unproven.
        given = None if start is None else _undominated(egraph, start, {}, started)  # priced on this graph
        if ties and budget is None:
            # the local search keeps no tie, and CP-SAT would get what modelling left: on the folded 7B training
            # step on 8x8 (`benchmarks/cluster.py --arch hf --models 7B --layers 32 --meshes 8x8`) it found no tied
            # selection in it; the tied search (`tied.py`) improves the start and the free choice's pinned pairs
            found = tied_search(egraph, tree, greedy, given, ties, deadline, started)
            if found is not None:
                return _result(found, False, None, meter, "nodes")
            raise NoFiniteChoiceError(f"no time to model {egraph.num_nodes:,} nodes, and no tied selection was "
                                      f"found without it")
        if deadline.left() > 0:  # setting the search up alone takes seconds on millions of nodes
            greedy = improve(egraph, greedy, tree, deadline)
        unsolved = finalize(egraph, greedy, tree, "ilp", started)
        if given is not None and admissible(given) and (not admissible(unsolved) or given.dag_cost < unsolved.dag_cost):
            unsolved = given
        if admissible(unsolved):
            return _result(unsolved, False, None, meter, "nodes")
    frozen = tied_nodes(ties)
    reduced, block = egraph.by_costs(("reduced", frozen), lambda g: reduced_blocks(g, tree, frozen))
    warm = finalize(egraph, undominate(egraph, greedy, reduced.replacement), tree, "ilp", started)
    best = warm if admissible(warm) else None
    if start is not None:
        given = _undominated(egraph, start, reduced.replacement, started)
        if admissible(given) and (best is None or given.dag_cost < best.dag_cost):
            best = warm = given
    proven, bound, lp_bound, cuts = best is not None and best.dag_cost == 0, 0.0, 0.0, ()

    def offer(choice: list[int]) -> float:
        """An LP solution rounded: made a selection, and that improved by greedy-dag's local search with the tied
        nodes frozen (none joins or leaves), where the rounding keeps every tie; the cheapest admissible of them is
        kept if it is the best yet. A rounding that breaks a tie is not improved: the search would keep it broken
        (on Mixtral's training step on 8 devices every rounding broke one, and improving them took ~40% of the LP
        pass; docs/benchmarks.md, "The tied LP pass improves no broken tie")."""
        nonlocal best, warm
        choice = undominate(egraph, choice, reduced.replacement)
        rounded = finalize(egraph, choice, tree, "ilp", started)
        candidates = [rounded]
        if ties_hold(rounded.choice, ties):
            # classes the selection leaves out keep the LP's choice, so a move that brings them in is priced by it
            full = [rounded.choice.get(c, n if n >= 0 else t) for c, (n, t) in enumerate(zip(choice, tree.node))]
            candidates.append(finalize(egraph, undominate(egraph, improve(egraph, full, tree, relax_deadline, frozen),
                                                          reduced.replacement), tree, "ilp", started))
        for candidate in candidates:
            if admissible(candidate) and (best is None or candidate.dag_cost < best.dag_cost):
                best = warm = candidate
        return math.inf if best is None else best.dag_cost

    relax_deadline = meter.until(min(RELAX_SHARE * time_limit + folded, deadline.end))
    size = sum(map(len, reduced.candidates.values()))
    if stop_gap is None:
        stop_gap = LARGE_STOP_GAP if size > CONTRACT_FROM else STOP_GAP

    def close(share: float) -> bool:
        return best is not None and best.dag_cost <= lp_bound + share * best.dag_cost

    if not proven and size > CONTRACT_FROM and stop_gap > 0:  # else the full LP's bound is the one asked for
        lp_bound = _metered(egraph, ("contracted", frozen, relax_deadline.end, meter.spent), meter, lambda: (
            contracted_bound(egraph, reduced.candidates, block, reduced.needs, relax_deadline).bound))
        proven = close(PROVEN)
    if not proven and not close(stop_gap) and size <= LP_NODES_PER_SECOND * relax_deadline.left():
        # read rows only where a stop gap is asked: below CONTRACT_FROM the path cuts prove the 1-D meshes' zoo
        # models as they are, and after read rows Mixtral's on Mesh(4) stalled 1.4e-6 short of its proof
        relaxation = relax(egraph, reduced.candidates, block, reduced.needs, relax_deadline, ties, offer,
                           max(stop_gap, PROVEN), reads=stop_gap > 0)
        lp_bound, cuts = max(lp_bound, relaxation.bound), relaxation.cuts
        proven = close(PROVEN)
    stopped_by = None
    if not proven and not close(stop_gap) and (deadline.left() > 0 or best is None):
        seconds = (1 - RESERVE) * time_limit
        solved, bound, optimal, stopped_by = solve_parts(egraph, reduced, warm, best is not None, seconds,
                                                         MODEL_NODES_PER_SECOND, deadline, budget, ties, cuts)
        if solved is not None:
            candidate = _with_tied(egraph, finalize(egraph, solved, tree, "ilp", started), solved, ties)
            better = admissible(candidate) and (best is None or candidate.dag_cost <= best.dag_cost)
            proven = optimal and better
            best = candidate if better else best
    if best is None:
        asked = "the ties" if budget is None else f"the budget of {budget.limit:,} per device"
        raise NoFiniteChoiceError(f"no selection keeps {asked}" if bound == math.inf
                                  else f"the solver found no selection that keeps {asked} in time")
    return _result(best, proven, max(bound, lp_bound), meter, stopped_by)


def _metered(egraph: EGraph, key: tuple[Any, ...], meter: Meter, make: Callable[[], T]) -> T:
    """`make()`, made once per `key` on graphs of these costs and structure (`EGraph.by_costs`), and where it was made
    before, the work it charged then charged to `meter` again: `key` names the point of the limit's work it starts at,
    and work is counted, not timed (`work.Meter`), so made again it would do the same work and return the same, and
    the rest of the call goes on as if it had been. Where the safety net stopped it, each use says so (`fired`)."""
    ran = []

    def made(_: EGraph) -> tuple[T, float, bool]:
        ran.append(True)
        spent, fired = meter.spent, meter.fired
        value = make()
        return value, meter.spent - spent, meter.fired and not fired

    value, charged, fired = egraph.by_costs(key, made)
    if not ran:
        meter.charge(charged)
        meter.fired = meter.fired or fired
    return value


def relax(egraph: EGraph, candidates: Mapping[int, Sequence[int]], block: Mapping[int, int],
          needs: Mapping[int, Sequence[int]], deadline: Deadline, ties: Ties = (),
          offer: Callable[[list[int]], float] = lambda _: math.inf, enough: float = PROVEN,
          reads: bool = False) -> Relaxation:
    """`relax.relax` of the ILP's reduced graph (`reduced_blocks`: `candidates`, `block` and `needs` are its, made once
    per graph costs, structure and ties), its LP pass (`relax.LpPass`) made once per graph costs and structure, ties,
    and the work it begins and ends at, and replayed after: exact, as a pass's steps depend on none of the budget, the
    start or the incumbent, only where a run stops does. Where the safety net stopped a step (then what it made depends
    on the load) or a replay diverged (only so), the pass is run on its own."""
    key = ("relax", tuple(map(tuple, ties)), deadline.end, deadline.meter.spent, enough, reads)
    made = egraph.by_costs(key, lambda g: LpPass(g, candidates, block, needs, ties, enough, reads))
    if not made.fired:
        with suppress(Diverged):
            return made.run(deadline, offer)
    return relax_once(egraph, candidates, block, needs, deadline, ties, offer, enough, reads)


def reduced_blocks(egraph: EGraph, tree: TreeChoice, tied: frozenset[int] = frozenset()
                   ) -> tuple[Reduced, dict[int, int]]:
    """`reduce`'s result and each candidate class's block: what the ILP's preprocessing makes of a graph, whatever
    its budget or start."""
    reduced = reduce(egraph, tree, tied)
    return reduced, {c: reduced.block(c) for c in reduced.candidates}


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


def _result(best: Selection, proven: bool, bound: float | None, meter: Meter, stopped_by: str | None = None
            ) -> Selection:
    """The ILP's selection with its status, and a bound and gap that are honest: the bound clamped to [0, cost],
    and none (bound and gap None, not a gap of 100%) where no phase bounded the search (`bound` None: the "nodes"
    stop, no work left to model the graph; or 0 for a selection that costs more: CP-SAT stopped before its first
    bound and no LP ran; the 2-layer 7B training step on 2x4 of docs/benchmarks.md "Cluster" stopped so, its gap
    read 100%); `stopped_by` is the budget that ended the search unproven ("work": CP-SAT's; "nodes": no work left
    to model the graph or a part), if one did, or SAFETY_NET_STOP wherever the clock's safety net stopped a phase,
    proven or not (then the selection may depend on the load)."""
    if proven or best.dag_cost == 0:
        bound, gap = best.dag_cost, 0.0
    elif bound is None or bound <= 0:
        bound, gap = None, None
    else:
        bound = min(bound, best.dag_cost)
        gap = (best.dag_cost - bound) / best.dag_cost
    return Selection(
        choice=best.choice,
        dag_cost=best.dag_cost,
        extractor="ilp",
        seconds=clock() - meter.started,
        status="optimal" if proven else "feasible",
        bound=bound,
        gap=gap,
        stopped_by=meter.stop or (None if proven else stopped_by),
    )
