"""A memo of selections: made once per graph costs and arguments, the least recently asked dropped first."""
from __future__ import annotations

from extract_helpers import build
from training_helpers import GPU, adam_step

import tapestry
from tapestry import optimizer
from tapestry.extract import extract
from tapestry.extract.memo import SelectionMemo
from tapestry.optimizer import explore

GRAPH = {"a": [(1, []), (2, [])], "out": [(0, ["a"])]}


def test_a_selection_is_made_once_per_costs_and_arguments():
    egraph = build(GRAPH, ["out"])
    memo, made = SelectionMemo(), []

    def make(graph):
        made.append(graph)
        return extract(graph, "greedy-dag")

    first = memo.get(egraph, (), ("greedy-dag",), None, lambda: make(egraph))
    assert memo.get(egraph, (), ("greedy-dag",), None, lambda: make(egraph)) is first
    dearer = egraph.with_costs([5.0 if c == 1 else c for c in egraph.node_cost])
    memo.get(dearer, (), ("greedy-dag",), None, lambda: make(dearer))  # other costs: made again
    memo.get(egraph, (), ("ilp",), None, lambda: make(egraph))  # other arguments: made again
    assert len(made) == 3


def test_the_least_recently_asked_selection_is_dropped_first():
    egraph = build(GRAPH, ["out"])
    memo, made = SelectionMemo(kept=2), []

    def get(arg):
        return memo.get(egraph, (), (arg,), None, lambda: made.append(arg) or extract(egraph, "greedy-dag"))

    get("x"), get("y"), get("x"), get("z")  # y was asked least recently: dropped
    get("x")
    get("y")
    assert made == ["x", "y", "z", "y"]


def test_a_model_that_cannot_be_hashed_keys_by_identity():
    egraph = build(GRAPH, ["out"])
    memo = SelectionMemo()
    unhashable = {"profile": "cpu"}
    calls = []
    for _ in range(2):
        memo.get(egraph, (), (), unhashable, lambda: calls.append(1) or extract(egraph, "greedy-dag"))
    assert calls == [1]


def test_a_leaner_plans_extraction_makes_none_of_the_fastest_plans_selections_again(monkeypatch):
    """Under a memory budget each fit first tries the selection made without it (`Explored._unbound`), as the fastest
    plan's extraction made it: kept, not made again. On 8 devices an extraction also makes 9 greedy-dag picks (its
    ILP's warm starts), which in one memo with those selections evicted them: each of the 70B pipeline layer's
    leaner plans on 8x8 ran its 2 ILPs without a budget again (51 CPU s of the step's 391; memo.PICKS_KEPT)."""
    imported, _ = adam_step(64, 256, 16)
    explored = explore(imported.graph, tapestry.Mesh(8))
    made: list[str] = []
    solve = optimizer.extract
    monkeypatch.setattr(optimizer, "extract", lambda egraph, extractor, *rest: (
        made.append(extractor if len(rest) < 2 or rest[1] is None else "budgeted"), solve(egraph, extractor, *rest))[1])
    fastest = explored.extract(GPU, "ilp", 5.0, micro_batches=128)
    assert made.count("ilp") == 2 and "greedy-dag" in made  # the plain fit and the fused refit, and their starts
    made.clear()
    leaner = next(explored.leaner_plans(fastest, GPU, "ilp", 5.0, 128))
    assert leaner.peak_memory < fastest.peak_memory
    assert "ilp" not in made and "greedy-dag" not in made


def test_a_memory_budgets_constraints_are_made_once_per_e_graph_whatever_the_limit(monkeypatch):
    """A budget's constraints (`device_budget`: each node's bytes per device) do not depend on its limit, yet each
    extraction the budget binds made them anew: 3.5 CPU s per leaner plan of the 70B pipeline layer on 8x8. Two
    leaner plans the budget binds make them once, and the last is the plan a budget made for its limit alone gives."""
    imported, _ = adam_step(64, 256, 16)
    explored = explore(imported.graph, tapestry.Mesh(8))
    made: list[int] = []
    build = optimizer.device_budget
    monkeypatch.setattr(optimizer, "device_budget", lambda *args: made.append(args[-1]) or build(*args))
    fastest = explored.extract(GPU, "ilp", 5.0, micro_batches=128)
    sweep = explored.leaner_plans(fastest, GPU, "ilp", 5.0, 128)
    plans = [next(sweep) for _ in range(3)]  # the first fits a fit made without the budget: not binding
    assert [p.plan.notes.get("memory_budget") for p in plans] == ["not binding", None, None]
    assert fastest.peak_memory > plans[0].peak_memory > plans[1].peak_memory > plans[2].peak_memory
    assert len(made) == 1
    alone = explore(imported.graph, tapestry.Mesh(8)).extract(GPU, "ilp", 5.0,
                                                              memory_budget=plans[1].peak_memory - 1,
                                                              micro_batches=128)
    assert alone.plan.steps == plans[2].plan.steps and alone.plan.cost == plans[2].plan.cost
