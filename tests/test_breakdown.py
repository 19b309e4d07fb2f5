"""A plan's predicted time split by phase and kind (cost.breakdown): the parts add up to plan_cost, each step is
filed where its roofline bound says, and a training step's phases are its forward, backward and update."""
from __future__ import annotations

import pytest
from training_helpers import ARGUMENTS, GPU, adam_step

import tapestry
from tapestry.cost import plan_cost, step_costs
from tapestry.cost.breakdown import FUSED, HIDDEN, breakdown, phases
from tapestry.cost.model import from_costs
from tapestry.cost.overlap import overlap
from tapestry.graph import Graph
from tapestry.plan import Compute, Place, build_plan
from tapestry.training.plans import data_parallel

DEVICE = GPU.profile.device


def test_the_parts_of_a_data_parallel_adam_step_add_up_to_its_plan_cost():
    plan = data_parallel(adam_step(64, 256, 4096)[0].graph, tapestry.Mesh(4), ARGUMENTS)
    found = breakdown(plan, GPU, DEVICE)
    assert found.total == pytest.approx(plan_cost(plan, GPU))
    costs = step_costs(plan, GPU)
    assert found.seconds["step", HIDDEN] == pytest.approx(-overlap(plan, from_costs(costs)).hidden)
    saved = sum(costs.values()) - sum(GPU.step_cost(plan.by_id[v], plan.mesh) for v in costs)
    assert sum(s for (_, kind), s in found.seconds.items() if kind == FUSED) == pytest.approx(saved)
    assert saved < 0  # the backward's and the update's elementwise chains
    assert found.seconds["step", HIDDEN] < 0
    assert found.seconds["backward", "all_reduce"] > 0  # the gradients' reductions
    launches = sum(n for (_, kind), n in found.count.items() if kind == "launch")
    computing = [s for s in plan.steps if isinstance(s, Compute) and not s.signature.kernel.is_view]
    assert launches == len(computing)
    assert sum(s for (_, kind), s in found.seconds.items() if kind == "launch") == pytest.approx(
        len(computing) * DEVICE.launch_overhead)


def test_an_adam_step_has_its_update_apart_from_forward_and_backward():
    plan = build_plan(adam_step(64, 256, 64)[0].graph, tapestry.Mesh(1))
    phase = phases(plan)
    moments = [s.out for s in plan.steps if isinstance(s, Place) and s.input.startswith("adam.")]
    assert moments and all(phase[v] == "update" for v in moments)
    weights = [s for s in plan.steps if isinstance(s, Place) and s.input.endswith("weight")
               and not s.input.startswith("adam.")]
    assert all(phase[s.out] == "forward" for s in weights)
    assert {phase[s.out] for s in plan.steps} == {"forward", "backward", "update"}
    found = breakdown(plan, GPU, DEVICE)
    assert {p for p, _ in found.seconds} == {"forward", "backward", "update"}  # one device: nothing to reduce


def test_a_large_bfloat16_matmul_is_compute_bound_and_an_add_memory_bound():
    g = Graph()
    x, w = g.input("x", (4096, 4096), dtype="bfloat16"), g.input("w", (4096, 4096), dtype="bfloat16")
    g.output("y", g.add(g.matmul(x, w), x))
    found = breakdown(build_plan(g, tapestry.Mesh(1)), GPU, DEVICE)
    assert set(found.seconds) == {("forward", "compute-bound bfloat16"), ("forward", "memory-bound"),
                                  ("forward", "launch")}
    assert found.model_seconds == pytest.approx(2 * 4096**3 / DEVICE.peak("bfloat16"), rel=1e-3)
    assert found.seconds["forward", "compute-bound bfloat16"] == pytest.approx(found.model_seconds, rel=1e-3)


def test_an_expert_parallel_steps_flops_are_its_rows_with_every_expert_as_a_row_split_steps_are():
    """An exchanged grouped_mm computes its rows against every expert of its group (on their devices): the FLOPs
    an MFU of 100% would take are the row split's, not its own block's (its rows with its experts only)."""
    from tapestry.models import moe_layer
    from tapestry.sharding import Mesh
    from tapestry.sharding.partition import make_partition

    graph = moe_layer(64, 32, 64, 4, 2, "bfloat16")
    sig, mesh = graph.signature("experts_up"), Mesh(4)
    ep = build_plan(graph, mesh, partitions={"experts_up": make_partition(sig, mesh, (None,), exchange=(0,))})
    rows = build_plan(graph, mesh, {"experts_up": ("row",)})
    assert breakdown(ep, GPU, GPU.profile.device).model_seconds == pytest.approx(
        breakdown(rows, GPU, GPU.profile.device).model_seconds)


def test_steps_alike_but_for_their_names_are_priced_once_and_break_down_as_each_alone(monkeypatch):
    """An expanded plan's copies run copy 1's steps under other names, sharing their blocks: `breakdown` prices and
    classifies each such step once (`alike_key`), and says what it says of the same plan whose steps share
    nothing (each priced alone)."""
    import dataclasses

    from tapestry.cost.model import alike_key
    from tapestry.plan import Plan

    g = Graph()
    value = g.input("x", (4096, 1024), dtype="bfloat16")
    for k in range(4):
        value = g.relu(g.matmul(value, g.input(f"w{k}", (1024, 1024), dtype="bfloat16")), name=f"act{k}")
    g.output("y", value)
    mesh = tapestry.Mesh(4)
    plan = build_plan(g, mesh, {f"act{k}": (0,) for k in range(4)})
    first = {}  # binding -> the first such step's blocks, which the later alike steps share as copies do
    steps = []
    for s in plan.steps:
        if isinstance(s, Compute):
            s = dataclasses.replace(s, blocks=first.setdefault(s.binding, s.blocks))
        steps.append(s)
    shared = Plan(mesh, g, tuple(steps), plan.outputs)
    alone = Plan(mesh, g, tuple(dataclasses.replace(s, blocks=tuple(list(s.blocks))) if isinstance(s, Compute)
                                else s for s in steps), plan.outputs)
    priced = []
    step_cost = type(GPU).step_cost
    monkeypatch.setattr(type(GPU), "step_cost", lambda self, s, m: priced.append(s.out) or step_cost(self, s, m))
    once = breakdown(shared, GPU, DEVICE)
    shared_calls = len(priced)
    priced.clear()
    each = breakdown(alone, GPU, DEVICE)
    assert once == each
    assert once.total == pytest.approx(plan_cost(plan, GPU))
    per_run = [s for s in shared.steps if s.out not in shared.prepared]
    distinct = {alike_key(s) for s in per_run}
    unplaced = {alike_key(s) for s in per_run if not isinstance(s, Place)}
    assert len(unplaced) < sum(not isinstance(s, Place) for s in per_run)
    assert shared_calls == len(distinct) + len(unplaced)  # step_costs' prices, then the breakdown's own
