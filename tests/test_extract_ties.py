"""Tied nodes: the ILP chooses both nodes of a pair or neither (a training step's weight placed in the layout its
update is delivered in), and the greedy extractors refuse ties rather than ignore them."""
from __future__ import annotations

import contextlib
import math

import pytest

from tapestry.extract import ilp, tied
from tapestry.extract import NoFiniteChoiceError, Selection, extract, ties_hold, validate
from tapestry.extract.relax import Relaxation
from extract_helpers import build

# w is placed in layout A or B (or moved between them); y reads it; w's update `new` is delivered in A or B.
# Unconstrained, w sits in A (cheap to read) and its update comes out in B (cheap to make): cost 2.
STEP = {
    "wA": [(0, []), (5, ["wB"])],
    "wB": [(0, []), (5, ["wA"])],
    "y": [(1, ["wA"]), (3, ["wB"])],
    "newA": [(10, ["y"])],
    "newB": [(1, ["y"])],
    "out": [(0, ["newA"]), (0, ["newB"])],
}


def node(egraph, node_id: str) -> int:
    return egraph.node_ids.index(node_id)


def steady_ties(egraph) -> list[tuple[int, int]]:
    """Place in A with delivery in A, place in B with delivery in B."""
    return [(node(egraph, "wA.0"), node(egraph, "out.0")), (node(egraph, "wB.0"), node(egraph, "out.1"))]


def test_without_ties_the_update_comes_out_in_another_layout_than_its_weight():
    egraph = build(STEP, ["out"])
    selection = extract(egraph, "ilp", time_limit=5)
    assert selection.dag_cost == 2
    assert not ties_hold(selection.choice, steady_ties(egraph))


def test_tied_extraction_is_the_cheapest_selection_that_keeps_every_tie():
    egraph = build(STEP, ["out"])
    ties = steady_ties(egraph)
    selection = extract(egraph, "ilp", time_limit=5, ties=ties)
    assert ties_hold(selection.choice, ties)
    assert not validate(egraph, selection)
    # w placed in B, read there (3), update made in B (1); placing in A costs 1 + 10, moving B to A 5 + 1 + 1
    assert selection.dag_cost == 4
    assert selection.status == "optimal"


def test_a_tie_to_a_node_that_can_never_be_chosen_rules_its_partner_out():
    egraph = build({**STEP, "newB": [(float("inf"), ["y"])]}, ["out"])
    selection = extract(egraph, "ilp", time_limit=5, ties=steady_ties(egraph))
    assert selection.dag_cost == 11  # only delivery in A is left, so w is placed in A


def test_ties_no_selection_can_keep_are_an_error():
    egraph = build(STEP, ["out"])
    ties = [*steady_ties(egraph), (node(egraph, "wA.0"), node(egraph, "out.1"))]  # A and B delivered at once
    with pytest.raises(NoFiniteChoiceError, match="keeps the ties"):
        extract(egraph, "ilp", time_limit=5, ties=ties)


def test_a_tied_node_nothing_the_roots_reach_reads_stays_chosen_with_what_it_reads():
    """A folded graph's copy 0 output in a layout only copy 2 would read: its twin in copy 1 is tied to a node the
    roots reach, yet nothing chosen reads it. The ILP's selection keeps it and its children as CP-SAT chose them,
    priced, so the tie holds (it was cut to what the roots reach: the tie broken, the cost too low)."""
    egraph = build({"out": [(3, ["a"]), (4, ["z"])], "a": [(1, []), (5, [])], "z": [(1, ["b"])], "b": [(1, [])]},
                   ["out"])
    ties = [(node(egraph, "a.0"), node(egraph, "z.0"))]
    selection = extract(egraph, "ilp", time_limit=5, ties=ties)
    assert ties_hold(selection.choice, ties)
    assert selection.choice[egraph.class_ids.index("b")] == node(egraph, "b.0")
    assert selection.dag_cost == 6  # out.0, a.0, z.0 and b.0; a.1 costs 8, out.1 (reading z, a.0 tied) 7
    assert not validate(egraph, selection)


@pytest.mark.parametrize("extractor", ["bottom-up", "greedy-dag"])
def test_greedy_extractors_refuse_ties(extractor):
    egraph = build(STEP, ["out"])
    with pytest.raises(ValueError, match=f"extractor '{extractor}' cannot keep tied nodes; use 'ilp'"):
        extract(egraph, extractor, ties=steady_ties(egraph))


def test_a_tied_graph_too_big_to_model_in_time_returns_a_tied_selection_found_without_cp_sat_or_raises(monkeypatch):
    """CP-SAT would get what modelling left, too little to find a tied selection on a folded 7B step (8x8): the tied
    search (`tied.py`) answers at once, here with the free choice's pairs pinned (the optimum), a start as good
    comes back as it is, and ties no selection keeps raise."""
    egraph = build(STEP, ["out"])
    ties = steady_ties(egraph)
    start = extract(egraph, "ilp", time_limit=5, ties=ties)
    monkeypatch.setattr(ilp, "MODEL_NODES_PER_SECOND", 1e-6)
    alone = extract(egraph, "ilp", time_limit=5, ties=ties)
    assert alone.dag_cost == 4 and ties_hold(alone.choice, ties) and alone.stopped_by == "nodes"
    given = extract(egraph, "ilp", time_limit=5, ties=ties, start=start)
    assert given.choice == start.choice and given.status == "feasible"
    with pytest.raises(NoFiniteChoiceError, match="no time to model"):
        extract(egraph, "ilp", time_limit=5, ties=[*ties, (node(egraph, "wA.0"), node(egraph, "out.1"))])


def test_a_tied_optimum_dearer_than_twice_the_untied_warm_start_is_found_exactly(monkeypatch):
    """The untied warm start (cost 2) breaks the ties, so the best tied selection can hold nodes dearer than twice
    it: CP-SAT's integer costs must not clamp them to look alike (placing B and reading it there, 31, and placing A,
    51, would then look as cheap as moving B to A, 7, and come back as optimal). The LP pass, which finds 7 here by
    rounding, is left out, so CP-SAT decides."""
    monkeypatch.setattr(ilp, "LP_NODES_PER_SECOND", 0)
    egraph = build({**STEP, "y": [(1, ["wA"]), (30, ["wB"])], "newA": [(50, ["y"])]}, ["out"])
    selection = extract(egraph, "ilp", time_limit=5, ties=steady_ties(egraph))
    assert selection.dag_cost == 7  # w placed in B, moved to A (5), read there (1), its update made in B (1)
    assert selection.status == "optimal"


def test_a_tied_graph_too_big_to_model_improves_its_start_and_tries_the_free_choices_pairs(monkeypatch):
    """With no work left to model the graph, the ILP returned its caller's start unimproved (LLaMA 13B's step on 8x8:
    the DP x TP hand plan at 65.58 ms where greedy-dag's steady plan costs 44.41). The start (w placed in A, its
    update delivered from A: 11) is improved with its tied nodes kept (the update made by the cheaper node: 5), and
    the pairs the free choice delivers (B) are pinned and extracted: w placed in B, read there, 4, the optimum."""
    egraph = build({**STEP, "newA": [(10, ["y"]), (4, ["y"])]}, ["out"])
    ties = steady_ties(egraph)
    placed_a = {egraph.class_ids.index(c): node(egraph, n)
                for c, n in (("out", "out.0"), ("newA", "newA.0"), ("y", "y.0"), ("wA", "wA.0"))}
    start = Selection(placed_a, 11.0, "hand", 0.0)
    monkeypatch.setattr(ilp, "MODEL_NODES_PER_SECOND", 1e-6)
    found = extract(egraph, "ilp", time_limit=5, ties=ties, start=start)
    assert ties_hold(found.choice, ties) and not validate(egraph, found)
    assert found.dag_cost == 4 and found.status == "feasible" and found.stopped_by == "nodes"
    monkeypatch.setattr(tied, "_pinned", lambda egraph, kept, frozen: egraph.with_costs(
        [math.inf if n in frozen else c for n, c in enumerate(egraph.node_cost)]))  # no pairs pinned
    assert extract(egraph, "ilp", time_limit=5, ties=ties, start=start).dag_cost == 5  # the start improved


# STEP with w's placements priced so that greedy-dag's local search, let loose, breaks a tie to save: B placed at 2,
# or moved from A at 0.5; and y read from B by two nodes that read distinct classes (p, q), so neither dominates.
LOOSE = {**STEP, "wB": [(2, []), (0.5, ["wA"])], "y": [(1, ["wA"]), (3, ["wB", "p"]), (9, ["wB", "q"])],
         "p": [(0, [])], "q": [(0, [])]}


def rounding_offered(monkeypatch, egraph, ties, rounding: list[int]) -> float:
    """What the LP pass's `offer` returns for `rounding` under `ties`, the warm start (greedy-dag's choice) being
    `rounding` too; CP-SAT is not run."""
    offered = []

    def relax(_egraph, _candidates, _block, _needs, _deadline, _ties, offer, _enough, reads):
        offered.append(offer(list(rounding)))
        return Relaxation((), 0.0, 0)

    monkeypatch.setattr(ilp, "warm_start", lambda *args: (list(rounding), 0.0))
    monkeypatch.setattr(ilp, "relax", relax)
    monkeypatch.setattr(ilp, "solve_parts", lambda *args: (None, 0.0, False, "work"))
    with contextlib.suppress(NoFiniteChoiceError):  # where nothing admissible was offered
        extract(egraph, "ilp", time_limit=5, ties=ties)
    return offered[0]


def chosen(egraph, nodes: list[str]) -> list[int]:
    """A choice per class: the named nodes, and each other class's first node."""
    named = {egraph.node_class[node(egraph, n)]: node(egraph, n) for n in nodes}
    return [named.get(c, egraph.class_nodes[c][0]) for c in range(egraph.num_classes)]


def test_an_lp_rounding_that_keeps_the_ties_is_improved_with_the_tied_nodes_kept(monkeypatch):
    """The rounding (w placed in B, read by the dear y: 12) keeps the ties; greedy-dag's local search let loose
    moves w's B from A (saving 1.5) and breaks the tie, so nothing better than the rounding was kept; with the tied
    nodes frozen it reads B by the cheap y, 6, the tied optimum."""
    egraph = build(LOOSE, ["out"])
    ties = steady_ties(egraph)
    dear = chosen(egraph, ["out.1", "newB.0", "y.2", "q.0", "wB.0"])
    assert rounding_offered(monkeypatch, egraph, ties, dear) == 6
    assert extract(egraph, "ilp", time_limit=5, ties=ties).dag_cost == 6  # and it is the optimum


def test_an_lp_rounding_that_breaks_a_tie_is_not_improved(monkeypatch):
    """The local search keeps a broken tie broken (its moves neither add nor drop tied nodes, frozen, or, loose,
    break more): improving such a rounding was ~40% of the LP pass on Mixtral's training step on 8 devices, every
    rounding breaking a tie."""
    egraph = build(LOOSE, ["out"])
    broken = chosen(egraph, ["out.1", "newB.0", "y.0", "wA.0"])  # w placed in A, its update delivered in B

    def improve(*args, **kwargs):
        raise AssertionError("a rounding that breaks a tie was improved")

    monkeypatch.setattr(ilp, "improve", improve)
    assert rounding_offered(monkeypatch, egraph, steady_ties(egraph), broken) == math.inf  # nothing admissible
