"""The n-D hand recipes (DPxTP, DPxEP, DPx(TP+EP): data over a mesh's outer axes, tensor or expert parallel over the
last) where the batch does not divide the outer devices (issue 24: Mixtral's and LLaMA's batch 8 over 4x8x8's 32
outer devices). The batch splits over the outer axes as far as it divides and the sequence over the rest, so no
outer device repeats another's work; before, DPxTP was not built at all there, and DPxEP ran its data part
replicated over every outer axis (benchmarks/cluster.py priced it on the flattened grid instead)."""
from __future__ import annotations

import pytest
from experts_helpers import tiny_mixtral_step
from test_layers_fold import llama_step

import tapestry
from tapestry import verify
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.graph import Graph
from tapestry.plan import Place
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Layout, Mesh
from tapestry.training.plans import baselines, step_arguments

CLUSTER = DefaultCostModel(load_profile("gpu-h100-cluster"))
DENSE = ("data and tensor parallel",)
MOE = ("data and tensor parallel", "data and expert parallel", "data, tensor and expert parallel")
# batch 2, sequence 8: on 2x2x2 the batch divides axis 0 and the sequence takes axis 1; on 4x2x2 the batch divides
# axis 1 only (2 of 4 fails) and the sequence takes axis 0
SPLITS = {(2, 2, 2): (0, 1, None), (4, 2, 2): (1, 0, None)}


@pytest.fixture(scope="module")
def steps() -> dict[str, tuple[Graph, dict]]:
    """A tiny LLaMA's Adam step and a tiny Mixtral's SGD step, both batch 2, sequence 8, with their inputs."""
    dense = llama_step(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        imported, args = tiny_mixtral_step(monkeypatch, batch=2)
    return {"dense": (dense, tapestry.random_inputs(dense)), "moe": (imported.graph, imported.inputs(*args))}


@pytest.mark.parametrize("shape", list(SPLITS), ids=str)
@pytest.mark.parametrize("kind, recipes", [("dense", DENSE), ("moe", MOE)])
def test_the_n_d_recipes_split_the_batch_as_far_as_it_divides_and_the_sequence_over_the_rest_and_simulate(
        steps, kind, recipes, shape):
    graph, given = steps[kind]
    mesh = Mesh(*shape)
    hands = baselines(graph, mesh)
    want = tapestry.evaluate(graph, given)
    for name in recipes:
        plan = hands[name]
        validate_plan(plan)
        placed = {s.input: s.layout for s in plan.steps if isinstance(s, Place) and s.input in step_arguments(graph)}
        assert placed and all(layout == Layout.split(graph[arg].shape, mesh, SPLITS[shape])
                              for arg, layout in placed.items()), name
        errors = verify.compare(simulate(plan, given), want, graph, plan)
        assert all(e.ok for e in errors.values()), (name, errors)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SPLITS), ids=str)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_optimizers_plan_is_no_dearer_than_any_n_d_recipe_on_the_same_mesh(steps, kind, shape):
    graph, _ = steps[kind]
    mesh = Mesh(*shape)
    plan = tapestry.optimize(graph, mesh, cost_model=CLUSTER).plan
    for name, hand in baselines(graph, mesh).items():
        assert plan.cost <= plan_cost(hand, CLUSTER) * (1 + 1e-9), name


@pytest.mark.parametrize("shape", list(SPLITS), ids=str)
def test_a_moes_floor_also_holds_dp_x_ep_with_the_sequence_whole_where_the_batch_does_not_divide(steps, shape):
    """Mixtral's step on 8x8x8 (batch 8 over 64 outer devices): DPxEP with the sequence split over the outer axes the
    batch leaves prices 67.4 ms, with it whole there 57.4 (benchmarks/cluster.py): the floor holds both. The batch
    splits as far as it divides, nothing else over the outer axes; the plan computes the step."""
    graph, given = steps["moe"]
    mesh = Mesh(*shape)
    plan = baselines(graph, mesh)["data and expert parallel, sequence whole"]
    validate_plan(plan)
    batch_axis = SPLITS[shape].index(0)
    whole = tuple(0 if axis == batch_axis else None for axis in range(mesh.ndim))
    placed = {s.input: s.layout for s in plan.steps if isinstance(s, Place) and s.input in step_arguments(graph)}
    assert placed and all(layout == Layout.split(graph[arg].shape, mesh, whole) for arg, layout in placed.items())
    errors = verify.compare(simulate(plan, given), tapestry.evaluate(graph, given), graph, plan)
    assert all(e.ok for e in errors.values()), errors


@pytest.mark.parametrize("shape", list(SPLITS), ids=str)
def test_a_moes_floor_also_holds_dp_x_tp_ep_with_the_data_part_whole_over_the_outer_axes(steps, shape):
    """Mixtral's step on 8x8x8: DPx(TP+EP) with its data part whole over the 64 outer devices (each node a replica,
    the recipe before the batch split as far as it divides) prices 52.1 ms, under DPxEP with the sequence whole
    (57.4), where the search returned 57.3 (benchmarks/cluster.py): the floor holds it where the batch does not
    divide the outer devices. Nothing splits over the outer axes; the plan computes the step."""
    graph, given = steps["moe"]
    mesh = Mesh(*shape)
    plan = baselines(graph, mesh)["data, tensor and expert parallel, outer whole"]
    validate_plan(plan)
    placed = {s.input: s.layout for s in plan.steps if isinstance(s, Place) and s.input in step_arguments(graph)}
    assert placed and all(layout == Layout.replicated(graph[arg].shape, mesh) for arg, layout in placed.items())
    outer = mesh.fibres((0, 1))  # devices along the outer axes: each holds what the others do
    assert all(len({s.layout.blocks[r] for r in ranks}) == 1 for s in plan.steps if isinstance(s, Place)
               for ranks in outer)
    errors = verify.compare(simulate(plan, given), tapestry.evaluate(graph, given), graph, plan)
    assert all(e.ok for e in errors.values()), errors
