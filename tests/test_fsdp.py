"""FSDP on meshes the batch does not divide (issue 24 item 5: the 70B step on 8x8 and 8x8x8 with batch 8 had no
hand plan that shards weights, gradients and Adam state over every device, so its leanest candidate held them
whole: docs/benchmarks.md, "Why the 70B step's candidates miss 80 GB")."""
from __future__ import annotations

import pytest
from test_layers_fold import llama_step

import tapestry
from tapestry import verify
from tapestry.cost import peak_memory
from tapestry.graph import Graph
from tapestry.kernels import DimKind
from tapestry.plan import Place, steady_violations
from tapestry.plan.simulate import simulate
from tapestry.sharding import Layout, Mesh
from tapestry.training.plans import _summed_over_every_axis, baselines, fsdp, step_arguments


@pytest.fixture(scope="module")
def step() -> Graph:
    return llama_step(3)  # batch 2, sequence 8


@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2)])
def test_fsdp_on_a_mesh_the_batch_does_not_divide_shards_all_state_over_every_device_and_matches_the_reference(
        step, shape):
    """Batch 2 on 8 devices: the batch over the axis it divides (axis 0 of 2x2x2, axis 1 of 4x2), the sequence over
    the rest; every carried tensor stored split 8 ways; the step steady and equal to the reference."""
    mesh = Mesh(*shape)
    plan = baselines(step, mesh)["FSDP"]
    for s in plan.steps:
        if isinstance(s, Place) and s.input in step.carried.values() and step[s.input].shape:  # not Adam's count
            assert len(set(s.layout.blocks)) == mesh.size, s.input
    assert not steady_violations(plan, step.carried)
    inputs = tapestry.random_inputs(step)
    errors = verify.compare(simulate(plan, inputs), tapestry.evaluate(step, inputs), step, plan)
    assert all(e.ok for e in errors.values()), errors


def test_fsdp_holds_less_per_device_than_every_other_hand_plan_where_the_batch_does_not_divide(step):
    """Before, 2x2x2 with batch 2 had only tensor parallel (state split by Megatron's pairs only, norms, embeddings
    and the LM head whole): FSDP's peak is below it."""
    hands = baselines(step, Mesh(2, 2, 2))
    assert "data parallel" not in hands and "ZeRO-3" not in hands
    peaks = {name: max(peak_memory(plan)) for name, plan in hands.items()}
    assert peaks["FSDP"] < min(peak for name, peak in peaks.items() if name != "FSDP"), peaks


def test_fsdp_where_the_batch_divides_every_device_is_zero3s_layouts(step):
    """On 2 devices the batch splits over all: FSDP stores the state as ZeRO-3 does (first dim, every device)."""
    mesh = Mesh(2)
    plan = fsdp(step, mesh, step_arguments(step))
    for s in plan.steps:
        if isinstance(s, Place) and s.input in step.carried.values() and step[s.input].shape \
                and step[s.input].shape[0] % 2 == 0:
            assert s.layout == Layout.split(step[s.input].shape, mesh, (0,)), s.input


def test_a_sum_split_over_some_axes_splits_over_the_replicated_ones_too_or_not_at_all(step):
    """A partial layout's value is the sum over every device holding it: a reduction split over axis 0 alone would
    count the sums held on axis 1 twice, so it takes axis 1 too where it divides, else no axis splits a sum."""
    op = next(n.name for n in step.ops if n.op == "matmul")
    sig = step.signature(op)
    summed = sig.dims_of(DimKind.REDUCTION)[0]
    free = next(i for i in range(len(sig.dims)) if i not in sig.dims_of(DimKind.REDUCTION) and i in sig.splittable)
    size = sig.spec.sizes[summed]
    assert _summed_over_every_axis(sig, Mesh(2, 2), [summed, None]) == (summed, summed)
    assert _summed_over_every_axis(sig, Mesh(2, 2), [summed, free]) == (summed, free)
    assert _summed_over_every_axis(sig, Mesh(2, 3 * size), [summed, None]) == (None, None)


def test_fsdp_runs_the_optimizer_update_on_the_stored_shards(step):
    """As ZeRO-3's since budget5b: every op reading a carried tensor's stored shard (Adam's moments, the weights'
    update) runs split over every device, and no carried input is placed twice (no gathered copy to slice from)."""
    mesh = Mesh(2, 2, 2)
    plan = fsdp(step, mesh, step_arguments(step))
    places = [s.input for s in plan.steps if isinstance(s, Place)]
    assert len(places) == len(set(places))
    assert not any(s.out.endswith(".stored") for s in plan.steps)
