"""The promise: every plan the e-graph holds computes exactly what the program computes, in the simulator and on
ranks. Plans are the optimiser's own and ones extracted under random costs (partial sums, halos, reshards)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tapestry
from tapestry.optimizer import Explored, explore
from tapestry.plan import Plan
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.testing.graphs import GENERATED, Coverage, RandomCost, block_graphs, features
from tapestry.verify import compare
from sweeps import draws

# Kernels whose reductions, windows and splits make communication: drawn alone, so plans exercise it often.
COMMUNICATING = ("matmul", "sum", "mean", "linear", "conv2d", "max_pool2d", "avg_pool2d", "softmax", "layer_norm",
                 "relu", "add", "transpose")
# Floors on the share of random-cost plans of COMMUNICATING graphs with each feature (measured 2026-11-27 by
# `pytest -s -m '' tests/test_end_to_end.py -k exercise`: partial 14%, halo 10%, reshard 35%, multi-device 73% of
# make test's 120 plans; 17%, 3%, 42%, 66% of make test-all's 360). The draws follow the source of `check` below.
FLOORS = {"partial": 0.05, "halo": 0.02, "reshard": 0.10, "multi-device": 0.4}
DETERMINISTIC = {"derandomize": True, "database": None, "deadline": None, "phases": [Phase.generate],
                 "suppress_health_check": list(HealthCheck)}


def check_plan(plan: Plan) -> None:
    """Valid, and the simulated outputs are the reference's at the output's dtype tolerance (NaN only where the
    reference has NaN)."""
    validate_plan(plan)
    inputs = tapestry.random_inputs(plan.graph, seed=0)
    errors = compare(simulate(plan, inputs), tapestry.evaluate(plan.graph, inputs), plan.graph)
    wrong = {name: str(err) for name, err in errors.items() if not err.ok}
    assert not wrong, f"mesh {plan.mesh}: {wrong}\n{plan.graph!r}"


def random_plans(graph: tapestry.Graph, mesh: Mesh | int, seed: int, count: int = 2,
                 explored: Explored | None = None) -> list[Plan]:
    """`explored`: the graph's exploration on `mesh`, where the caller has it already (explore is most of the cost)."""
    explored = explore(graph, mesh) if explored is None else explored
    return [explored.extract(RandomCost(seed + k), extractor="greedy-dag").plan for k in range(count)]


@pytest.mark.parametrize("kernels", [("slice",), GENERATED], ids=["slices", "every-kernel"])
def test_random_programs_are_plannable(kernels: tuple[str, ...]):
    """No zero-size tensor (plans refuse them): a slice's params drawn for one shape clip to nothing when it reads
    an earlier, smaller value (the slice chains failed so before the generator refused such ops)."""

    @settings(max_examples=30, **DETERMINISTIC)
    @given(graph=block_graphs(max_ops=4, kernels=kernels))
    def check(graph: tapestry.Graph) -> None:
        graph.check_plannable()

    check()


# One program per kernel in make test, two in make test-all: a test per kernel, most of this file's time
# (docs/benchmarks.md "Test suite time", branch maketest3).
@draws(1, 2)
@pytest.mark.parametrize("kernel", GENERATED)
def test_every_kernel_in_random_programs_plans_correctly(kernel: str, examples: int):
    """Each kernel leads a few random programs: the optimiser's plan on 2 devices, random-cost plans on 2 and 4."""

    @settings(max_examples=examples, **DETERMINISTIC)
    @given(graph=block_graphs(max_ops=4, first=kernel), seed=st.integers(0, 2**16))
    def check(graph: tapestry.Graph, seed: int) -> None:
        assert any(node.op == kernel for node in graph.ops)
        on_two = explore(graph, 2)
        check_plan(on_two.extract(time_limit=5).plan)  # tapestry.optimize(graph, 2, time_limit=5), explored once
        for mesh, explored in ((2, on_two), (4, None)):
            for plan in random_plans(graph, mesh, seed, count=1, explored=explored):
                check_plan(plan)

    check()


@dataclass
class KeptCoverage(Coverage):
    """Coverage that keeps the plans, by mesh size, for a sample to run on ranks."""

    kept: dict[int, list[Plan]] = field(default_factory=lambda: defaultdict(list))

    def add(self, plan: Plan) -> None:
        super().add(plan)
        self.kept[plan.mesh.size].append(plan)


# The sample runs on 2 ranks in make test; make test-all adds 4 (Mesh(4) and Mesh(2, 2) plans), and test_spmd runs
# hand-built plans on Mesh(4) and Mesh(2, 2) on 4 ranks in make test.
@pytest.mark.parametrize("examples, ranks", [(20, (2,)), pytest.param(60, (2, 4), marks=pytest.mark.slow)])
def test_random_plans_exercise_partial_sums_halos_and_reshards_and_a_sample_runs_on_ranks(
        capsys, examples: int, ranks: tuple[int, ...]):
    """Coverage is measured, printed and held to a floor, so the property cannot quietly stop testing them. make
    test draws 20 programs (120 plans), make test-all 60. A sample of these plans with reshards and partial sums
    is then lowered and run by torch.distributed on gloo ranks (the explorations are the cost: shared)."""
    seen = KeptCoverage()

    @settings(max_examples=examples, **DETERMINISTIC)
    @given(graph=block_graphs(max_ops=4, kernels=COMMUNICATING), seed=st.integers(0, 2**16))
    def check(graph: tapestry.Graph, seed: int) -> None:
        for mesh in (2, 4, Mesh(2, 2)):
            for plan in random_plans(graph, mesh, seed):
                check_plan(plan)
                seen.add(plan)

    check()
    with capsys.disabled():
        print(f"\nend-to-end coverage: {seen.report()}")
    shares = {f: seen.share(f) for f in FLOORS}
    assert all(shares[f] >= floor for f, floor in FLOORS.items()), shares
    for nproc in ranks:
        check_on_ranks(runtime_sample(seen.kept[nproc]), nproc)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph=block_graphs(max_ops=10), seed=st.integers(0, 2**16))
def test_optimised_and_random_plans_equal_the_program_exhaustive(graph, seed):
    for mesh in (1, 2, 4, Mesh(3), Mesh(2, 2)):
        check_plan(tapestry.optimize(graph, mesh, time_limit=5).plan)
        for plan in random_plans(graph, mesh, seed):
            check_plan(plan)


def runtime_sample(plans: list[Plan], count: int = 5) -> list[Plan]:
    """Up to `count` of `plans`, one per program, chosen so the sample has reshards and partial sums."""
    sample: list[Plan] = []
    wanted = {"partial", "reshard"}
    for plan in plans:
        missing = wanted - set().union(*map(features, sample)) if sample else wanted
        if len(sample) >= count and not missing:
            break
        if features(plan) & (missing or wanted) and not any(plan.graph is kept.graph for kept in sample):
            sample.append(plan)
    return sample


def check_on_ranks(plans: list[Plan], nproc: int) -> None:
    """The plans, lowered and run by torch.distributed on `nproc` gloo ranks, compute what the program computes."""
    from tapestry.runtime import run_plans

    found = set().union(*(features(p) for p in plans))
    assert {"partial", "reshard", "multi-device"} <= found, found
    for plan, run in zip(plans, run_plans(plans, nproc=nproc, compile=False, timeout=120), strict=True):
        expected = tapestry.evaluate(plan.graph, tapestry.random_inputs(plan.graph, seed=0))
        wrong = {name: str(err) for name, err in compare(run.outputs, expected, plan.graph).items() if not err.ok}
        assert not wrong, f"{wrong}\n{plan.graph!r}"
