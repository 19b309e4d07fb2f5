"""A memo of selections: made once per graph costs and arguments, the least recently asked dropped first."""
from __future__ import annotations

from extract_helpers import build
from tapestry.extract import extract
from tapestry.extract.memo import SelectionMemo

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
