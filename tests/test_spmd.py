"""A rank's program traced as one torch function (functional collectives) computes what the reference evaluator
computes, on 2 and 4 gloo ranks, eager and compiled whole; every rank receives the outputs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
from test_lower import CASES, _chain, _conv, _matmul
from test_runtime import GRID

import tapestry
from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.lower import AllToAll, Gather, SendRecv, lower
from tapestry.plan import Plan, build_plan
from tapestry.sharding import Mesh
from tapestry.spmd import RankFunction, compiled, make_groups, place
from tapestry.spmd.launch import launch

Outputs = dict[str, torch.Tensor]


def run_everywhere(plans: Sequence[Plan], compile: bool, everywhere: bool = True) -> list[Outputs]:
    """On each launched rank: every plan's outputs, delivered whole to this rank by the traced function (without
    `everywhere`, to rank 0 only: the others return nothing)."""
    rank = dist.get_rank()
    results = []
    for plan in plans:
        program = lower(plan, everywhere=everywhere)
        fn = RankFunction.of(program, rank, make_groups(program))
        inputs = {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(plan.graph).items()}
        got = (compiled(fn) if compile else fn)(place(program, rank, inputs))
        results.append({name: got[buffer].clone() for name, buffer in program.outputs.items() if buffer in got})
    return results


def check_against_reference(plans: Sequence[Plan], per_rank: Sequence[Sequence[Outputs]]) -> None:
    for k, plan in enumerate(plans):
        want = tapestry.evaluate(plan.graph, tapestry.random_inputs(plan.graph))
        for rank, results in enumerate(per_rank):
            got = results[k]
            assert got.keys() == want.keys(), (k, rank)
            for name, value in want.items():
                assert got[name].dtype == getattr(torch, plan.dtypes[plan.outputs[name]]), (k, rank, name)
                torch.testing.assert_close(got[name], dtypes.to_tensor(value), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"plan {k}, rank {rank}, output {name}: {m}")


def _four_rank_plans() -> list[Plan]:
    mesh = Mesh(4)
    return [make() for make in GRID.values()] + [
        build_plan(_chain(8, 4, 6), mesh, {"linear_0": (0,), "relu_0": (1,)}),
        build_plan(_chain(7, 3, 5), mesh, {"linear_0": (1,), "relu_0": (0,)}),
        build_plan(_matmul((6, 8), (8, 5)), mesh, {"matmul_0": (2,), "relu_0": (0,)}),
        build_plan(_conv(), mesh, {"relu_0": (2,), "conv2d_0": (2,)}),
        build_plan(_matmul((6, 8), (8, 5)), Mesh(2, 2), {"matmul_0": (0, 2), "relu_0": (1, 0)}),
    ]


def test_traced_rank_functions_compute_the_reference_on_two_and_four_gloo_ranks() -> None:
    two = [make() for make in CASES.values()]
    check_against_reference(two, launch(run_everywhere, 2, two, False, timeout=120))
    four = _four_rank_plans()
    check_against_reference(four, launch(run_everywhere, 4, four, False, timeout=120))


def test_outputs_gathered_to_rank_zero_alone_reach_rank_zero_alone() -> None:
    plans = [make() for make in CASES.values()] + _four_rank_plans()[:2]
    per_rank = launch(run_everywhere, 2, plans[:-2], False, False, timeout=120)
    check_against_reference(plans[:-2], per_rank[:1])
    assert all(results == {} for results in per_rank[1])
    check_against_reference(plans[-2:], launch(run_everywhere, 4, plans[-2:], False, False, timeout=120)[:1])


def test_the_plans_exercise_every_collective_the_engine_maps() -> None:
    """The cases above reach each of the engine's communication paths, point-to-point and gathers included."""
    kinds = {s.kind for plan in [make() for make in CASES.values()] + _four_rank_plans()
             for everywhere in (False, True) for r in lower(plan, everywhere=everywhere).ranks for s in r.steps
             if hasattr(s, "kind")}
    assert {"local", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv", "gather"} <= kinds


@pytest.mark.slow
def test_compiled_rank_functions_compute_the_reference_on_two_and_four_gloo_ranks() -> None:
    two = [CASES[name]() for name in ("chain of different splits", "conv2d split on rows", "matmul split on k, then rows",
                                     "float64 reads of padding only")]
    check_against_reference(two, launch(run_everywhere, 2, two, True, timeout=600))
    four = _four_rank_plans()[:3]
    check_against_reference(four, launch(run_everywhere, 4, four, True, timeout=600))


# -- the persistent program -----------------------------------------------------------------------------------------


def _served_mlp() -> Graph:
    """x -> relu(linear) -> matmul with a transposed weight: static weights, so the transpose is prepared once."""
    g = Graph()
    x = g.input("x", (8, 6))
    w0, b0 = g.input("w0", (6, 10), static=True), g.input("b0", (10,), static=True)
    w1 = g.input("w1", (4, 10), static=True)
    g.output("y", g.matmul(g.relu(g.linear(x, w0, b0)), g.transpose(w1, perm=(1, 0))))
    return g


def _accumulator() -> Graph:
    """A training-like step: state s becomes s + x @ w, carried to the next call; the output is its sum."""
    g = Graph()
    s, x, w = g.input("s", (8, 4)), g.input("x", (8, 6)), g.input("w", (6, 4), static=True)
    new = g.add(s, g.matmul(x, w))
    g.output("new.s", new)
    g.output("total", g.sum(g.sum(new, axis=1), axis=0))
    g.carry("new.s", "s")
    return g


def _calls(seed: int, n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def serve(plan: Plan, state: dict[str, torch.Tensor], calls: list[dict[str, torch.Tensor]], compile: bool,
          carry: dict[str, str] | None = None) -> tuple[list[Outputs], int, dict[str, torch.Tensor]]:
    """On each launched rank: one ParallelProgram, called once per input set; its outputs, the count of its prepared
    steps it did not rerun, and its state blocks at the end."""
    from tapestry.spmd.program import ParallelProgram

    program = ParallelProgram(plan, state, carry=carry, compile=compile)
    outputs = [{k: v.clone() for k, v in program(**inputs).items()} for inputs in calls]
    skipped = sum(1 for s in program.program.ranks[program.rank].steps if s.step not in {t.step for t in
                  program.function.steps} and not hasattr(s, "input"))
    return outputs, skipped, {name: t.clone() for name, (_, t) in program.state().items()}


def test_a_parallel_program_serves_new_inputs_every_call_from_weights_placed_once() -> None:
    g = _served_mlp()
    weights = {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(g, seed=1).items() if k != "x"}
    calls = [{"x": x} for x in _calls(0, 3, (8, 6))]
    plans = [build_plan(g, Mesh(2), {"linear_0": (0,), "relu_0": (0,), "matmul_0": (0,)}),
             build_plan(g, Mesh(2), {"linear_0": (1,), "relu_0": (1,), "matmul_0": (2,)})]
    for plan in plans:
        per_rank = launch(serve, 2, plan, weights, calls, False, timeout=120)
        for outputs, skipped, _ in per_rank:
            assert skipped >= 1  # the weight's transpose ran once, at load time
            for inputs, got in zip(calls, outputs):
                want = tapestry.evaluate(g, {**{k: v.numpy() for k, v in weights.items()}, "x": inputs["x"].numpy()})
                torch.testing.assert_close(got["y"], dtypes.to_tensor(want["y"]), rtol=1e-5, atol=1e-5)


def test_carried_state_stays_on_the_ranks_and_feeds_the_next_call() -> None:
    g = _accumulator()
    w = _calls(1, 1, (6, 4))[0]
    calls = [{"x": x} for x in _calls(2, 3, (8, 6))]
    plan = build_plan(g, Mesh(2), {"matmul_0": (0,), "add_0": (0,), "sum_0": (0,)})
    per_rank = launch(serve, 2, plan, {"w": w, "s": torch.zeros(8, 4)}, calls, False, {"new.s": "s"}, timeout=120)
    s = torch.zeros(8, 4)
    for k, inputs in enumerate(calls):
        s = s + inputs["x"] @ w
        for outputs, _, _ in per_rank:
            assert outputs[k].keys() == {"total"}  # the new state is not delivered
            torch.testing.assert_close(outputs[k]["total"], s.sum(), rtol=1e-5, atol=1e-5)
    for rank, (_, _, state) in enumerate(per_rank):
        torch.testing.assert_close(state["s"], s[4 * rank : 4 * rank + 4], rtol=1e-5, atol=1e-5)
