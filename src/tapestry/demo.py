"""`make demo`: the main job on the embedded default, a local 4-rank CPU mesh.

For the seeds' example Y = ReLU(Linear(X, W, b)) and a 4-layer MLP: build the graph, optimise it,
show the plan (text and an SVG), run it with torch.distributed, verify it against the reference
evaluator, and compare the measured time with single-process eager torch and the predicted cost. Then serve the
MLP's plan the persistent way: one ParallelProgram per rank, weights placed once, new inputs every call.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import tapestry
from tapestry.cost import run_costs
from tapestry.graph.render import write_picture
from tapestry.lower import lower
from tapestry.lower.compile import use_persistent_cache, warm_cache
from tapestry.models import mlp, seeds_example
from tapestry.optimizer import default_cost_model
from tapestry.plan.explain import explain
from tapestry.plan.render import plan_to_dot
from tapestry.runtime import run_plans
from tapestry.runtime.eager import eager_seconds

RANKS = 4
SERVED_CALLS = 20
TOLERANCE = 1e-4  # relative to the largest output value, float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--no-compile", action="store_true", help="run the shard kernels eagerly")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    console = Console(width=max(Console().width, 110))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    examples = {"seeds' relu(linear(x,w,b))": seeds_example(1024, 512, 512),
                "4-layer MLP": mlp(depth=4, batch=512, width=256)}
    results = {}
    for i, (title, graph) in enumerate(examples.items()):
        console.rule(f"[bold]{title}")
        console.print(str(graph))
        result = tapestry.optimize(graph, tapestry.Mesh(RANKS))
        results[title] = result
        console.print(f"\n[bold]plan[/] ({result.stats.stopped_by} after {len(result.stats.iterations)} rounds, "
                      f"{result.stats.enodes} e-nodes):")
        console.print(explain(result.plan), highlight=False)
        svg = write_picture(plan_to_dot(result.plan), args.out / f"plan{i}.svg")
        result.plan.save(args.out / f"plan{i}.json")
        console.print(f"picture: {svg}")
    plans = [r.plan for r in results.values()]
    if not args.no_compile:
        use_persistent_cache()
        with console.status("compiling shard kernels with inductor (cached for later runs)"):
            compiled = sum(warm_cache(lower(p)) for p in plans)
        console.print(f"compiled {compiled} distinct shard kernels")
    with console.status(f"running both plans on {RANKS} ranks (gloo)"):
        runs = run_plans(plans, nproc=RANKS, compile=not args.no_compile, warmup=1, repeat=5)
    model = default_cost_model()  # the one optimize used
    table = Table("program", "ranks", "measured ms", "eager torch ms (1 process)", "predicted ms", "max rel error",
                  title=f"{RANKS}-rank CPU mesh, one thread per rank")
    ok = True
    for (title, result), run in zip(results.items(), runs):
        graph = result.plan.graph
        expected = tapestry.evaluate(graph, tapestry.random_inputs(graph, seed=0))
        error = max(float(np.abs(run.outputs[k] - v).max() / max(np.abs(v).max(), 1e-30)) for k, v in expected.items())
        ok &= error <= TOLERANCE
        table.add_row(title, str(RANKS), f"{run.seconds * 1e3:.2f}", f"{eager_seconds(graph) * 1e3:.2f}",
                      f"{sum(run_costs(result.plan, model).values()) * 1e3:.2f}", f"{error:.1e}" + ("" if error <= TOLERANCE else " FAIL"))
    console.print(table)
    console.print(f"measured: the slowest rank, from placed inputs to outputs gathered on rank 0, {RANKS} ranks "
                  f"sharing this machine's {os.cpu_count()} cores; predicted: the cost model (cpu-gloo profile) "
                  "for the plan and the gather of its outputs to rank 0")
    with console.status(f"serving the MLP's plan persistently on {RANKS} ranks (tapestry.launch, ParallelProgram)"):
        served = tapestry.launch(serve, plans[1], SERVED_CALLS, not args.no_compile, nproc=RANKS)
    seconds, start, error = max(s[0] for s in served), max(s[1] for s in served), max(s[2] for s in served)
    ok &= error <= TOLERANCE
    console.print(f"persistent: the 4-layer MLP's plan made once per rank (weights placed once, "
                  f"{'compiled whole' if not args.no_compile else 'eager'}; start-up {start:.1f} s), then "
                  f"{SERVED_CALLS} calls on new inputs, {seconds * 1e3:.2f} ms per call, the output on every rank; "
                  f"max rel error {error:.1e}" + ("" if error <= TOLERANCE else " FAIL"))
    console.print(f"verified against the reference evaluator: {'yes' if ok else 'NO'}; "
                  f"demo took {time.perf_counter() - started:.0f} s")
    if not ok:
        raise SystemExit(1)


def serve(plan: tapestry.Plan, calls: int, compile: bool) -> tuple[float, float, float]:
    """On each rank: a ParallelProgram holding the weights, called `calls` times with a new x; seconds per call,
    start-up seconds (placing, and the first call's compile), and the largest error relative to the evaluator."""
    import torch
    import torch.distributed as dist

    graph = plan.graph
    start = time.perf_counter()
    values = tapestry.random_inputs(graph, seed=0)
    program = tapestry.ParallelProgram(plan, {k: torch.from_numpy(v) for k, v in values.items() if k != "x"},
                                       compile=compile)
    error = 0.0
    for seed in range(2):  # the first call compiles; both are checked
        values["x"] = tapestry.random_inputs(graph, seed=seed + 1)["x"]
        want = tapestry.evaluate(graph, values)["y"]
        got = program(torch.from_numpy(values["x"]))["y"].numpy()
        error = max(error, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)))
    started = time.perf_counter() - start
    batches = [torch.randn(values["x"].shape) for _ in range(calls)]
    dist.barrier()
    begin = time.perf_counter()
    for x in batches:
        program(x)
    dist.barrier()
    return (time.perf_counter() - begin) / calls, started, error


if __name__ == "__main__":
    main()
