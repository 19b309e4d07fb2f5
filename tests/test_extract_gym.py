"""Real extraction-gym e-graphs: every extractor's selection passes the validator.

One small rover file runs by default; the tensat graphs (up to 57,800 nodes, ILP up to
its time limit) are slow and run under `make test-all`."""
from __future__ import annotations

import pytest

from extract_helpers import GYM
from tapestry.extract import EXTRACTORS, EGraph, extract, validate

pytestmark = pytest.mark.skipif(not GYM.exists(), reason="extraction-gym data not present")


def check_all_extractors(path: str, time_limit: float) -> None:
    egraph = EGraph.load(GYM / path)
    costs = {}
    for name in EXTRACTORS:
        selection = extract(egraph, name, time_limit)
        assert validate(egraph, selection) == [], name
        costs[name] = selection.dag_cost
    assert costs["ilp"] <= costs["greedy-dag"]


def test_small_rover_file() -> None:
    # CP-SAT runs to its work budget here unproven at 2 s as at 10 s, and keeps greedy-dag's cost (1701): 8 -> 2.3 CPU s
    check_all_extractors("rover/box_filter_3iteration_egraph.json", time_limit=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vgg", "resnet50", "bert", "nasneta", "nasrnn"])
def test_tensat(name: str) -> None:
    check_all_extractors(f"tensat/{name}.json", time_limit=60)
