"""Steady state: an output carried to the next step (a training step's updated weight) comes out in the layout its
input was placed in, so the step repeats without moving it."""
from __future__ import annotations

import math

import pytest

import tapestry
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.cost.memory import layout_bytes
from tapestry.graph import Graph, GraphError, graph_from_json, graph_to_json
from tapestry.optimizer import explore, steady_violations
from tapestry.plan import Place
from tapestry.sharding import Layout, Mesh

MESH = Mesh(4)


class WeightsLiveSplit:
    """The gpu model, but placing more than a device's share of w costs a second (so w wants to sit split)."""

    def __init__(self) -> None:
        self.base = DefaultCostModel(load_profile("gpu-h100-nccl"))

    def step_cost(self, step, mesh):
        if isinstance(step, Place) and step.input == "w":
            return 1.0 if max(layout_bytes(step.layout, "float32")) > math.prod(step.shape) * 4 / mesh.size else 0.0
        return self.base.step_cost(step, mesh)


def stepped() -> Graph:
    """y reads w; new.w, w's next value, is carried."""
    g = Graph()
    x, w = g.input("x", (4096, 128)), g.input("w", (128, 128))
    g.output("y", g.softmax(g.matmul(x, w), axis=-1))
    g.output("new.w", g.mul_scalar(w, value=0.5))
    g.carry("new.w", "w")
    return g


def placed(plan, name: str) -> Layout:
    return next(s.layout for s in plan.steps if isinstance(s, Place) and s.input == name)


def test_a_carried_output_comes_out_where_its_input_was_placed():
    explored = explore(stepped(), MESH)
    want = {"outputs": {"new.w": "replicated"}, "cost_model": WeightsLiveSplit()}
    free = explored.extract(steady={}, **want).plan  # w placed split for free, its update gathered for delivery
    assert placed(free, "w") != Layout.replicated((128, 128), MESH)
    assert steady_violations(free, {"new.w": "w"})
    steady = explored.extract(**want).plan  # steady by default: the graph carries new.w to w
    assert placed(steady, "w") == Layout.replicated((128, 128), MESH)
    assert not steady_violations(steady, {"new.w": "w"})
    assert steady.cost >= 1.0  # it pays for placing w whole: there is no cheaper steady plan


@pytest.mark.parametrize("extractor", ["greedy-dag", "bottom-up"])
def test_greedy_extractors_keep_steady_state_by_pinning_the_layout_they_delivered_the_output_in(extractor):
    # unconstrained, w is placed split and new.w gathered for delivery: pinned to the delivered layout
    plan = tapestry.optimize(stepped(), MESH, extractor=extractor, cost_model=WeightsLiveSplit(),
                             outputs={"new.w": "replicated"}).plan
    assert not steady_violations(plan, {"new.w": "w"})
    assert placed(plan, "w") == Layout.replicated((128, 128), MESH)


class WeightsPlacedWhole:
    """The gpu model, but w cannot be placed split (as where a budget left the moves out of its split layouts
    unpriced), while its update is cheapest computed, and delivered, split."""

    def __init__(self) -> None:
        self.base = DefaultCostModel(load_profile("gpu-h100-nccl"))

    def step_cost(self, step, mesh):
        if isinstance(step, Place) and step.input == "w" and step.layout != Layout.replicated(step.shape, mesh):
            return math.inf
        return self.base.step_cost(step, mesh)


def test_greedy_extractors_pin_the_replicated_layout_where_the_delivered_one_leaves_no_plan():
    explored = explore(stepped(), MESH)
    free = explored.extract(WeightsPlacedWhole(), extractor="greedy-dag", steady={}).plan
    assert steady_violations(free, {"new.w": "w"})  # the update delivered split, where w cannot be placed
    plan = explored.extract(WeightsPlacedWhole(), extractor="greedy-dag").plan
    assert not steady_violations(plan, {"new.w": "w"})
    assert placed(plan, "w") == Layout.replicated((128, 128), MESH)


class WeightsDearSplit(WeightsPlacedWhole):
    """w can be placed split, at a second's cost, while its update is cheapest delivered split."""

    def step_cost(self, step, mesh):
        cost = super().step_cost(step, mesh)
        return 1.0 if math.isinf(cost) else cost


def test_greedy_extractors_keep_the_cheaper_of_the_delivered_and_the_replicated_pins():
    """Pinned where the free choice delivered the update (split), w must be placed split every step, dearer than
    keeping it whole and gathering the update: the replicated pins win."""
    explored = explore(stepped(), MESH)
    free = explored.extract(WeightsDearSplit(), extractor="greedy-dag", steady={}).plan
    assert placed(free, "w") == Layout.replicated((128, 128), MESH) and steady_violations(free, {"new.w": "w"})
    plan = explored.extract(WeightsDearSplit(), extractor="greedy-dag").plan
    assert not steady_violations(plan, {"new.w": "w"})
    assert placed(plan, "w") == Layout.replicated((128, 128), MESH)
    assert plan.cost < 1.0


def test_steady_state_can_be_asked_for_outputs_the_graph_does_not_carry():
    g = stepped()
    g.carried.clear()
    plan = tapestry.optimize(g, MESH, steady={"new.w": "w"}, outputs={"new.w": "replicated"},
                             cost_model=WeightsLiveSplit()).plan
    assert placed(plan, "w") == Layout.replicated((128, 128), MESH)


def test_carried_pairs_survive_saving_the_graph():
    assert graph_from_json(graph_to_json(stepped())).carried == {"new.w": "w"}


@pytest.mark.parametrize("output, input, message", [
    ("z", "w", "'z' is not an output"),
    ("new.w", "v", "'v' is not an input"),
    ("y", "w", r"output 'y' is float32\[4096, 128\] but input 'w' is float32\[128, 128\]"),
])
def test_a_carry_that_cannot_repeat_is_refused(output, input, message):
    with pytest.raises(GraphError, match=message):
        tapestry.optimize(stepped(), MESH, steady={output: input})


def test_an_input_carried_twice_is_refused():
    g = stepped()
    g.output("also.w", g.mul_scalar("w", value=0.25))
    with pytest.raises(GraphError, match="'w' is carried by more than one output"):
        tapestry.optimize(g, MESH, steady={"new.w": "w", "also.w": "w"})
