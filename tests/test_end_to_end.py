"""The promise: every optimised plan computes exactly what the program computes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import tapestry
from tapestry.optimizer import optimize
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import validate_plan
from tapestry.testing.graphs import block_graphs

MESHES = (1, 2, 4)


def check_plans_agree(graph: tapestry.Graph, meshes: tuple = MESHES) -> None:
    inputs = tapestry.random_inputs(graph, seed=0)
    expected = tapestry.evaluate(graph, inputs)
    for mesh in meshes:
        plan = optimize(graph, mesh, time_limit=5).plan
        validate_plan(plan)
        got = simulate(plan, inputs)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-4, err_msg=f"output {name} on mesh {mesh}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=block_graphs())
def test_optimised_plans_equal_the_program(graph):
    check_plans_agree(graph)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=block_graphs(max_ops=10))
def test_optimised_plans_equal_the_program_exhaustive(graph):
    check_plans_agree(graph, (*MESHES, tapestry.Mesh(3), tapestry.Mesh(2, 2)))


def test_a_sample_of_property_test_plans_runs_on_two_ranks():
    """The same random programs, optimised for 2 devices, run through lowering and torch.distributed."""
    from hypothesis import Phase

    from tapestry.runtime import run_plans

    sample: list[tapestry.Graph] = []

    @settings(max_examples=6, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(graph=block_graphs(max_ops=4))
    def collect(graph):
        sample.append(graph)

    collect()
    plans = [optimize(graph, 2, time_limit=5).plan for graph in sample]
    for plan, run in zip(plans, run_plans(plans, nproc=2, compile=False, timeout=120)):
        expected = tapestry.evaluate(plan.graph, tapestry.random_inputs(plan.graph, seed=0))
        for name, value in expected.items():
            np.testing.assert_allclose(run.outputs[name], value, rtol=2e-4, atol=2e-4, err_msg=f"{plan.graph!r}")
