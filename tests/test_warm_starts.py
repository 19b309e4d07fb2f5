"""The ILP's warm starts for a steady training step include greedy-dag's steady picks: the state pinned replicated,
and pinned where greedy-dag's free choice delivered it (egraph.pins.steady_picks). Where the ILP has no work left
past its warm start (a 70B layer on 64 devices under a memory budget), the start is the plan: without the second
pick the 70B layer on 8x8 got its data-and-tensor-parallel hand plan (15.15 ms a micro-batch) since e38a88f, where
greedy-dag's free choice splits the state over all 64 devices (docs/benchmarks.md, "The 70B layer's regression")."""
from __future__ import annotations

import pytest
from training_helpers import GPU, adam_step

import tapestry
from tapestry import optimizer
from tapestry.egraph.pins import delivered_layouts, pin_layouts, replicated_layouts, steady_picks, steady_ties
from tapestry.extract import extract, ties_hold
from tapestry.extract.selection import dag_cost
from tapestry.optimizer import explore


def test_greedy_dags_steady_picks_pin_the_state_replicated_and_where_its_free_choice_delivered_it():
    """An Adam step whose wide weights greedy-dag's free choice splits: pinned there, its steady pick is cheaper
    than with the state replicated, so the ILP's starts (the cheapest of them is its start: Explored._select) hold
    a cheaper one than a data-parallel step. Each pick is a steady selection (the ties hold), complete (every class
    a chosen node reads is chosen) and priced at its choice's cost: a start the ILP can take as it is."""
    imported, _ = adam_step(512, 2048, 2)
    graph = imported.graph
    explored = explore(graph, tapestry.Mesh(2, 2))
    decoder = explored.decoder
    egraph, ties = steady_ties(decoder, decoder.extraction_graph(list(explored.roots), GPU), graph.carried)
    picked: list[tapestry.extract.EGraph] = []

    def pick(g: tapestry.extract.EGraph) -> tapestry.extract.Selection:
        picked.append(g)
        return extract(g, "greedy-dag")

    starts = steady_picks(decoder, egraph, graph.carried, pick)
    alone = extract(pin_layouts(decoder, egraph, replicated_layouts(decoder, graph.carried), graph.carried),
                    "greedy-dag")  # the state replicated: a data-parallel step
    assert min(start.dag_cost for start in starts) < 0.95 * alone.dag_cost  # 0.447 against 0.488 ms
    replicated, delivered = starts
    free = extract(egraph, "greedy-dag")
    assert egraph in picked  # the free choice, whose delivered layouts the second pick keeps
    layouts = decoder.interner.layouts
    placed = {decoder.nodes[n].key: decoder.nodes[n].layout for n in delivered.choice.values()
              if decoder.nodes[n].op == "Place" and decoder.nodes[n].key in graph.carried.values()}
    assert placed == delivered_layouts(decoder, free, graph.carried)
    for name, layout in ((decoder.nodes[n].key, decoder.nodes[n].layout) for n in replicated.choice.values()
                         if decoder.nodes[n].op == "Place" and decoder.nodes[n].key in graph.carried.values()):
        assert len(set(layouts[layout][1].blocks)) == 1, f"{name} is replicated"
    assert any(len(set(layouts[layout][1].blocks)) > 1 for layout in placed.values())  # some state split
    for start in (replicated, delivered):
        assert ties_hold(start.choice, ties)
        assert all(root in start.choice for root in egraph.roots)
        assert all(d in start.choice for n in start.choice.values() for d in egraph.child_sets[n])
        assert start.dag_cost == pytest.approx(dag_cost(egraph, start.choice), rel=1e-12)


def test_the_ilp_starts_from_greedy_dags_steady_picks_of_the_graph_it_solves(monkeypatch: pytest.MonkeyPatch):
    """A step run as micro-batches is solved with each node weighted by its runs per update (and again under fused
    prices): greedy-dag's picks of one run's costs alone, the starts before, left the 70B layer's first leaner plan
    at 1390.7 ms per update, where its picks of the weighted graph fit at 879.3 (docs/benchmarks.md, pipe70)."""
    imported, _ = adam_step(16, 32, 16)
    explored = explore(imported.graph, tapestry.Mesh(2, 2))
    picked: list[tuple[float, ...]] = []
    solved: list[tuple[float, ...]] = []
    pick, solve = optimizer.steady_picks, optimizer.extract
    monkeypatch.setattr(optimizer, "steady_picks", lambda decoder, egraph, *rest: (
        picked.append(tuple(egraph.node_cost)), pick(decoder, egraph, *rest))[1])
    monkeypatch.setattr(optimizer, "extract", lambda egraph, extractor, *rest: (
        extractor == "ilp" and solved.append(tuple(egraph.node_cost)), solve(egraph, extractor, *rest))[1])
    explored.extract(GPU, "ilp", 5.0, micro_batches=128)
    assert solved and all(costs in picked for costs in solved)


@pytest.mark.slow
def test_the_70b_layers_first_leaner_plan_on_8x8_starts_from_the_state_split_over_every_device():
    """benchmarks/layer_regression.py's layer (LLaMA-2 70B's width, seq 4096, 8 KV heads, micro-batches of 8)
    extracted as plan_pipeline extracts it for 8 stages of 8x8 (128 micro-batches per update, the stage hops
    priced): its fastest plan (data parallel) holds every weight whole, and its first leaner plan was the
    data-and-tensor-parallel hand plan, 1940.2 ms per update, then greedy-dag's state split over all 64 (1390.7 ms
    at 5f3ec5e), now greedy-dag's pick of the graph weighted per update (879.3 ms, 5.91 GB under 6.15)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from layer_regression import PROFILE, layer_graph

    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.pipeline import planner

    model = DefaultCostModel(load_profile(PROFILE))
    graph = layer_graph("70B", 4096, 8, 8)
    link = model.profile.axis_links((8, 8, 8))[0]
    tried = planner.configurations(8, 128, 80, planner.SCHEDULES, planner.CHUNKS)
    ranking = planner.BoundaryPriced.of(model, graph, link, planner.exposed_share(tried, 80, 128))
    explored = explore(graph, tapestry.Mesh(8, 8))
    fastest = explored.extract(ranking, "ilp", planner.LAYER_TIME_LIMIT, micro_batches=128)
    leaner = next(explored.leaner_plans(fastest, ranking, "ilp", planner.LAYER_TIME_LIMIT, 128))
    assert leaner.plan.notes["accumulated_cost"] < 0.9
