"""Each distinct selection is decoded, walked for its peaks and priced once (egraph.lean_plans), and what comes back
is what a fresh decode gives: the same plans under a memory budget as without the memo."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from training_helpers import GPU, adam_step

import tapestry
from tapestry.cost import peak_memory, plan_cost, rank_peaks
from tapestry.cost.memory import Lowerings, lean_order
from tapestry.egraph.budget import leaner
from tapestry.egraph.embed import embedded_plans
from tapestry.egraph.lean_plans import LeanPlans
from tapestry.optimizer import explore


@pytest.fixture(scope="module")
def explored() -> tapestry.optimizer.Explored:
    return explore(adam_step(8, 32, 64)[0].graph, tapestry.Mesh(2, 2))


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
        found = fresh.extract(GPU, time_limit=1, memory_budget=budget)
        plans.append((found.plan.steps, found.plan.cost, found.peak_memory, found.status))
    assert plans[0] == plans[1]


def test_the_floor_is_under_each_devices_exact_peak_in_both_step_orders(explored):  # noqa: ANN001
    """The floor rejects a selection undecoded (`Explored._unbound`): over its exact peak, it would skip a plan
    that fits. Selections under reweighted node costs, with the hand plans' (every device split alike or not);
    their peaks walked with steps lowered for the plans before are the peaks walked afresh."""
    egraph = explored.decoder.extraction_graph(list(explored.roots), GPU)
    rng = random.Random(0)
    selections = [embedded for _, embedded in embedded_plans(explored.decoder, egraph, explored.baselines, ())]
    for _ in range(6):
        weighted = egraph.with_costs([c * rng.uniform(0.1, 10) for c in egraph.node_cost])
        selections.append(tapestry.extract.extract(weighted, "greedy-dag", 5))
    lean = LeanPlans(explored.decoder, explored.graph, explored.names)
    lowerings = Lowerings()
    for selection in selections:
        plan, nodes = lean.decode(egraph, selection)
        reordered = replace(plan, steps=tuple(plan.steps[i] for i in lean_order(plan)))
        floor = lean.floor(selection)
        for ordered in (plan, reordered):
            peaks = rank_peaks(ordered, lowerings)  # steps lowered for the plans before: the same peaks
            assert peaks == rank_peaks(ordered) and [p.bytes for p in peaks] == peak_memory(ordered)
            assert all(f <= p.bytes for f, p in zip(floor, peaks, strict=True))
    assert len(selections) > 6 and max(max(lean.floor(s)) for s in selections) > 0


def test_a_budget_at_the_plans_own_peak_is_not_binding(explored):  # noqa: ANN001
    """A budget the unbudgeted plan meets exactly: the floor must not reject it (it would be re-solved under
    the budget's constraints and cuts, and lose its proof)."""
    free = replace(explored).extract(GPU, time_limit=1)
    budgeted = replace(explored).extract(GPU, time_limit=1, memory_budget=free.peak_memory)
    assert budgeted.plan.notes["memory_budget"] == "not binding"
    assert budgeted.plan.cost == pytest.approx(free.plan.cost, rel=1e-12)
    assert budgeted.status == free.status
