"""A training step's gradient reductions hide behind its backward pass, as far as it lasts (cost.overlap); nothing
else is hidden, and a plan without carried state is a plain sum of its steps."""
from __future__ import annotations

import pytest
from training_helpers import ARGUMENTS, HIDDEN, adam_step
from training_helpers import GPU as FUSING

import tapestry
from tapestry.cost import DefaultCostModel, plan_cost
from tapestry.cost.overlap import overlap
from tapestry.graph import Graph
from tapestry.plan import Compute, Place, Reshard
from tapestry.training.plans import data_parallel, megatron, split_by_propagation, zero3

GPU = DefaultCostModel(FUSING.profile, fuse=False)  # each step its own kernel: the overlap alone (cost.fusion apart)


def total(plan: tapestry.Plan) -> float:
    return sum(GPU.step_cost(s, plan.mesh) for s in plan.steps)


def partial_sums(plan: tapestry.Plan) -> list[Reshard]:
    return [s for s in plan.steps if isinstance(s, Reshard) and s.src_layout.partial]


@pytest.mark.parametrize("batch", [16, 4096])
def test_data_parallel_hides_its_gradient_all_reduces_up_to_its_backward_compute(batch):
    imported, _ = adam_step(64, 256, batch)
    plan = data_parallel(imported.graph, tapestry.Mesh(4), ARGUMENTS)
    found = overlap(plan, GPU.step_cost)
    assert found.reductions == pytest.approx(sum(GPU.step_cost(s, plan.mesh) for s in partial_sums(plan)))
    assert 0 < found.backward < sum(GPU.step_cost(s, plan.mesh) for s in plan.steps if isinstance(s, Compute))
    assert found.hidden == min(found.reductions, found.backward)
    assert plan_cost(plan, GPU) == pytest.approx(total(plan) - found.hidden)


def test_a_larger_batch_hides_more_of_the_same_all_reduces():
    small, large = (data_parallel(adam_step(64, 256, b)[0].graph, tapestry.Mesh(4), ARGUMENTS) for b in (16, 65536))
    small_overlap, large_overlap = overlap(small, GPU.step_cost), overlap(large, GPU.step_cost)
    assert small_overlap.reductions == pytest.approx(large_overlap.reductions)  # the gradients are batch-free
    assert small_overlap.hidden < small_overlap.reductions  # little backward compute to hide them behind
    assert large_overlap.hidden > 2 * small_overlap.hidden  # launch overheads bound both from below


def test_a_forward_all_reduce_is_never_hidden():
    """Megatron's row-parallel layer sums its output in the forward pass (its only partial sum here: the input
    needs no gradient): the loss waits for it."""
    imported, _ = adam_step(64, 256, 4096)
    plan = megatron(imported.graph, tapestry.Mesh(4), HIDDEN)
    assert [s.shape for s in partial_sums(plan)] == [(4096, 64)]
    assert overlap(plan, GPU.step_cost).reductions == 0


def test_zero3_weight_all_gathers_are_not_hidden_having_no_compute_between_issue_and_first_use():
    """The rank programs issue each collective at its plan step and wait at its first reader (spmd.trace; inductor's
    compute/communication reordering is off), and a weight's all-gather comes right before the kernel that reads
    it: nothing runs beside it, so no FSDP-style prefetch is credited."""
    plan = zero3(adam_step(64, 256, 1024)[0].graph, tapestry.Mesh(4), ARGUMENTS)
    position = {s.out: k for k, s in enumerate(plan.steps)}
    weights = {s.out for s in plan.steps if isinstance(s, Place) and s.input in plan.graph.carried.values()}
    gathers = [s for s in plan.steps if isinstance(s, Reshard) and s.src in weights and not s.src_layout.partial]
    assert gathers
    for gather in gathers:
        first = min(k for k, s in enumerate(plan.steps) if isinstance(s, Compute) and gather.out in s.args)
        between = plan.steps[position[gather.out] + 1:first]
        assert all(not isinstance(s, Compute) or s.signature.kernel.is_view for s in between)
    found = overlap(plan, GPU.step_cost)
    assert found.reductions == pytest.approx(sum(GPU.step_cost(s, plan.mesh) for s in partial_sums(plan)
                                                 if s.out not in plan.prepared))
    assert plan_cost(plan, GPU) == pytest.approx(total(plan) - found.hidden)


def test_without_carried_state_a_plan_costs_the_sum_of_its_steps():
    g = Graph()
    x, w = g.input("x", (256, 64)), g.input("w", (64, 32))
    g.output("y", g.matmul(x, w))
    plan = split_by_propagation(g, tapestry.Mesh(4), [{"w": 0}])  # contraction split: the output is summed
    assert partial_sums(plan)
    assert overlap(plan, GPU.step_cost).hidden == 0
    assert plan_cost(plan, GPU) == pytest.approx(total(plan))
