"""Lowering benchmark: what running a plan costs next to plain torch and to DTensor, and whether the cost model saw it.

For each workload: a) eager torch in one process, b) the unsharded plan on 1 rank,
c) the data-parallel and the optimised plans on 2 and 4 gloo ranks, d) a DTensor
program with the data-parallel plan's placements. One thread per rank. Writes the
"Lowering" section of docs/benchmarks.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: every rank, and the spawned ones, use one thread

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

import tapestry
from _report import write_section
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.models import mlp, seeds_example, transformer_block
from tapestry.runtime.eager import eager_seconds, interpret
from tapestry.graph import Graph
from tapestry.kernels import get_kernel
from tapestry.plan import Place, Plan, build_plan
from tapestry.runtime import run_plans
from tapestry.runtime.launch import free_port
from tapestry.runtime.command import data_parallel
from tapestry.sharding import Layout, Mesh


WARMUP, REPEAT = 2, 10
RANKS = (2, 4)


WORKLOADS = {
    "seeds MLP 1024x512x512": lambda: seeds_example(1024, 512, 512),
    "4-layer MLP 512x256": lambda: mlp(4, 512, 256),
    "transformer block 4x64x128": transformer_block,
}


def placements(plan: Plan) -> dict[str, str]:
    """'shard' for inputs the plan places split on dim 0 over the mesh, else 'replicate'."""
    found = {}
    for step in plan.steps:
        if isinstance(step, Place):
            split = step.layout == Layout.split(step.shape, plan.mesh, (0,))
            found.setdefault(step.input, "shard" if split else "replicate")
    return found


def _dtensor_rank(rank: int, world: int, port: int, jobs: list[tuple[str, dict[str, str]]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, placed in jobs:
        graph = WORKLOADS[name]()
        inputs = {}
        for key, array in tapestry.random_inputs(graph).items():
            whole = torch.from_numpy(array)
            local = whole.tensor_split(world)[rank] if placed[key] == "shard" else whole
            inputs[key] = DTensor.from_local(local, mesh, [Shard(0) if placed[key] == "shard" else Replicate()],
                                             run_check=False)
        times = []
        try:
            for _ in range(WARMUP + REPEAT):
                dist.barrier()
                start = time.perf_counter()
                [t.full_tensor() for t in interpret(graph, inputs).values()]
                dist.barrier()
                times.append(time.perf_counter() - start)
            results[name] = float(np.median(times[WARMUP:]))
        except Exception as err:  # an op DTensor cannot shard: reported, not fatal
            results[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def dtensor_seconds(world: int, jobs: list[tuple[str, dict[str, str]]]) -> dict[str, float | str]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_dtensor_rank, args=(world, free_port(), jobs, out.name), nprocs=world)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    command = "python benchmarks/lowering.py" + ("" if args.compile else " --no-compile")
    model = DefaultCostModel(load_profile("cpu-gloo"))
    graphs = {name: make() for name, make in WORKLOADS.items()}

    eager = {name: eager_seconds(g) for name, g in graphs.items()}
    print("eager", eager, flush=True)
    plans: dict[tuple[str, str, int], Plan] = {(n, "unsharded", 1): build_plan(g, Mesh(1)) for n, g in graphs.items()}
    for world in RANKS:
        for name, g in graphs.items():
            plans[name, "data parallel", world] = data_parallel(g, Mesh(world))
            plans[name, "optimised", world] = tapestry.optimize(g, mesh=Mesh(world)).plan
    measured: dict[tuple[str, str, int], float | str] = {}
    steps: dict[tuple[str, str, int], int] = {}
    for world in (1, *RANKS):
        keys = [k for k in plans if k[2] == world]
        results = run_plans([plans[k] for k in keys], compile=args.compile, timeout=600, warmup=WARMUP, repeat=REPEAT)
        for key, result in zip(keys, results):
            measured[key] = result.seconds
            steps[key] = len(result.ranks[0].steps)
        print(world, "ranks done", flush=True)
        if world > 1:
            jobs = [(n, placements(plans[n, "data parallel", world])) for n in graphs]
            for name, value in dtensor_seconds(world, jobs).items():
                measured[name, "DTensor (data parallel)", world] = value
    write_section("Lowering", command, report(graphs, eager, plans, measured, steps, model, args.compile))


def _ms(value: float | str) -> str:
    return f"{value * 1e3:.2f}" if isinstance(value, float) else f"n/a ({value})"


def report(graphs, eager, plans, measured, steps, model, compiled: bool) -> str:
    columns = [("unsharded", 1)] + [(kind, w) for w in RANKS for kind in ("data parallel", "optimised",
                                                                           "DTensor (data parallel)")]
    head = "| workload | eager torch, 1 process | " + " | ".join(f"{k}, {w} rank{'s' * (w > 1)}" for k, w in columns)
    lines = [
        f"{'torch.compile' if compiled else 'eager'} shard kernels, gloo on loopback, 1 thread per rank, "
        f"{os.cpu_count()} cores shared by all ranks; median of {REPEAT} runs after {WARMUP} warm-up, in ms "
        "(slowest rank; plans include placing inputs and gathering outputs to rank 0, DTensor includes "
        "`full_tensor()` on every rank).",
        "",
        head + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for name in graphs:
        cells = [_ms(measured.get((name, k, w), "not run")) for k, w in columns]
        lines.append(f"| {name} | {_ms(eager[name])} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios to eager torch, predicted (cost model, profile cpu-gloo) vs measured, and runtime overhead:",
              "", "| workload | plan | ranks | measured / eager | predicted ms | measured / predicted | steps on rank 0 |",
              "|---|---|---|---|---|---|---|"]
    for (name, kind, world), plan in plans.items():
        value = measured[name, kind, world]
        predicted = plan_cost(plan, model)
        lines.append(f"| {name} | {kind} | {world} | {value / eager[name]:.2f} | {predicted * 1e3:.2f} | "
                     f"{value / predicted:.1f} | {steps[name, kind, world]} |")
    lines += ["", "Overhead per step: (unsharded plan on 1 rank - eager torch) / steps, in ms: " + ", ".join(
        f"{name}: {(measured[name, 'unsharded', 1] - eager[name]) / steps[name, 'unsharded', 1] * 1e3:.3f}"
        for name in graphs) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
