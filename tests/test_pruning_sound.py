"""Pruning is sound: the optimizer leaves out dominated reshards, dominated e-nodes and layouts no candidate makes,
yet no plan `build_plan` can build from any per-op choice of split dims is cheaper than the optimizer's plan
(issue 12: "a brute force over build_plan choices finds nothing cheaper")."""
from __future__ import annotations

import itertools

import pytest

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.graph import Graph
from tapestry.plan.build import build_plan
from tapestry.sharding import Mesh

MODELS = {name: DefaultCostModel(load_profile(name)) for name in ("cpu-gloo", "gpu-h100-nccl")}


def mlp() -> Graph:
    g = Graph()
    x, w1, w2 = g.input("x", (8192, 512)), g.input("w1", (512, 2048)), g.input("w2", (2048, 512))
    g.output("y", g.matmul(g.relu(g.matmul(x, w1, name="up"), name="act"), w2, name="down"))
    return g


def attention_scores() -> Graph:
    g = Graph()
    q, k = g.input("q", (16, 1024, 64)), g.input("k", (16, 64, 1024))
    g.output("p", g.softmax(g.matmul(q, k, name="qk"), axis=-1, name="sm"))
    return g


def residual() -> Graph:
    g = Graph()
    x, w = g.input("x", (8192, 1024)), g.input("w", (1024, 1024))
    g.output("y", g.add(x, g.matmul(x, w, name="mm"), name="res"))
    return g


def brute_force(graph: Graph, mesh: Mesh, model: DefaultCostModel) -> float:
    """The cheapest plan over every op's choice of index dim (or none) per mesh axis."""
    options = []
    for op in graph.ops:
        dims = (None, *range(len(graph.signature(op.name).dims)))
        options.append([tuple(choice) for choice in itertools.product(dims, repeat=mesh.ndim)])
    best = float("inf")
    for choices in itertools.product(*options):
        try:
            plan = build_plan(graph, mesh, axes={op.name: c for op, c in zip(graph.ops, choices)})
        except ValueError:  # a dim that does not split evenly, or one split twice
            continue
        best = min(best, plan_cost(plan, model))
    return best


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", [Mesh(2), Mesh(4), Mesh((2, 2))], ids=str)
@pytest.mark.parametrize("build", [mlp, attention_scores, residual], ids=lambda f: f.__name__)
def test_no_build_plan_choice_beats_the_optimizer(build, mesh, model):
    graph = build()
    found = tapestry.optimize(graph, mesh, rules=[], cost_model=MODELS[model], time_limit=20)
    assert found.selection.status == "optimal"
    assert found.plan.cost <= brute_force(graph, mesh, MODELS[model]) * (1 + 1e-9)
