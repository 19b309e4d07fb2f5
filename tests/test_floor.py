"""The whole-space floor (cost.floor.step_floor): no plan of the graph on the mesh is priced below it, whatever
the search made, the extractor chose, fusion merged, the overlap hid or a rule rewrote; and it is close to the best
plan where the best plan is obvious (issue 24: a cut search's gap proves nothing; the floor does)."""
from __future__ import annotations

import numpy as np
import pytest
from experts_helpers import tiny_mixtral_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_end_to_end import DETERMINISTIC
from training_helpers import adam_step

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.cost.floor import gap_to_floor, step_floor
from tapestry.egraph.driver import Budget
from tapestry.optimizer import SearchCutWarning, explore
from tapestry.plan import Compute
from tapestry.sharding import Mesh
from tapestry.testing.graphs import RandomCost, block_graphs
from tapestry.training.plans import baselines

MODELS = {name: DefaultCostModel(load_profile(name)) for name in ("gpu-h100-nccl", "gpu-h100-cluster", "cpu-gloo")}


def mlp(batch: int = 16, width: int = 1024) -> tapestry.Graph:
    """Two matmuls of a [batch, 256, width] activation: no rule rewrites them (3-D), nothing else to price."""
    g = tapestry.Graph()
    x = g.input("x", (batch, 256, width))
    h = g.matmul(x, g.input("w1", (width, 4 * width)))
    g.output("y", g.matmul(h, g.input("w2", (4 * width, width))))
    return g


def under(floor: float | None, cost: float) -> bool:
    return floor is not None and floor <= cost * (1 + 1e-12)


@pytest.mark.parametrize("profile, mesh", [
    ("gpu-h100-nccl", Mesh(4)), ("gpu-h100-cluster", Mesh(2, 2)), ("cpu-gloo", Mesh(4)),
    pytest.param("gpu-h100-cluster", Mesh(2, 2, 2), marks=pytest.mark.slow),  # 20 CPU s
    pytest.param("cpu-gloo", Mesh(2, 2, 2), marks=pytest.mark.slow)], ids=str)  # 110 CPU s
def test_the_floor_is_under_every_plan_optimize_returns_and_every_hand_plan_of_a_training_step(profile, mesh):
    model = MODELS[profile]
    imported, _ = adam_step(64, 256, 64)
    graph = imported.graph
    result = tapestry.optimize(graph, mesh, cost_model=model, time_limit=5)
    assert result.floor is not None and result.floor > 0
    assert under(result.floor, result.plan.cost) and under(result.floor, plan_cost(result.plan, model))
    hands = baselines(graph, mesh)
    assert hands
    for name, hand in hands.items():
        assert under(result.floor, plan_cost(hand, model)), name


@pytest.mark.slow  # 64 CPU s
def test_the_floor_is_under_a_mixtral_steps_plan_and_its_expert_parallel_hand_plan(monkeypatch):
    imported, _ = tiny_mixtral_step(monkeypatch, batch=4)
    model, mesh = MODELS["gpu-h100-cluster"], Mesh(2, 2)
    result = tapestry.optimize(imported.graph, mesh, cost_model=model, time_limit=5)
    assert under(result.floor, result.plan.cost)
    for name, hand in baselines(imported.graph, mesh).items():
        assert under(result.floor, plan_cost(hand, model)), name


def test_the_floor_holds_where_the_search_was_cut_and_is_the_same_floor():
    """The floor needs only the graph, mesh and model: a starved search's plan is above the same floor."""
    imported, _ = adam_step(64, 256, 64)
    model, mesh = MODELS["gpu-h100-nccl"], Mesh(2, 2)
    with pytest.warns(SearchCutWarning):
        cut = tapestry.optimize(imported.graph, mesh, cost_model=model, budget=Budget(nodes=10), time_limit=5)
    full = tapestry.optimize(imported.graph, mesh, cost_model=model, time_limit=5)
    assert cut.status.startswith("stopped")
    assert cut.floor == full.floor == step_floor(imported.graph, mesh, model)
    assert under(cut.floor, cut.plan.cost)
    assert cut.gap_to_floor >= full.gap_to_floor


@settings(max_examples=12, **DETERMINISTIC)
@given(graph=block_graphs(max_ops=5), seed=st.integers(0, 2**16))
def test_random_plans_of_random_programs_cost_no_less_than_the_floor(graph, seed):
    """Plans extracted under random costs (partial sums, halos, replicated work, reshards) and the optimiser's own,
    every kernel drawn, priced by each profile's model (fusion groups and overlap included)."""
    for mesh in (Mesh(4), Mesh(2, 2)):
        explored = explore(graph, mesh)
        plans = [explored.extract(RandomCost(seed + k), extractor="greedy-dag").plan for k in range(2)]
        for model in MODELS.values():
            floor = step_floor(graph, mesh, model)
            for plan in [*plans, explored.extract(model, time_limit=5).plan]:
                assert under(floor, plan_cost(plan, model)), (str(mesh), graph)


def matmuls(plan: tapestry.Plan) -> int:
    return sum(isinstance(s, Compute) and s.kernel == "matmul" and s.out not in plan.prepared for s in plan.steps)


def test_the_floor_is_under_plans_whose_rewrites_do_fewer_flops():
    """a @ b + a @ c = a @ (b + c) (one matmul for two), (x @ w) @ v = x @ (w @ v) (the weight product prepared), and
    expand(x) @ w = expand(x @ w): the plans take the cheaper forms, and the floor stays under them."""
    model, mesh = MODELS["gpu-h100-nccl"], Mesh(2, 2)
    distributive = tapestry.Graph()
    a = distributive.input("a", (2048, 2048))
    distributive.output("y", distributive.add(distributive.matmul(a, distributive.input("b", (2048, 2048))),
                                              distributive.matmul(a, distributive.input("c", (2048, 2048)))))
    chain = tapestry.Graph()
    w, v = chain.input("w", (2048, 2048), static=True), chain.input("v", (2048, 64), static=True)
    chain.output("y", chain.matmul(chain.matmul(chain.input("x", (4096, 2048)), w), v))
    broadcast = tapestry.Graph()
    x = broadcast.expand(broadcast.input("x", (1, 512, 1024)), shape=(64, 512, 1024))
    broadcast.output("y", broadcast.matmul(x, broadcast.input("w", (1024, 1024))))
    for graph, most in ((distributive, 1), (chain, 1), (broadcast, 1)):
        result = tapestry.optimize(graph, mesh, cost_model=model, time_limit=5)
        assert matmuls(result.plan) <= most, graph
        assert under(result.floor, result.plan.cost), graph


@pytest.mark.parametrize("profile", ["gpu-h100-nccl", "cpu-gloo"])
def test_a_matmul_only_graphs_data_parallel_plan_is_within_one_percent_of_the_floor(profile):
    model = MODELS[profile]
    result = tapestry.optimize(mlp(), Mesh(8), cost_model=model, time_limit=5)
    assert result.gap_to_floor is not None and 0.0 <= result.gap_to_floor < 0.01  # 0.0 measured: the plan is the floor
    assert result.gap_to_floor == gap_to_floor(result.plan.cost, result.floor)


def test_explain_gives_the_gap_within_the_space_searched_and_to_the_whole_space_floor():
    result = tapestry.optimize(mlp(2, 64), Mesh(2), cost_model=MODELS["gpu-h100-nccl"], time_limit=5)
    head = result.explain().splitlines()[0]
    assert "within the space searched" in head and f"{result.gap_to_floor:.2%} to the whole-space floor" in head


def test_no_floor_for_a_cost_model_it_does_not_know_or_rules_it_does_not_cover(tmp_path):
    graph = mlp(2, 16)
    assert step_floor(graph, Mesh(2), RandomCost(0)) is None
    result = tapestry.optimize(graph, Mesh(2), cost_model=RandomCost(0), time_limit=5)
    assert result.floor is None and result.gap_to_floor is None and "floor" not in result.explain().splitlines()[0]
    rules = tmp_path / "relu.egg"
    rules.write_text("(rewrite (Relu (Relu x)) (Relu x))\n")
    assert tapestry.optimize(graph, Mesh(2), rules=[rules], cost_model=MODELS["cpu-gloo"]).floor is None


def test_prepared_ops_and_repeated_terms_cost_nothing_extra():
    """An op of static inputs alone runs ahead of time (0), and an op the graph computes twice is one e-class."""
    model, mesh = MODELS["gpu-h100-nccl"], Mesh(4)
    g = tapestry.Graph()
    x = g.input("x", (4, 256, 1024))  # 3-D: no associativity
    w = g.matmul(g.input("w1", (1024, 1024), static=True), g.input("w2", (1024, 1024), static=True))
    g.output("y", g.add(g.matmul(x, w), g.matmul(x, w)))
    once = tapestry.Graph()
    once.output("y", once.matmul(once.input("x", (4, 256, 1024)), once.input("w", (1024, 1024))))
    assert np.isclose(step_floor(g, mesh, model), step_floor(once, mesh, model))


def test_a_fusible_ops_delivered_value_is_written_once_unless_a_rule_folds_it_into_the_linear():
    """relu(x) delivered: no FLOPs or launch, but its output leaves any fusion group (bytes over n at bandwidth);
    relu(linear(x)) is one linear_relu kernel (fusion.egg): the relu adds nothing to the linear's floor."""
    model, mesh = MODELS["gpu-h100-nccl"], Mesh(4)
    device = model.profile.device
    alone = tapestry.Graph()
    alone.output("y", alone.relu(alone.input("x", (1024, 1024))))
    assert np.isclose(step_floor(alone, mesh, model), 1024 * 1024 * 4 / 4 / device.mem_bandwidth)
    assert under(step_floor(alone, mesh, model), tapestry.optimize(alone, mesh, cost_model=model).plan.cost)
    linear, folded = tapestry.Graph(), tapestry.Graph()
    for g, act in ((linear, False), (folded, True)):
        y = g.linear(g.input("x", (4, 256, 1024)), g.input("w", (1024, 1024)), g.input("b", (1024,)))
        g.output("y", g.relu(y) if act else y)
    assert np.isclose(step_floor(folded, mesh, model), step_floor(linear, mesh, model))
