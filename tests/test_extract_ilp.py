"""The ILP on e-graphs shaped like Tapestry's (each value a cycle of layouts joined by reshards): its gap is
honest at any time limit, it is never worse than greedy-dag, and the source constraints let it prove optimality."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from extract_helpers import build, layered
from tapestry.clock import SAFETY_NET_STOP, clock
from tapestry.extract import EGraph, Node, extract, validate
from tapestry.extract import ilp
from tapestry.extract import work
from tapestry.extract.constraints import DeviceBudget
from tapestry.extract.ilp import extract_ilp
from tapestry.extract.relax import Relaxation
from tapestry.extract.warm import WARM_SHARE
from tapestry.models import mlp
from tapestry.optimizer import default_cost_model, explore
from tapestry.sharding import Mesh


def assert_honest(egraph: EGraph, time_limit: float, optimum: float) -> None:
    selection = extract(egraph, "ilp", time_limit)
    assert validate(egraph, selection) == []
    assert selection.bound is not None and selection.gap is not None
    assert 0 <= selection.bound <= optimum + 1e-9 * optimum <= selection.dag_cost + 2e-9 * optimum
    assert 0 <= selection.gap <= 1
    assert selection.gap == pytest.approx((selection.dag_cost - selection.bound) / selection.dag_cost)


def stretch_cpu_clock(monkeypatch: pytest.MonkeyPatch, times: float) -> None:
    """The CPU clock run `times` fast, as a loaded machine's CPU seconds stretch, with the safety net (the only
    phase stop the clock is meant to make, and then marked) moved far off: what is left to depend on the clock
    is what must not. With the net left in place a slow CI machine's first ILP call (its solvers' set-up counted)
    passed it, and a 2-class part's test read "feasible"."""
    real = time.process_time
    monkeypatch.setattr(time, "process_time", lambda: times * real())
    monkeypatch.setattr(work, "SAFETY_FLOOR", 3600.0)


def test_the_gap_is_in_0_1_and_the_bound_below_the_optimum_whenever_the_solver_stops() -> None:
    # CP-SAT's bound right after presolve can be negative (the presolved objective has negative terms); stopped
    # there, the gap was reported as 4.9 on this graph.
    egraph = layered(12, 8, seed=0)
    optimum = extract(egraph, "ilp", 30).dag_cost
    for time_limit in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5):
        assert_honest(egraph, time_limit, optimum)


@pytest.mark.parametrize("seed", range(4))
def test_the_ilp_proves_a_layered_graph_optimal_and_beats_greedy_dag(seed: int) -> None:
    # Without the source constraints CP-SAT's bound stayed under 3% of the cost for 10 s on these graphs.
    egraph = layered(12, 8, seed)
    ilp = extract_ilp(egraph, time_limit=20, stop_gap=0)  # proven, not stopped within STOP_GAP of the bound
    assert ilp.status == "optimal" and ilp.gap == 0
    assert ilp.dag_cost <= extract(egraph, "greedy-dag").dag_cost


@pytest.mark.parametrize("time_limit", [0.001, 0.01, 1.0])
def test_the_ilp_is_never_worse_than_greedy_dag_when_its_warm_start_has_time(time_limit: float) -> None:
    """Greedy-dag is the ILP's warm start, stopped at WARM_SHARE of the time limit (on a 2x2x2 mesh it alone
    outlasted a 10 s limit): with time for it, the ILP is never worse; with none, still valid."""
    for seed in range(3):
        egraph = layered(16, 8, seed)
        greedy = extract(egraph, "greedy-dag")
        ilp = extract(egraph, "ilp", time_limit)
        assert validate(egraph, greedy) == validate(egraph, ilp) == []
        if greedy.seconds < WARM_SHARE * time_limit / 10:  # ten times the time it needs
            assert ilp.dag_cost <= greedy.dag_cost


def test_the_ilp_proves_the_plan_of_a_two_layer_mlp_on_a_2x2_mesh_optimal() -> None:
    explored = explore(mlp(2, 512, 256), Mesh(2, 2))
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model())
    ilp = extract(egraph, "ilp", time_limit=10)
    assert ilp.status == "optimal"
    assert ilp.dag_cost <= extract(egraph, "greedy-dag").dag_cost


def test_the_time_limit_holds_when_the_warm_start_and_the_model_alone_would_take_longer() -> None:
    # 46,800 nodes: greedy-dag's local search alone took 18 s (now 1.6 s), and building the model takes seconds.
    # The limit is of CPU seconds (tapestry.clock), which a loaded machine stretches in wall time only.
    egraph = layered(300, 12, seed=0)
    started = clock()
    selection = extract(egraph, "ilp", time_limit=2)
    assert clock() - started < 8  # 2 s, and greedy-dag (about 3 s), which no limit cuts
    assert validate(egraph, selection) == []
    assert selection.stopped_by == "nodes" and selection.gap is None  # no work left to model it: nothing bounded


def test_the_ilp_finds_the_same_selection_however_fast_the_wall_clock_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CP-SAT's budget is its own count of work, never seconds of the wall (issues 24 and 25: a plan must not
    depend on the machine's load): with the wall clock running 30 times fast, as a loaded machine's runs on while
    the search waits for a core, the same selection comes back, stopped by the same work. CP-SAT alone (no LP
    pass), on a graph where it betters greedy-dag's start in its budget but proves nothing."""
    egraph = layered(60, 4, seed=1)  # 40 values at 0.1 are proven since the warm start is a ceiling, not a hint
    monkeypatch.setattr(ilp, "LP_NODES_PER_SECOND", 0)
    quiet = extract_ilp(egraph, 0.2)
    assert quiet.status == "feasible" and quiet.dag_cost < extract(egraph, "greedy-dag").dag_cost - 1e-9
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: 30 * real())
    loaded = extract_ilp(egraph, 0.2)
    assert loaded.choice == quiet.choice
    assert quiet.stopped_by == loaded.stopped_by == "work"


@pytest.mark.parametrize(("values", "layouts", "seed"), [(12, 8, 0), (40, 4, 1)])
def test_the_ilp_finds_the_same_selection_and_status_however_slow_the_cpu_clock_runs(
        values: int, layouts: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase stops on a count of its work (`work.Meter`), the CPU clock only a safety net: with the CPU clock
    running 5 times fast, as a loaded machine's CPU seconds stretch, the same selection and status come back. At
    0.1 s these graphs were proven optimal on a quiet clock and stopped "feasible" by CPU seconds on the fast one
    when the phases' shares were CPU seconds (the LP pass cut short, then the model)."""
    egraph = layered(values, layouts, seed)
    quiet = extract_ilp(egraph, 0.1)
    assert quiet.status == "optimal" and quiet.stopped_by is None
    stretch_cpu_clock(monkeypatch, 5)
    loaded = extract_ilp(egraph, 0.1)
    assert (loaded.choice, loaded.status, loaded.bound, loaded.stopped_by) == \
        (quiet.choice, quiet.status, quiet.bound, quiet.stopped_by)


def test_the_cpu_clock_stops_the_ilp_only_as_a_safety_net_and_the_selection_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Far past its counts (here a clock 10,000 times fast) a phase stops at the safety net, and the selection is
    marked: it may depend on the load."""
    egraph = layered(40, 4, seed=1)
    real = time.process_time
    monkeypatch.setattr(time, "process_time", lambda: 10_000 * real())
    selection = extract_ilp(egraph, 0.1)
    assert validate(egraph, selection) == [] and selection.stopped_by == SAFETY_NET_STOP


def test_a_part_of_two_classes_is_modelled_however_small_its_share_of_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Models take a count of candidates in all, parts smallest first, so a small part always gets its model: by
    CPU-second shares by classes, Mixtral's training step on 8 devices gave a 2-class part beside a 3,989-class
    one 4.7 ms of its 10 s, and under load it was dropped, the whole selection "feasible" (its gap 1.3e-6)."""
    big = layered(40, 4, seed=1)
    named = big.class_ids.__getitem__
    nodes = [Node(big.node_ids[n], big.node_ops[n], named(big.node_class[n]), big.node_cost[n],
                  tuple(map(named, big.node_children[n]))) for n in range(big.num_nodes)]
    nodes += [Node("s.0", "s0", "s", 1.0, ("t",)), Node("s.1", "s1", "s", 3.0, ()), Node("t.0", "t0", "t", 1.0, ())]
    egraph = EGraph.from_nodes(nodes, [*map(named, big.roots), "s"])
    stretch_cpu_clock(monkeypatch, 5)
    selection = extract_ilp(egraph, 0.1)
    assert (selection.status, selection.stopped_by) == ("optimal", None)
    assert selection.dag_cost == pytest.approx(extract_ilp(big, 0.1).dag_cost + 2.0)


def test_an_admissible_warm_start_bounds_cp_sat_without_steering_its_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start enters CP-SAT as a ceiling on its objective, not as a hint its one sequential search
    follows: hinted, CP-SAT alone (no LP pass) spent this graph's 0.1 s of work unproven (and Mixtral's training
    step on 8 devices 55 CPU s per fit, 1.3% above the optimum); with the ceiling it proves the optimum in it."""
    egraph = layered(40, 4, seed=1)
    monkeypatch.setattr(ilp, "LP_NODES_PER_SECOND", 0)
    optimum = extract_ilp(egraph, 20, stop_gap=0)
    selection = extract_ilp(egraph, 0.1)
    assert optimum.status == selection.status == "optimal" and selection.stopped_by is None
    assert selection.dag_cost == pytest.approx(optimum.dag_cost, rel=1e-9)


def test_a_start_cheaper_than_greedy_dags_comes_back_when_there_is_no_time_to_model() -> None:
    """A caller's start (the optimizer's hand plans) is never lost to a small limit: the ILP returns nothing
    dearer than it, even where it has no time to build a model and returns a warm start."""
    egraph = layered(40, 4, seed=1)
    start = extract_ilp(egraph, 1.0)
    assert start.dag_cost < extract(egraph, "greedy-dag").dag_cost - 1e-9
    tiny = extract_ilp(egraph, 1e-4, start=start)
    assert not validate(egraph, tiny) and tiny.dag_cost <= start.dag_cost + 1e-12 * start.dag_cost


@pytest.mark.parametrize("seed", range(2))
def test_a_selection_within_the_stop_gap_of_the_lp_bound_is_returned_without_cp_sat_its_gap_reported(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    egraph = layered(12, 8, seed)
    optimum = extract_ilp(egraph, 20, stop_gap=0).dag_cost

    def cp_sat(*args: object) -> None:
        raise AssertionError("CP-SAT ran although the selection was within the stop gap")

    monkeypatch.setattr(ilp, "solve_parts", cp_sat)
    selection = extract_ilp(egraph, 20, stop_gap=0.5)
    assert validate(egraph, selection) == []
    assert selection.bound is not None and selection.gap is not None
    assert selection.bound <= optimum + 1e-9 * optimum <= selection.dag_cost + 2e-9 * optimum
    assert selection.gap <= 0.5
    assert selection.status == ("optimal" if selection.gap == 0 else "feasible")


def test_an_lp_rounding_is_offered_after_greedy_dags_local_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm start and the LP's rounding both choose a's dear node; the local search makes it the cheap one,
    # which meets the bound, so neither the rounding as it is nor CP-SAT is what comes back (issue 25: Mixtral's
    # rounding, improved, was the plan CP-SAT found in 120 s).
    egraph = build({"x": [(0.0, [])], "y": [(0.0, [])], "a": [(1.0, ["x"]), (5.0, ["y"])], "out": [(0.0, ["a"])]},
                   roots=["out"])
    dear = [egraph.class_nodes[egraph.class_ids.index(c)][1 if c == "a" else 0] for c in egraph.class_ids]

    def rounded(_egraph: EGraph, _candidates: object, _block: object, _needs: object, _deadline: float,
                _ties: object, offer: Callable[[list[int]], float], _enough: float, reads: bool) -> Relaxation:
        assert offer(list(dear)) == 1.0
        return Relaxation((), 1.0, 0)

    def cp_sat(*args: object) -> None:
        raise AssertionError("CP-SAT ran although an offered selection met the bound")

    monkeypatch.setattr(ilp, "warm_start", lambda *args: (list(dear), 0.0))
    monkeypatch.setattr(ilp, "relax", rounded)
    monkeypatch.setattr(ilp, "solve_parts", cp_sat)
    selection = extract_ilp(egraph, 10.0)
    assert selection.dag_cost == 1.0 and selection.status == "optimal"


def test_a_budgeted_call_on_a_graph_solved_before_at_its_costs_makes_no_warm_start_reduction_or_bound_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a memory budget the ILP is called per cut round, per leaner plan, on graphs the fastest plan's calls
    solved already (copies at the same costs): its warm start, preprocessing and contracted bound depend on neither
    budget nor start, so they are made once (`EGraph.by_costs`), their counted work charged again, and the call
    returns what it returns made afresh (on a graph built anew: nothing shared)."""
    monkeypatch.setattr(ilp, "CONTRACT_FROM", 100)  # the contracted bound from 100 candidates, as on big graphs
    made = {"warm_start": 0, "reduce": 0, "contracted_bound": 0}
    for name in made:
        def counted(*args: object, _name: str = name, _made: Callable[..., object] = getattr(ilp, name)) -> object:
            made[_name] += 1
            return _made(*args)
        monkeypatch.setattr(ilp, name, counted)
    egraph = layered(12, 8, seed=2)
    nodes = [n for n in range(egraph.num_nodes) if egraph.node_cost[n] > 0][:40]

    def cut(k: int) -> DeviceBudget:
        return DeviceBudget(100, {}, {}, groups=({n: 30 for n in nodes[:k]},))

    extract_ilp(egraph, 0.5)  # the fastest plan's call, without a budget
    rounds = [extract_ilp(egraph.with_costs(egraph.node_cost), 0.5, cut(k)) for k in (10, 20)]
    assert made == {"warm_start": 1, "reduce": 1, "contracted_bound": 1}
    for k, found in zip((10, 20), rounds):
        afresh = extract_ilp(layered(12, 8, seed=2), 0.5, cut(k))
        assert (found.choice, found.dag_cost, found.status, found.bound, found.stopped_by) == (
            afresh.choice, afresh.dag_cost, afresh.status, afresh.bound, afresh.stopped_by)
