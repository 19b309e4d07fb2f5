"""A rank's program traced as one torch function (functional collectives) computes what the reference evaluator
computes, on 2 and 4 gloo ranks, eager and compiled whole; every rank receives the outputs."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lower_helpers import CASES, GRID, chain, conv, matmul_relu

import tapestry
from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.lower import LoweringError, lower
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
        build_plan(chain(8, 4, 6), mesh, {"linear_0": (0,), "relu_0": (1,)}),
        build_plan(chain(7, 3, 5), mesh, {"linear_0": (1,), "relu_0": (0,)}),
        build_plan(matmul_relu((6, 8), (8, 5)), mesh, {"matmul_0": (2,), "relu_0": (0,)}),
        build_plan(conv(), mesh, {"relu_0": (2,), "conv2d_0": (2,)}),
        build_plan(matmul_relu((6, 8), (8, 5)), Mesh(2, 2), {"matmul_0": (0, 2), "relu_0": (1, 0)}),
    ]


def test_traced_rank_functions_compute_the_reference_on_two_and_four_gloo_ranks() -> None:
    two = [make() for make in CASES.values()]
    check_against_reference(two, launch(run_everywhere, 2, two, False, timeout=120))
    four = _four_rank_plans()
    check_against_reference(four, launch(run_everywhere, 4, four, False, timeout=120))


def test_lowering_delivers_only_the_outputs_named_and_to_every_rank_when_asked() -> None:
    plan = build_plan(_accumulator(), Mesh(2), {"matmul_0": (0,), "add_0": (0,), "sum_0": (0,)})
    program = lower(plan, deliver=("total",), everywhere=True)
    assert program.outputs == {"total": f"{plan.outputs['total']}@all"}
    last = [r.steps[-1] for r in program.ranks]
    assert all(s.out == program.outputs["total"] and s.out_block is not None for s in last)  # whole on both ranks
    assert lower(plan).outputs.keys() == {"new.s", "total"}
    with pytest.raises(LoweringError, match=r"deliver: 'loss' is no output of the plan; its outputs are 'new.s'"):
        lower(plan, deliver=("loss",))


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
    names = ("chain of different splits", "conv2d split on rows", "matmul split on k, then rows",
             "float64 reads of padding only")
    two = [CASES[name]() for name in names]
    check_against_reference(two, launch(run_everywhere, 2, two, True, timeout=600))
    four = _four_rank_plans()[:3]
    check_against_reference(four, launch(run_everywhere, 4, four, True, timeout=600))


def test_a_compiled_rank_function_goes_to_inductor_without_dynamo_and_computes_what_it_does_eager(monkeypatch) -> None:
    """The make_fx graph is handed to inductor as it is: dynamo would only trace the traced graph again (on the
    training example's 2000-node graph, ~25 s of each rank's CPU in a cold start, issue 26). Inductor's config
    patches (CUDA graphs on a GPU; here a harmless one) travel as standalone_compile's `config_patches`: passed
    bare, compile_fx refused them and the GPU path failed at its first call."""
    from torch._dynamo.utils import counters

    import tapestry.spmd.trace as trace

    monkeypatch.setattr(trace, "inductor_options", lambda args: {"max_autotune": False})

    plan = build_plan(chain(8, 4, 6), Mesh(1), {"linear_0": (0,)})
    program = lower(plan)
    fn = RankFunction.of(program, 0, {})
    blocks = place(program, 0, {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(plan.graph).items()})
    counters.clear()
    got = compiled(fn)(blocks)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])  # dynamo traced no frame
    assert counters["inductor"], "inductor compiled (or loaded) the graph"
    want = fn(blocks)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_a_compiled_rank_program_is_saved_and_a_later_compile_loads_it_without_tracing(monkeypatch) -> None:
    """Warm starts skip make_fx (2-3 s a rank for the training example): inductor's compiled artifact is kept by
    a key of the rank's steps, groups, blocks and sources."""
    import tapestry.spmd.trace as trace

    plan = build_plan(chain(8, 4, 6), Mesh(1), {"linear_0": (0,)})
    program = lower(plan)
    fn = RankFunction.of(program, 0, {})
    blocks = place(program, 0, {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(plan.graph).items()})
    args = [blocks[name] for name in fn.inputs]
    path = trace.artifact_path(trace.program_key(fn, args, {}))
    path.unlink(missing_ok=True)
    first = compiled(fn)(blocks)
    assert path.exists()

    def no_trace(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("traced again")

    monkeypatch.setattr(trace, "make_fx", no_trace)
    again = compiled(fn)(blocks)
    for name, value in fn(blocks).items():
        torch.testing.assert_close(first[name], value, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(again[name], value, rtol=1e-6, atol=1e-6)
    strided = [args[0].t().contiguous().t(), *args[1:]]  # the same values laid out otherwise: another program
    assert trace.program_key(fn, strided, {}) != trace.program_key(fn, args, {})
    assert trace.program_key(fn, args, {"triton.cudagraphs": True}) != trace.program_key(fn, args, {})


def test_the_traced_graph_is_handed_to_inductor_only_where_standalone_compile_takes_it() -> None:
    """torch 2.11's standalone_compile has no donate_graph_module (the training example failed in its first call on
    a GPU machine's torch 2.11): the argument is passed only where it exists."""
    from tapestry.spmd.trace import _donated

    def before(gm: Any, example_inputs: Any, *, dynamic_shapes: str = "from_graph", aot: bool = False) -> None: ...

    def since(gm: Any, example_inputs: Any, *, aot: bool = False, donate_graph_module: bool = False) -> None: ...

    assert _donated(before) == {} and _donated(since) == {"donate_graph_module": True}


def test_cuda_graphs_are_asked_of_inductor_only_for_blocks_on_a_gpu() -> None:
    """The choice; the CPU path keeps inductor's defaults (tests/test_gpu.py runs the GPU path)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tapestry.spmd.trace import inductor_options

    assert inductor_options([torch.zeros(2), torch.zeros(3)]) == {}
    with FakeTensorMode():
        on_gpu = [torch.empty(2, device="cuda"), torch.empty(3, device="cuda")]
        mixed = [torch.empty(2, device="cuda"), torch.empty(3, device="cpu")]
    assert inductor_options(on_gpu) == {"triton.cudagraphs": True}
    assert inductor_options(mixed) == {}


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


def test_ranks_launched_after_the_launcher_compiled_compile_their_own_program(tmp_path, monkeypatch) -> None:
    """Forked ranks inherit inductor's worker pools without their threads: `make demo` compiled shard kernels in the
    launcher (warm_cache), then every rank's first compiled call waited forever."""
    from tapestry.lower.compile import use_persistent_cache, warm_cache

    g = _served_mlp()
    plan = build_plan(g, Mesh(2), {"linear_0": (0,), "relu_0": (0,), "matmul_0": (0,)})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached: every rank compiles
    use_persistent_cache()
    warm_cache(lower(plan))  # the launcher compiles: its worker pools now exist
    weights = {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(g, seed=1).items() if k != "x"}
    (x,) = _calls(0, 1, (8, 6))
    for outputs, _, _ in launch(serve, 2, plan, weights, [{"x": x}], True, timeout=300):
        want = tapestry.evaluate(g, {**{k: v.numpy() for k, v in weights.items()}, "x": x.numpy()})
        torch.testing.assert_close(outputs[0]["y"], dtypes.to_tensor(want["y"]), rtol=1e-5, atol=1e-5)


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


# -- tapestry.parallelize -------------------------------------------------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = torch.relu(self.up(x))
        return self.down(h), {"hidden": h}


def serve_module(batches: list[torch.Tensor], wrong: torch.Tensor) -> tuple[list[Any], str]:
    """On each launched rank: the MLP parallelized on a mesh of 2, called on every batch, then on a wrong shape."""
    model = tapestry.parallelize(_MLP().eval(), (batches[0],), mesh=2, compile=False, verbose=True,
                                 budget=tapestry.Budget(seconds=5), time_limit=5)
    outputs = [model(x) for x in batches]
    try:
        model(wrong)
    except ValueError as err:
        return outputs, str(err)
    return outputs, ""


def test_parallelize_serves_the_module_on_every_rank_and_plans_once_per_cache_key(tmp_path, monkeypatch, capfd
                                                                                   ) -> None:
    monkeypatch.setenv("TAPESTRY_PLAN_CACHE", str(tmp_path))
    batches = _calls(3, 2, (12, 16))
    module = _MLP().eval()
    for start in ("cold", "warm"):
        per_rank = launch(serve_module, batches, torch.zeros(5, 16), nproc=2, timeout=300)
        for outputs, refused in per_rank:
            for x, (y, extra) in zip(batches, outputs):
                want_y, want_extra = module(x)
                torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(extra["hidden"], want_extra["hidden"], rtol=1e-5, atol=1e-5)
            assert "expected shape [12, 16], given [5, 16]" in refused and "input 'x'" in refused
        log = capfd.readouterr().err
        assert ("plan cache hit, planning skipped" in log) == (start == "warm"), log
    assert len(list(tmp_path.glob("*.json"))) == 1


# -- faults and launchers -------------------------------------------------------------------------------------------


def fail_in_call(plan: Plan, bad_rank: int, bad_call: int, how: str) -> None:
    """Serve `plan`; rank `bad_rank` raises in call `bad_call` (or dies in it, or hangs before it while the others
    wait in it)."""
    import os
    import time

    from tapestry.spmd.program import ParallelProgram

    program = ParallelProgram(plan, compile=False)
    for call in range(bad_call + 3):
        inputs = {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(plan.graph, seed=call).items()}
        if dist.get_rank() == bad_rank and call == bad_call:
            if how == "raise":
                inputs["x"] = inputs["x"][:1]  # the wrong shape: refused on this rank alone
            elif how == "die":
                launch_module = __import__("tapestry.spmd.launch", fromlist=["note_call"])
                launch_module.note_call(call)
                os._exit(3)
            else:
                time.sleep(600)  # past every timeout the hang test gives: the launcher ends it
        program(**inputs)


@pytest.mark.parametrize("how, message", [
    ("raise", r"rank 1 failed in call 2 of its parallel program: ValueError: rank 1, call 2: input 'x': "
              r"expected shape \[8, 4\]"),
    ("die", r"rank 0 exited with code 3 in call 1 of its parallel program"),
])
def test_a_rank_that_fails_stops_every_rank_naming_the_rank_and_the_call(how: str, message: str) -> None:
    import time

    plan = CASES["seeds split on out"]()
    bad_rank, bad_call = (1, 2) if how == "raise" else (0, 1)
    start = time.monotonic()
    with pytest.raises(tapestry.spmd.launch.RankFailure, match=message):
        launch(fail_in_call, plan, bad_rank, bad_call, how, nproc=2, timeout=60)
    assert time.monotonic() - start < 30


def test_a_rank_that_hangs_is_named_at_the_timeout_and_no_rank_outlives_the_launcher() -> None:
    """Rank 0 hangs before call 1, where rank 1 waits for it. On a loaded machine the ranks may not get there in
    8 s (both still in call 0 or start-up at the timeout): the run is tried again with a longer timeout until
    rank 1 has reached call 1, and the message is then checked whole."""
    import multiprocessing

    plan = CASES["seeds split on out"]()
    for timeout in (8, 30, 120):
        with pytest.raises(tapestry.spmd.launch.RankFailure, match=rf"^timed out after {timeout} s: ") as raised:
            launch(fail_in_call, plan, 0, 1, "hang", nproc=2, timeout=timeout)
        assert multiprocessing.active_children() == []
        if "rank 1 in call 1 " in f"{raised.value} ":
            break
    assert str(raised.value) == (f"timed out after {timeout} s: rank(s) 0 had not reached call 1 of its parallel "
                                 "program, where rank(s) 1 wait for them; rank 0 in call 0 of its parallel program; "
                                 "rank 1 in call 1 of its parallel program")


@pytest.mark.slow
@pytest.mark.parametrize("own_group", [False, True])
def test_parallelize_runs_under_torchrun_in_its_own_group_or_one_it_opens(own_group: bool, tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "serve_torchrun.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TAPESTRY_PLAN_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                           "--no-compile", *(["--own-group"] if own_group else [])],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import re

    found = dict(re.findall(r"rank (\d): 3 calls, max abs difference from the module (\S+)", done.stdout))
    assert found.keys() == {"0", "1"} and all(float(v) < 1e-5 for v in found.values()), done.stdout


SLEEPER = """
import os, sys, time
import tapestry

def sleep(folder):
    import torch.distributed as dist
    open(os.path.join(folder, str(dist.get_rank())), "w").write(str(os.getpid()))
    time.sleep(120)

tapestry.launch(sleep, sys.argv[1], nproc=2, timeout=120)
"""


def test_sigterm_ends_the_launcher_and_its_ranks(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    deadline = time.monotonic() + 60
    while len([p for p in tmp_path.iterdir() if p.name in ("0", "1") and p.read_text()]) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


STOPPED = """
import os, signal, sys, time
from pathlib import Path
import tapestry
from tapestry import dtypes
from tapestry.plan import Plan
from tapestry.spmd.program import ParallelProgram

folder, how, compile = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "compiled"
plan = Plan.load(folder / "plan.json")
program = ParallelProgram(plan, compile=compile)
(folder / f"pid{program.rank}").write_text(str(os.getpid()))
for call in range(6):
    inputs = {k: dtypes.to_tensor(v) for k, v in tapestry.random_inputs(plan.graph, seed=call).items()}
    if program.rank == 1 and call == 3:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        (folder / "hung").write_text("")
        time.sleep(120)
    program(**inputs)
"""


def torchrun_stopped(folder: Path, how: str, compile: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """torchrun on 2 gloo ranks serving a plan (eager, or compiled whole by inductor); rank 1 is SIGKILLed at the
    start of call 3 (`kill`) or hangs there (`hang`) while rank 0 waits in call 3's collectives. The torchrun
    process and the ranks' pids."""
    import sys

    CASES["seeds split on out"]().save(folder / "plan.json")
    (folder / "stopped.py").write_text(STOPPED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            str(folder / "stopped.py"), str(folder), how, "compiled" if compile else "eager"],
                           env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((folder / f"pid{r}").exists() for r in (0, 1)) and run.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return run, [int((folder / f"pid{r}").read_text()) for r in (0, 1) if (folder / f"pid{r}").exists()]


def gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_under_torchrun_a_rank_killed_in_a_call_is_named_by_the_others_with_their_call(tmp_path) -> None:
    """Rank 1 is SIGKILLed in call 3: rank 0 ends (its collective fails, or torchrun's SIGTERM stops it while it
    waits there) saying on stderr that it is rank 0, in call 3, and that rank 1 had exited; nothing is left."""
    run, pids = torchrun_stopped(tmp_path, "kill")
    try:
        _, err = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0 and len(pids) == 2
    assert re.search(r"rank 0 (failed|stopped by SIGTERM) in call 3\b.*rank 1 \(pid \d+ on this host\) had "
                     r"already exited", err), err[-3000:]
    time.sleep(0.5)
    assert gone(pids)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_under_torchrun_sigterm_names_each_rank_and_its_call_even_while_blocked_in_a_collective(
        tmp_path, compile: bool) -> None:
    """Rank 1 hangs before call 3; rank 0 is blocked in call 3's collective (eager, or in inductor's compiled
    code), in C++, where a Python signal handler would not run. A SIGTERM to torchrun stops both within seconds,
    each naming itself and its call."""
    run, pids = torchrun_stopped(tmp_path, "hang", compile)
    deadline = time.monotonic() + 600
    while not (tmp_path / "hung").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # rank 0 is in call 3 by now, waiting for rank 1
    start = time.monotonic()
    run.send_signal(signal.SIGTERM)
    try:
        _, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert time.monotonic() - start < 15
    assert "tapestry: rank 0 stopped by SIGTERM in call 3 of its parallel program" in err, err[-3000:]
    assert "tapestry: rank 1 stopped by SIGTERM after call 2 of its parallel program" in err, err[-3000:]
    time.sleep(0.5)
    assert gone(pids)


WATCHED = """
import os, signal, time
from tapestry.spmd import faults
from tapestry.spmd.program import join_group

join_group(1)
faults.watch_sigterm(0)
child = os.fork()
if child == 0:  # a DataLoader worker, say: no watchdog thread here
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    os._exit(0)
_, status = os.waitpid(child, 0)
print("child ended by SIGTERM:", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, flush=True)
faults.note_call(0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_a_watched_rank_names_its_call_on_sigterm_and_a_child_it_forks_keeps_sigterms_default_action() -> None:
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", WATCHED], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "child ended by SIGTERM: True" in done.stdout
    assert "tapestry: rank 0 stopped by SIGTERM in call 0 of its parallel program" in done.stderr


def serve_on_grid(x: torch.Tensor) -> torch.Tensor:
    model = tapestry.parallelize(_MLP().eval(), (x,), mesh=tapestry.Mesh(2, 2), verbose=False)
    return (model(x * 2)[0] - _MLP().eval()(x * 2)[0]).abs().max()


@pytest.mark.slow
def test_parallelize_on_a_two_by_two_mesh_compiled_gives_the_module_on_every_rank(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TAPESTRY_PLAN_CACHE", str(tmp_path))
    errors = launch(serve_on_grid, torch.randn(12, 16), nproc=4, timeout=900)
    assert len(errors) == 4 and max(errors) < 1e-5


def test_the_plan_cache_key_changes_with_the_graph_mesh_rules_and_options(tmp_path) -> None:
    from tapestry.spmd.planning import plan_key

    g = chain(8, 4, 6)
    key = plan_key(g, Mesh(2), {})
    assert key == plan_key(chain(8, 4, 6), Mesh(2), {})  # equal inputs, equal key (no hash seed, no ids)
    rules = tmp_path / "one.egg"
    rules.write_text((Path(tapestry.__file__).parent / "rules" / "fusion.egg").read_text())
    others = {plan_key(chain(16, 4, 6), Mesh(2), {}), plan_key(g, Mesh(4), {}), plan_key(g, Mesh(2, 1), {}),
              plan_key(g, Mesh(2), {"time_limit": 3}), plan_key(g, Mesh(2), {"rules": [rules]})}
    assert key not in others and len(others) == 5


def test_a_plan_cache_hit_checks_the_plans_steps_but_not_again_its_meaning(tmp_path, monkeypatch) -> None:
    """optimize() checked the plan's meaning before it was cached: a warm start skips that (0.5 s on rank 0 for
    the training example) but still refuses a cache entry whose steps are broken."""
    import json

    import tapestry.verify
    from tapestry.spmd.planning import PlanningError, plan_key, shared_plan

    def meaning_check(plan: Plan, seed: int = 0) -> str:
        raise AssertionError("the meaning check ran on a plan cache hit")

    monkeypatch.setattr(tapestry.verify, "meaning_check", meaning_check)
    monkeypatch.setenv("TAPESTRY_PLAN_CACHE", str(tmp_path))
    graph, mesh = chain(8, 4, 6), Mesh(2)
    path = tmp_path / f"{plan_key(graph, mesh, {})}.json"
    build_plan(graph, mesh, {"linear_0": (0,)}).save(path)
    assert shared_plan(graph, mesh, verbose=False).to_json() == Plan.load(path, check=False).to_json()
    data = json.loads(path.read_text())
    data["steps"] = [s for s in data["steps"] if s.get("out") != data["steps"][0].get("out")]  # a place removed
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match=r"invalid plan (?s:.)* refers to 'v0', which no earlier step defines"):
        shared_plan(graph, mesh, verbose=False)


def test_a_plan_cache_hit_loads_the_plan_without_importing_the_optimizer(tmp_path) -> None:
    """A warm start reads its plan from the cache; the optimizer (and egglog under it, ~0.8 s of CPU) is imported
    only to plan."""
    import subprocess
    import sys

    from tapestry.spmd.planning import plan_key

    graph, mesh = chain(8, 4, 6), Mesh(2)
    build_plan(graph, mesh, {"linear_0": (0,)}).save(tmp_path / f"{plan_key(graph, mesh, {})}.json")
    script = ("import sys; from tapestry.graph import Graph; from tapestry.sharding import Mesh; "
              "from tapestry.spmd.planning import shared_plan; "
              "g = Graph(); h = g.relu(g.linear(g.input('x', (8, 4)), g.input('w0', (4, 6)), g.input('b0', (6,)))); "
              "g.output('y', g.linear(h, g.input('w1', (6, 6)), g.input('b1', (6,)))); "
              "plan = shared_plan(g, Mesh(2)); "
              "print(len(plan.steps), sorted(m for m in ('tapestry.optimizer', 'egglog') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TAPESTRY_PLAN_CACHE": str(tmp_path)}, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    assert "plan cache hit" in run.stderr
    assert run.stdout.split()[1:] == ["[]"], run.stdout
