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
