"""Standalone extraction over serialized e-graphs: bottom-up, greedy DAG and exact ILP, plus a validator.

Typical use from other Tapestry code::

    egraph = EGraph.from_nodes(nodes, roots).with_costs(my_costs)
    selection = extract(egraph, "ilp", time_limit=10)
    assert not validate(egraph, selection)
"""
from __future__ import annotations

from collections.abc import Callable

from tapestry.extract.bottom_up import extract_bottom_up
from tapestry.extract.egraph import EGraph, EGraphError, Node, NoFiniteChoiceError
from tapestry.extract.greedy_dag import extract_greedy_dag
from tapestry.extract.ilp import DeviceBudget, Ties, extract_ilp, ties_hold
from tapestry.extract.periodic import Repeated
from tapestry.extract.selection import Selection
from tapestry.extract.validate import validate

EXTRACTORS: dict[str, Callable[[EGraph, float], Selection]] = {
    "bottom-up": lambda egraph, _time_limit: extract_bottom_up(egraph),
    "greedy-dag": lambda egraph, _time_limit: extract_greedy_dag(egraph),
    "ilp": lambda egraph, time_limit: extract_ilp(egraph, time_limit),
}


def extract(egraph: EGraph, extractor: str = "ilp", time_limit: float = 60.0,
            budget: DeviceBudget | None = None, ties: Ties = (), repeated: Repeated | None = None,
            stop_gap: float | None = None, start: Selection | None = None) -> Selection:
    """One entry point so callers pick an extractor by name; `time_limit` only bounds the ILP, and only the ILP
    takes a `budget` or `ties` (the others choose node by node, blind to a constraint over the whole selection)
    or uses `repeated` (a periodic warm start), `stop_gap` (`extract_ilp`'s; None: its default) and `start` (a
    warm start of the caller's)."""
    if budget is not None or ties:
        if extractor != "ilp":
            what = "a memory budget" if budget is not None else "tied nodes"
            raise ValueError(f"extractor {extractor!r} cannot keep {what}; use 'ilp'")
        return extract_ilp(egraph, time_limit, budget=budget, ties=ties, stop_gap=stop_gap, start=start)
    if extractor == "ilp":
        return extract_ilp(egraph, time_limit, repeated=repeated, stop_gap=stop_gap, start=start)
    try:
        run = EXTRACTORS[extractor]
    except KeyError:
        raise ValueError(f"unknown extractor {extractor!r}; choose from {', '.join(EXTRACTORS)}") from None
    return run(egraph, time_limit)


__all__ = [
    "DeviceBudget",
    "EGraph",
    "EGraphError",
    "EXTRACTORS",
    "Node",
    "NoFiniteChoiceError",
    "Repeated",
    "Selection",
    "Ties",
    "extract",
    "extract_bottom_up",
    "extract_greedy_dag",
    "extract_ilp",
    "ties_hold",
    "validate",
]
