"""Each distinct selection is decoded, walked for its peaks and priced once (egraph.lean_plans), and what comes back
is what a fresh decode gives: the same plans under a memory budget as without the memo."""
from __future__ import annotations

from dataclasses import replace

import pytest

from training_helpers import GPU, adam_step

import tapestry
from tapestry.cost import plan_cost
from tapestry.egraph.budget import leaner
from tapestry.egraph.lean_plans import LeanPlans
from tapestry.optimizer import explore


@pytest.fixture(scope="module")
def explored() -> tapestry.optimizer.Explored:
    return explore(adam_step(16, 64, 256)[0].graph, tapestry.Mesh(2, 2))


def test_a_selection_is_decoded_once_and_comes_back_as_a_fresh_decode_gives_it(explored):  # noqa: ANN001
    egraph = explored.decoder.extraction_graph(list(explored.roots), GPU)
    selection = tapestry.extract.extract(egraph, "greedy-dag", 5)
    decoded = []
    lean = LeanPlans(explored.decoder, explored.graph, explored.names)
    lean.decode = lambda *a: decoded.append(a) or LeanPlans.decode(lean, *a)  # type: ignore[method-assign]
    fresh = leaner(*LeanPlans(explored.decoder, explored.graph, explored.names).decode(egraph, selection))
    assert lean.leaner(egraph, selection) == fresh
    other = replace(selection, dag_cost=selection.dag_cost * 3, extractor="ilp", status="optimal", gap=0.0,
                    seconds=selection.seconds + 1)  # the same choice, found by another fit
    plan, nodes, peaks = lean.leaner(egraph, other)
    assert len(decoded) == 1
    again, _ = LeanPlans(explored.decoder, explored.graph, explored.names).decode(egraph, other)
    assert plan.cost == again.cost == other.dag_cost
    assert plan.notes == {**again.notes}  # extractor, seconds, status and gap the other selection's
    assert (plan.steps, nodes, peaks) == (fresh[0].steps, fresh[1], fresh[2])
    assert lean.cost(plan, GPU) == plan_cost(plan, GPU) == lean.cost(fresh[0], GPU)


def test_a_memo_that_keeps_nothing_decodes_every_time(explored):  # noqa: ANN001
    egraph = explored.decoder.extraction_graph(list(explored.roots), GPU)
    selection = tapestry.extract.extract(egraph, "greedy-dag", 5)
    decoded = []
    lean = LeanPlans(explored.decoder, explored.graph, explored.names, kept=0)
    lean.decode = lambda *a: decoded.append(a) or LeanPlans.decode(lean, *a)  # type: ignore[method-assign]
    assert lean.leaner(egraph, selection) == lean.leaner(egraph, selection)
    assert len(decoded) == 2


@pytest.mark.parametrize("budget", [10**12, None])
def test_an_extraction_under_a_budget_plans_alike_with_and_without_the_memo(explored, budget):  # noqa: ANN001
    plans = []
    for kept in (0, 8):
        fresh = replace(explored)  # its memos (cached properties) made anew
        fresh.__dict__["_lean"] = LeanPlans(explored.decoder, explored.graph, explored.names, kept=kept)
        found = fresh.extract(GPU, time_limit=5, memory_budget=budget)
        plans.append((found.plan.steps, found.plan.cost, found.peak_memory, found.status))
    assert plans[0] == plans[1]
