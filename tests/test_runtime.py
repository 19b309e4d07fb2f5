"""Running lowered plans on gloo ranks gives tapestry.evaluate's answer, and failures are loud and quick."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from blocking import OPTIONAL_ABSENT
from lower_helpers import CASES, GRID

import tapestry
from tapestry import dtypes
from tapestry.cli import main
from tapestry.demo import seeds_example
from tapestry.graph import Graph
from tapestry.lower import AllGather, AllReduce, PlaceBlock, ReduceScatter, ShardCompute, lower
from tapestry.plan import Plan, build_plan
from tapestry.runtime import InputError, RankFailure, RunResult, run_plan, run_plans
from tapestry.runtime.execute import FAULT_ENV, FAULT_EXIT_CODE
from tapestry.sharding import Mesh


def _plus_constant() -> Plan:
    g = Graph()
    g.output("y", g.add(g.input("x", (4, 3)), g.constant("c", np.arange(3, dtype=np.float32))))
    return build_plan(g, Mesh(2), {"add_0": (0,)})


# The plus-constant plan run with its constant left out, and with every input given (the constant as it is).
CONSTANT_GIVEN = ({"x": np.ones((4, 3), np.float32)}, tapestry.random_inputs(_plus_constant().graph))


@pytest.fixture(scope="module")
def eager_runs() -> dict[str, RunResult]:
    """Every case in one spawned group of 2 ranks: starting ranks costs more than the plans. The cases' inputs are
    drawn from the seed; the constant cases' are CONSTANT_GIVEN."""
    plans = [make() for make in CASES.values()] + [_plus_constant()] * len(CONSTANT_GIVEN)
    given = [None] * len(CASES) + list(CONSTANT_GIVEN)
    results = run_plans(plans, given, nproc=2, compile=False, timeout=120)
    return dict(zip([*CASES, *(f"constant {k}" for k in range(len(CONSTANT_GIVEN)))], results))


def reference(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    return tapestry.evaluate(graph, tapestry.random_inputs(graph, seed))


@pytest.mark.parametrize("name", CASES)
def test_two_gloo_ranks_compute_what_the_reference_evaluator_computes(name: str, eager_runs) -> None:
    want = reference(CASES[name]().graph)
    got = eager_runs[name].outputs
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_every_rank_reports_a_time_for_each_of_its_steps(eager_runs) -> None:
    """One measured time per step of each rank's lowered program, in its order and of its kind."""
    run = eager_runs["chain of different splits"]
    program = lower(CASES["chain of different splits"]())
    assert [r.rank for r in run.ranks] == [0, 1]
    kind = {PlaceBlock: "place", ShardCompute: "compute"}
    for report, rank_program in zip(run.ranks, program.ranks):
        assert [(t.step, t.kind) for t in report.steps] == [
            (s.step, kind.get(type(s), "comm")) for s in rank_program.steps]
        assert all(0 < t.seconds < max(report.iterations) for t in report.steps if t.kind != "place")
    assert {t.kind for t in run.ranks[1].steps} == {"place", "compute", "comm"}


def test_a_fused_float64_kernel_reading_a_transposed_view_runs_compiled_on_two_ranks() -> None:
    g = Graph()
    x, w, b = g.input("x", (8, 16), "float64"), g.input("w", (8, 12), "float64"), g.input("b", (12,), "float64")
    g.output("y", g.linear_relu(g.transpose(x, perm=(1, 0)), w, b))
    inputs = tapestry.random_inputs(g, seed=3)
    result = run_plan(build_plan(g, Mesh(2), {"linear_relu_0": (1,)}), inputs, compile=True, timeout=240)
    assert result.outputs["y"].dtype == np.float64
    np.testing.assert_allclose(result.outputs["y"], tapestry.evaluate(g, inputs)["y"], rtol=1e-12, atol=1e-12)


def test_collectives_on_a_grid_run_among_the_ranks_of_one_axis_and_compute_the_graph(grid_runs) -> None:
    plans = [make() for make in GRID.values()]
    for plan in plans:
        groups = {s.group for r in lower(plan).ranks for s in r.steps if isinstance(s, (AllReduce, ReduceScatter, AllGather))}
        assert groups == {(0, 1), (2, 3)}
    for plan, result in zip(plans, grid_runs[:len(GRID)]):
        np.testing.assert_allclose(result.outputs["y"], reference(plan.graph)["y"], rtol=1e-5, atol=1e-5)


def _idle_ranks_plan(dtype: str) -> Plan:
    """On Mesh(2, 2), a [1, ...] value split in rows over the first axis leaves ranks 2 and 3 idle: they join the
    all_reduce, the all_gather and the gather of values they hold no block of."""
    g = Graph()
    x = g.input("x", (1, 8), dtype)
    if dtype == "bool":
        both = g.logical_and(x, g.input("y", (1, 8), dtype))
        g.output("split", both)
        g.output("whole", g.logical_or(both, x))
        return build_plan(g, Mesh(2, 2), {"logical_and_0": (0, 1)})
    m = g.matmul(x, g.input("w", (8, 6), dtype))
    split = g.add(m, m)
    g.output("split", split)
    g.output("gathered", g.add(split, split))
    g.output("reduced", g.add(m, m))
    return build_plan(g, Mesh(2, 2), {"matmul_0": (0, 2), "add_0": (0, 1)})


IDLE_KINDS = ("bfloat16", "float16", "float64", "int64", "int32", "bool")


def _idle_ranks_inputs(plans: list[Plan]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{n.name: dtypes.cast(rng.integers(-2, 3, n.shape), n.dtype) for n in p.graph.inputs} for p in plans]


@pytest.fixture(scope="module")
def grid_runs() -> list[RunResult]:
    """The GRID plans (inputs from the seed), then the idle-rank plans of IDLE_KINDS, in one group of 4 ranks."""
    idle = [_idle_ranks_plan(d) for d in IDLE_KINDS]
    plans = [make() for make in GRID.values()] + idle
    return run_plans(plans, [None] * len(GRID) + _idle_ranks_inputs(idle), nproc=4, compile=False, timeout=120)


def test_ranks_idle_for_a_value_make_their_buffers_in_its_dtype(grid_runs) -> None:
    """Small integer inputs keep every sum exact, whatever the order: the results must equal the evaluator's."""
    plans = [_idle_ranks_plan(d) for d in IDLE_KINDS]
    inputs = _idle_ranks_inputs(plans)
    for kind, plan, given, result in zip(IDLE_KINDS, plans, inputs, grid_runs[len(GRID):], strict=True):
        want = tapestry.evaluate(plan.graph, given)
        assert result.outputs.keys() == want.keys()
        for name, value in want.items():
            assert result.outputs[name].dtype == value.dtype, (kind, name)
            np.testing.assert_array_equal(result.outputs[name], value, err_msg=f"{kind} {name}")


def test_a_rank_killed_mid_run_is_named_with_its_step_within_the_timeout(monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 dies abruptly inside plan step 3 (its linear shard)
    plan = CASES["seeds split on batch"]()
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"rank 1 exited with code {FAULT_EXIT_CODE} in step 3 \(ShardCompute -> v3\)"):
        run_plan(plan, compile=False, timeout=60)
    assert time.monotonic() - start < 60


@pytest.mark.slow  # waits out the whole timeout, long enough for two ranks to start on a loaded machine
def test_a_timeout_names_the_rank_that_had_not_reached_the_step_the_others_wait_in(monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:3:hang")  # rank 1 stops for good in its linear shard; rank 0 waits in the gather
    plan = CASES["seeds split on batch"]()
    stuck = (r"timed out after 30 s: rank\(s\) 1 had not reached step 5 \(Gather -> v4@0\), where rank\(s\) 0 wait "
             r"for them; rank 0 in step 5 .*; rank 1 in step 3 ")
    with pytest.raises(RankFailure, match=stuck):
        run_plan(plan, compile=False, timeout=30)


def test_an_input_file_of_the_wrong_shape_is_refused_before_any_rank_starts(tmp_path) -> None:
    g = seeds_example(8, 4, 6)
    for name, array in tapestry.random_inputs(g).items():
        np.save(tmp_path / f"{name}.npy", array)
    np.save(tmp_path / "x.npy", np.zeros((3, 4), np.float32))
    plan = build_plan(g, Mesh(2), {"linear_0": (0,)})
    with pytest.raises(InputError, match=r"input 'x': .*x\.npy has shape \[3, 4\], the graph expects \[8, 4\]"):
        run_plan(plan, tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((8, 4), np.float32))
    (tmp_path / "w.npy").unlink()
    with pytest.raises(InputError, match=r"input 'w': found neither w\.npy nor w\.pt"):
        run_plan(plan, tmp_path)


def test_run_verifies_profiles_and_saves_a_script_graph(tmp_path, capsys) -> None:
    saved = tmp_path / "out"
    status = main(["run", "examples/mlp.py", "--nproc", "2", "--no-compile", "--verify", "--profile",
                   "--save-outputs", str(saved), "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "verify y: max abs err" in out and "ok" in out
    assert "predicted" in out and "total comm" in out
    assert np.load(saved / "y.npy").shape == (512, 256)



def test_a_saved_plan_runs_and_verifies_where_the_optimizer_packages_are_missing(tmp_path) -> None:
    """What a GPU node without egglog, islpy, ortools or graphviz has: `tapestry run PLAN.json` needs torch and numpy."""
    plan = tmp_path / "plan.json"
    build_plan(seeds_example(8, 4, 6), Mesh(2), {"linear_0": (0,), "relu_0": (0,)}).save(plan)
    (tmp_path / "sitecustomize.py").write_text(OPTIONAL_ABSENT)  # in every process, the spawned ranks too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "tapestry.cli", "run", str(plan), "--no-compile", "--verify",
                           "--backend", "gloo", "--timeout", "120"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "verify y: max abs err" in done.stdout and "ok" in done.stdout
    helped = subprocess.run([sys.executable, "-m", "tapestry.cli", "--help"], env=env, capture_output=True, text=True)
    assert "left out here, for want of a package" in helped.stdout and "(egglog)" in helped.stdout


def test_a_constant_cannot_be_overridden_and_a_missing_input_is_named_not_a_scratch_file(tmp_path) -> None:
    plan = _plus_constant()
    x = np.ones((4, 3), np.float32)
    with pytest.raises(InputError, match=r"input 'c' is a constant of the graph .*the value given differs"):
        run_plan(plan, {"x": x, "c": np.full(3, 100, np.float32)})
    with pytest.raises(InputError, match=r"^input 'x' was not supplied$"):
        run_plan(plan, {"c": np.arange(3, dtype=np.float32)})
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", np.zeros(3, np.float32))
    with pytest.raises(InputError, match=r"input 'c' is a constant of the graph .*c\.npy holds another value"):
        run_plan(plan, tmp_path)


def test_a_constant_left_out_or_given_as_it_is_comes_from_the_graph(eager_runs) -> None:
    for k, inputs in enumerate(CONSTANT_GIVEN):
        np.testing.assert_array_equal(eager_runs[f"constant {k}"].outputs["y"],
                                      inputs["x"] + np.arange(3, dtype=np.float32))
