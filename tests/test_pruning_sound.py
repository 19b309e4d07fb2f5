"""Pruning is sound: the optimizer leaves out dominated reshards, dominated Runs (decode.dominated_runs), dominated
e-nodes and layouts no candidate makes, yet no plan `build_plan` can build from any per-op choice of split dims is
cheaper than the optimizer's plan (issue 12: "a brute force over build_plan choices finds nothing cheaper"). Runs
are left out only where plan time is a plain sum of node costs."""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import pytest
from training_helpers import adam_step

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.egraph.decode import Decoder
from tapestry.extract import extract
from tapestry.graph import Graph
from tapestry.models import transformer_stack
from tapestry.optimizer import Explored, default_cost_model
from tapestry.plan import Plan
from tapestry.plan.build import build_plan
from tapestry.sharding import Layout, Mesh

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


@functools.cache
def buildable_plans(build: Callable[[], Graph], mesh: Mesh) -> tuple[Plan, ...]:
    """Every plan `build_plan` makes of the graph `build` makes from each op's choice of index dim (or none) per
    mesh axis: made once, priced under each cost model (building is most of the brute force)."""
    graph = build()
    options = []
    for op in graph.ops:
        dims = (None, *range(len(graph.signature(op.name).dims)))
        options.append([tuple(choice) for choice in itertools.product(dims, repeat=mesh.ndim)])
    plans = []
    for choices in itertools.product(*options):
        try:
            plans.append(build_plan(graph, mesh, axes={op.name: c for op, c in zip(graph.ops, choices)}))
        except ValueError:  # a dim that does not split evenly, or one split twice
            continue
    return tuple(plans)


def brute_force(build: Callable[[], Graph], mesh: Mesh, model: DefaultCostModel) -> float:
    """The cheapest plan over every op's choice of index dim (or none) per mesh axis."""
    return min((plan_cost(plan, model) for plan in buildable_plans(build, mesh)), default=float("inf"))


@functools.cache
def explored(build: Callable[[], Graph], mesh: Mesh) -> Explored:
    """The optimizer's exploration of the graph `build` makes, once per graph and mesh: each cost model's case
    extracts from it (`tapestry.optimize` is `explore(...).extract(...)`)."""
    return tapestry.explore(build(), mesh, rules=[])


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", [Mesh(2), Mesh(4), Mesh((2, 2))], ids=str)
@pytest.mark.parametrize("build", [mlp, attention_scores, residual], ids=lambda f: f.__name__)
def test_no_build_plan_choice_beats_the_optimizer(build, mesh, model):
    found = explored(build, mesh).extract(MODELS[model], time_limit=20)
    assert found.selection.status == "optimal"
    assert found.plan.cost <= brute_force(build, mesh, MODELS[model]) * (1 + 1e-9)



def big_matmul() -> Graph:
    g = Graph()
    g.output("y", g.matmul(g.input("x", (8192, 512)), g.input("w", (512, 2048)), name="mm"))
    return g


def replicated_runs(decoder: Decoder) -> list[str]:
    """The ids of the Run nodes whose output is replicated: every device computes the whole op."""
    def replicated(key: str) -> bool:
        shape, layout = decoder.interner.layouts[key]
        return layout == Layout.replicated(shape, decoder.mesh)
    return [node.id for node in decoder.nodes if node.op not in ("Place", "Reshard", "Deliver")
            and replicated(node.layout)]


def run_costs(explored: Explored, drop_dominated: bool) -> dict[str, float]:
    priced = explored.decoder.serialized(list(explored.roots), default_cost_model(), drop_dominated=drop_dominated)
    return {n: node["cost"] for n, node in priced["nodes"].items()}


def test_the_replicated_run_of_a_large_matmul_is_dropped():
    """Each of 4 devices multiplying a quarter of x's rows, then gathering y, beats each multiplying all of x."""
    explored = tapestry.explore(big_matmul(), Mesh(4), rules=[])
    (run,) = replicated_runs(explored.decoder)
    assert run_costs(explored, drop_dominated=False)[run] < math.inf
    assert run_costs(explored, drop_dominated=True)[run] == math.inf


def test_no_run_is_dropped_under_a_memory_budget():
    """The route that replaces a dropped Run holds more layouts, which a budget may not fit."""
    explored = tapestry.explore(big_matmul(), Mesh(4), rules=[])
    (run,) = replicated_runs(explored.decoder)
    assert run_costs(explored, drop_dominated=True)[run] == math.inf  # dropped where nothing forbids it
    explored.extract(memory_budget=10**12)
    assert explored.decoder.pricing.runs_dominated == explored.decoder.pricing.reshards_dominated == 0


def test_no_run_is_dropped_for_a_training_step():
    """A training step's time credits backward Runs against gradient reductions (cost.overlap): a cheaper Run
    plus moves can hide less. The same e-graph has Runs to drop when asked to."""
    explored = tapestry.explore(adam_step(64, 256, 4096)[0].graph, Mesh(4))
    assert explored.graph.carried
    run_costs(explored, drop_dominated=True)
    assert explored.decoder.pricing.runs_dominated > 0
    explored.extract(time_limit=20)
    assert explored.decoder.pricing.runs_dominated == 0


def mlp_rows(rows: int) -> Graph:
    g = Graph()
    x, w1, w2 = g.input("x", (rows, 256)), g.input("w1", (256, 256)), g.input("w2", (256, 256))
    g.output("y", g.matmul(g.relu(g.matmul(x, w1, name="up"), name="act"), w2, name="down"))
    return g


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("outputs", ["any", "replicated"])
@pytest.mark.parametrize("rows", [64, 8192])
def test_the_optimum_with_dropped_runs_is_the_optimum_without(rows, outputs, model):
    """A memory budget that binds nothing turns pruning off. Gathering replicated outputs is where a Run that
    is cheaper only before its output's move must not replace the replicated one (64 rows)."""
    explored = tapestry.explore(mlp_rows(rows), Mesh(4), rules=[])
    pruned = explored.extract(MODELS[model], outputs=outputs, time_limit=20)
    every = explored.extract(MODELS[model], outputs=outputs, time_limit=20, memory_budget=10**12)
    assert pruned.selection.status == every.selection.status == "optimal"
    assert pruned.plan.cost == pytest.approx(every.plan.cost, rel=1e-9)


@pytest.mark.parametrize("mesh", [Mesh(4), Mesh((2, 2))], ids=str)
def test_the_ilp_optimum_of_a_transformer_block_is_the_same_without_dominated_runs_and_moves(mesh):
    """All rules on: several logical ops make each value."""
    explored = tapestry.explore(transformer_stack(1, 4, 256, 1024, 16), mesh)
    every = extract(explored.decoder.extraction_graph(list(explored.roots), default_cost_model()), "ilp", 60)
    lean = extract(explored.decoder.extraction_graph(list(explored.roots), default_cost_model(), drop_dominated=True),
                   "ilp", 60)
    assert explored.decoder.pricing.runs_dominated > 0
    assert every.status == lean.status == "optimal"
    assert lean.dag_cost == pytest.approx(every.dag_cost, rel=1e-9)
