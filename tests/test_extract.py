"""Extraction specifications on small hand-built e-graphs: every extractor, every corner case."""
from __future__ import annotations

import math

import pytest

from extract_helpers import build
from tapestry.extract import (
    EXTRACTORS,
    EGraph,
    EGraphError,
    NoFiniteChoiceError,
    Selection,
    extract,
    validate,
)
from tapestry.extract.cpsat import _parts
from tapestry.extract.reduction import reduce
from tapestry.extract.selection import finalize
from tapestry.extract.tree import solvable_tree

INF = math.inf


def extract_valid(egraph: EGraph, extractor: str) -> Selection:
    selection = extract(egraph, extractor, time_limit=10)
    assert validate(egraph, selection) == []
    return selection


def chosen(egraph: EGraph, selection: Selection) -> dict[str, str]:
    return selection.node_ids(egraph)


@pytest.fixture(params=list(EXTRACTORS))
def extractor(request: pytest.FixtureRequest) -> str:
    return request.param


def test_cheap_node_that_points_back_through_another_class_is_not_chosen(extractor: str) -> None:
    # A's cheap node needs B, and B's cheap node needs A again: taking both would be a cycle.
    g = build({"A": [(1, ["B"]), (10, [])], "B": [(0, ["A"]), (5, [])]}, roots=["A"])
    selection = extract_valid(g, extractor)
    assert chosen(g, selection) == {"A": "A.0", "B": "B.1"}
    assert selection.dag_cost == 6


def test_self_loop_is_never_chosen(extractor: str) -> None:
    g = build({"A": [(0, ["A"]), (2, [])]}, roots=["A"])
    assert chosen(g, extract_valid(g, extractor)) == {"A": "A.1"}


def test_several_roots_share_a_child_counted_once(extractor: str) -> None:
    g = build({"R1": [(1, ["C"])], "R2": [(2, ["C"])], "C": [(3, [])]}, roots=["R1", "R2"])
    selection = extract_valid(g, extractor)
    assert set(selection.node_ids(g)) == {"R1", "R2", "C"}
    assert selection.dag_cost == 6


def test_unreachable_classes_are_left_out(extractor: str) -> None:
    g = build({"R": [(1, [])], "Orphan": [(1, [])], "Broken": [(INF, [])]}, roots=["R"])
    assert chosen(g, extract_valid(g, extractor)) == {"R": "R.0"}


def test_avoidable_class_without_finite_choice_is_ignored(extractor: str) -> None:
    g = build({"R": [(1, ["X"]), (5, [])], "X": [(INF, [])]}, roots=["R"])
    assert chosen(g, extract_valid(g, extractor)) == {"R": "R.1"}


def test_required_class_without_finite_choice_names_the_root(extractor: str) -> None:
    g = build({"R": [(1, ["X"])], "X": [(INF, []), (1, ["X"])]}, roots=["R"])
    with pytest.raises(NoFiniteChoiceError, match="'R'"):
        extract(g, extractor)


def test_root_reachable_only_through_a_cycle_has_no_finite_choice(extractor: str) -> None:
    g = build({"A": [(1, ["B"])], "B": [(1, ["A"])]}, roots=["A"])
    with pytest.raises(NoFiniteChoiceError, match="'A'"):
        extract(g, extractor)


def test_subsumed_nodes_are_never_chosen(extractor: str) -> None:
    g = build({"R": [(0, []), (3, [])]}, roots=["R"], subsumed=["R.0"])
    assert chosen(g, extract_valid(g, extractor)) == {"R": "R.1"}


def test_duplicated_children_are_paid_for_once_in_the_dag(extractor: str) -> None:
    # Tree cost of R.0 is 1 + 2 + 2 = 5, its DAG cost is 3; the alternative costs 4 either way.
    g = build({"R": [(1, ["C", "C"]), (4, [])], "C": [(2, [])]}, roots=["R"])
    selection = extract_valid(g, extractor)
    expected = {"bottom-up": 4, "greedy-dag": 3, "ilp": 3}[extractor]
    assert selection.dag_cost == expected


def test_empty_graph_and_missing_roots_are_clear_errors(extractor: str) -> None:
    with pytest.raises(EGraphError, match="no root"):
        extract(EGraph.from_nodes([], []), extractor)
    with pytest.raises(EGraphError, match="no root"):
        extract(build({"A": [(1, [])]}, roots=[]), extractor)


def test_ilp_finds_sharing_that_the_heuristics_miss() -> None:
    # Alone, A and B are cheapest as leaves (3 each); together they can share S (0.5 + 0.5 + 4).
    g = build(
        {"R": [(1, ["A", "B"])], "A": [(3, []), (0.5, ["S"])], "B": [(3, []), (0.5, ["S"])], "S": [(4, [])]},
        roots=["R"],
    )
    assert extract_valid(g, "greedy-dag").dag_cost == 7
    ilp = extract_valid(g, "ilp")
    assert (ilp.dag_cost, ilp.status, ilp.gap) == (6, "optimal", 0.0)


def test_greedy_dag_prefers_a_shared_subterm_over_separate_cheaper_trees() -> None:
    # B built on top of A and S costs 1 more than A's DAG {A, S}; as a tree it pays for A and S again (4 > 3.5).
    g = build(
        {"R": [(0, ["A", "B"])], "A": [(1, ["S"]), (3, [])], "B": [(1, ["S", "A"]), (3.5, [])], "S": [(1, [])]},
        roots=["R"],
    )
    assert extract_valid(g, "bottom-up").dag_cost == 5.5
    assert extract_valid(g, "greedy-dag").dag_cost == 3


def test_greedy_dag_local_search_reuses_a_class_already_in_the_selection() -> None:
    # Alone, B is cheapest as a leaf (2 < 1 + 3); with A already chosen for R, B built on A adds only 1.
    g = build({"R": [(0, ["A", "B"])], "A": [(3, [])], "B": [(2, []), (1, ["A"])]}, roots=["R"])
    assert extract_valid(g, "bottom-up").dag_cost == 5
    selection = extract_valid(g, "greedy-dag")
    assert (selection.dag_cost, chosen(g, selection)["B"]) == (4, "B.1")


def test_ilp_solves_independent_parts_separately() -> None:
    # R forces A and B; A's choice (with a cycle through A2) and B's choice share no class.
    g = build(
        {
            "R": [(1, ["A", "B"])],
            "A": [(1, ["A2"]), (5, [])],
            "A2": [(1, ["A"]), (1, [])],
            "B": [(2, []), (1, ["C"])],
            "C": [(0.5, [])],
        },
        roots=["R"],
    )
    required, parts = _parts(g, reduce(g, solvable_tree(g)))
    name = g.class_ids.__getitem__
    assert set(map(name, required)) == {"R", "A", "B"}
    assert sorted(sorted(map(name, part)) for part in parts) == [["A", "A2"], ["B", "C"]]
    ilp = extract_valid(g, "ilp")
    assert (ilp.dag_cost, ilp.status) == (4.5, "optimal")


def test_custom_costs_change_the_choice() -> None:
    g = build({"R": [(1, []), (2, [])]}, roots=["R"])
    assert chosen(g, extract_valid(g, "ilp")) == {"R": "R.0"}
    assert chosen(g.with_costs([5.0, 2.0]), extract_valid(g.with_costs([5.0, 2.0]), "ilp")) == {"R": "R.1"}


def test_repriced_graphs_share_the_structure_derived_once_not_recomputed() -> None:
    g = build({"R": [(1.0, ["A", "A"]), (2.0, ["B"])], "A": [(1.0, [])], "B": [(1.0, ["A"])]}, ["R"])
    sibling, repriced = g.with_costs([2.0, 1.0, 1.0, 1.0]), g.with_costs([3.0, 1.0, 2.0, 1.0]).with_costs([1.0] * 4)
    structure = sibling.child_sets, sibling.parents  # derived from a copy, before the graph itself asked for it
    assert structure == (((1,), (2,), (), (1,)), ((), (0, 3), (1,)))
    assert all(graph.child_sets is structure[0] and graph.parents is structure[1] for graph in (g, repriced))


def test_repricing_checks_every_cost_names_the_first_negative_or_nan_and_stores_floats() -> None:
    """`with_costs` checks the whole graph's costs at once (no per-node call); a bad one is named as
    `_check_cost` names it, and the flags `selectable_nodes` makes match `selectable`, subsumed nodes or none."""
    g = build({"R": [(1.0, ["A"]), (2.0, [])], "A": [(1.0, []), (3.0, [])]}, ["R"])
    for bad, shown in ((-1.0, "-1.0"), (math.nan, "nan")):
        with pytest.raises(EGraphError, match=rf"node 'R.1' has cost {shown}; costs must be >= 0"):
            g.with_costs([1, bad, bad, 0])
    repriced = g.with_costs([1, INF, 0, 2])
    assert repriced.node_cost == (1.0, INF, 0.0, 2.0) and all(type(c) is float for c in repriced.node_cost)
    subsumed = build({"R": [(1.0, ["A"]), (2.0, [])], "A": [(1.0, []), (3.0, [])]}, ["R"], ["A.0"])
    for graph in (repriced, subsumed):
        assert graph.selectable_nodes == tuple(graph.selectable(n) for n in range(graph.num_nodes))
    assert g.child_counts == (1, 0, 0, 0)


def test_a_graph_makes_its_tree_choice_once_and_a_repriced_copy_its_own() -> None:
    g = build({"R": [(1.0, ["A"]), (3.0, [])], "A": [(1.0, [])]}, ["R"])
    repriced = g.with_costs([5.0, 2.0, 1.0])
    assert solvable_tree(g) is solvable_tree(g) and solvable_tree(repriced) is solvable_tree(repriced)
    assert solvable_tree(g).node[0] == 0 and solvable_tree(repriced).node[0] == 1


def test_a_cyclic_preference_is_repaired_into_a_valid_selection() -> None:
    g = build({"A": [(1, ["B"]), (10, [])], "B": [(0, ["A"]), (5, [])]}, roots=["A"])
    tree = solvable_tree(g)
    cyclic = [g.node_ids.index("A.0"), g.node_ids.index("B.0")]
    selection = finalize(g, cyclic, tree, "test", 0.0)
    assert validate(g, selection) == []


def test_validator_reports_each_kind_of_problem() -> None:
    g = build({"A": [(1, ["B"]), (2, [])], "B": [(1, ["A"]), (1, [])], "C": [(1, [])]}, roots=["A", "C"], subsumed=["B.1"])
    node = {nid: i for i, nid in enumerate(g.node_ids)}
    cls = {cid: i for i, cid in enumerate(g.class_ids)}

    def problems(choice: dict[str, str]) -> list[str]:
        return validate(g, Selection({cls[c]: node[n] for c, n in choice.items()}, 0.0, "test", 0.0))

    assert problems({"A": "A.1", "C": "C.0"}) == []
    assert any("belongs to another class" in p for p in problems({"A": "B.1", "C": "C.0"}))
    assert any("subsumed" in p for p in problems({"A": "A.0", "B": "B.1", "C": "C.0"}))
    assert any("child class 'B'" in p for p in problems({"A": "A.0", "C": "C.0"}))
    assert any("root class 'C'" in p for p in problems({"A": "A.1"}))
    assert any(p.startswith("cycle") for p in problems({"A": "A.0", "B": "B.0", "C": "C.0"}))


def test_json_children_are_node_ids_mapped_to_their_classes() -> None:
    data = {
        "nodes": {
            "r": {"op": "f", "children": ["x1", "x1"], "eclass": "R", "cost": 1.0},
            "x1": {"op": "a", "children": [], "eclass": "X", "cost": 2.0},
            "x2": {"op": "b", "children": [], "eclass": "X", "subsumed": True},
        },
        "root_eclasses": ["R"],
        "class_data": {"R": {"type": "T"}},
    }
    g = EGraph.from_json(data)
    assert g.node_children[g.node_ids.index("r")] == (g.class_ids.index("X"),) * 2
    assert g.node_cost[g.node_ids.index("x2")] == 1.0  # the format's default
    assert extract_valid(g, "ilp").dag_cost == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "'nodes' object"),
        ({"nodes": {}}, "root_eclasses"),
        ({"nodes": {"a": {"op": "f"}}, "root_eclasses": []}, "'eclass'"),
        ({"nodes": {"a": {"eclass": "A", "children": ["zz"]}}, "root_eclasses": ["A"]}, "'zz'"),
        ({"nodes": {"a": {"eclass": "A", "cost": -1}}, "root_eclasses": ["A"]}, "cost"),
        ({"nodes": {"a": {"eclass": "A"}}, "root_eclasses": ["B"]}, "'B'"),
    ],
)
def test_malformed_json_is_an_egraph_error(data: object, message: str) -> None:
    with pytest.raises(EGraphError, match=message):
        EGraph.from_json(data)
