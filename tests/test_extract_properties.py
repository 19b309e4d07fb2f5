"""Property: on random small e-graphs (cycles, duplicates, subsumed and infinite nodes included),
every extractor returns a valid acyclic selection, or raises NoFiniteChoiceError exactly when none exists;
the ILP matches brute-force enumeration and no extractor beats it."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extract_helpers import brute_force
from tapestry.extract import EXTRACTORS, EGraph, Node, NoFiniteChoiceError, extract, validate
from tapestry.extract.greedy_dag import greedy_dag_choice
from tapestry.extract.selection import finalize
from tapestry.extract.tree import solvable_tree
from tapestry.extract.warm import WARM_SHARE
from tapestry.extract.work import Meter


@st.composite
def egraphs(draw: st.DrawFn) -> EGraph:
    num_classes = draw(st.integers(1, 5))
    classes = [f"c{i}" for i in range(num_classes)]
    cost = st.one_of(st.sampled_from([0.0, 1.0, math.inf]), st.floats(0, 10, allow_nan=False))
    nodes = [
        Node(
            id=f"{c}.{i}",
            op="f",
            eclass=c,
            cost=draw(cost),
            children=tuple(draw(st.lists(st.sampled_from(classes), max_size=3))),
            subsumed=draw(st.booleans()) and draw(st.booleans()),
        )
        for c in classes
        for i in range(draw(st.integers(1, 3)))
    ]
    roots = draw(st.lists(st.sampled_from(classes), min_size=1, max_size=2, unique=True))
    return EGraph.from_nodes(nodes, roots)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(egraphs())
def test_every_extractor_is_valid_and_the_ilp_is_optimal(egraph: EGraph) -> None:
    optimum = brute_force(egraph)
    for name in EXTRACTORS:
        if math.isinf(optimum):
            try:
                extract(egraph, name)
            except NoFiniteChoiceError:
                continue
            raise AssertionError(f"{name} extracted from an e-graph with no valid selection")
        selection = extract(egraph, name, time_limit=10)
        assert validate(egraph, selection) == []
        assert selection.dag_cost >= optimum - 1e-9
        if name == "ilp":
            assert selection.status == "optimal"
            assert math.isclose(selection.dag_cost, optimum, rel_tol=1e-6, abs_tol=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(egraphs(), st.sampled_from([0.001, 0.01, 0.1, 10.0]))
def test_at_any_time_limit_the_ilp_bound_is_below_the_optimum_and_the_ilp_not_worse_than_greedy_dag(
    egraph: EGraph, time_limit: float
) -> None:
    optimum = brute_force(egraph)
    if math.isinf(optimum):
        return
    selection = extract(egraph, "ilp", time_limit)
    assert validate(egraph, selection) == []
    assert (selection.bound is None) == (selection.gap is None)  # none where no phase bounded the search
    if selection.bound is not None:
        assert 0 <= selection.bound <= optimum + 1e-9 * (1 + optimum)
        assert selection.bound > 0 or selection.dag_cost == 0  # a bound of 0 bounds nothing: None
        assert 0 <= selection.gap < 1
    # The warm start's local search gets WARM_SHARE of the limit in its tries (greedy_dag.TRIES_PER_SECOND), a
    # count, so at any load it is this one, and the ILP returns nothing dearer.
    tree = solvable_tree(egraph)
    cut = Meter(time_limit).until(WARM_SHARE * time_limit)
    greedy = finalize(egraph, greedy_dag_choice(egraph, tree, cut), tree, "greedy-dag", 0.0)
    assert selection.dag_cost <= greedy.dag_cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(egraphs())
def test_greedy_dag_stopped_by_a_deadline_is_still_a_valid_selection(egraph: EGraph) -> None:
    """The ILP's warm start stops its local search at its share of the time limit (no tries left: the greedy
    choice alone)."""
    if math.isinf(brute_force(egraph)):
        return
    tree = solvable_tree(egraph)
    for deadline in (Meter(0.0).until(0.0), None):
        selection = finalize(egraph, greedy_dag_choice(egraph, tree, deadline), tree, "greedy-dag", 0.0)
        assert validate(egraph, selection) == []
