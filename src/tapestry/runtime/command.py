"""`tapestry run` and `tapestry lower`: run a plan (or a script's graph) on ranks, or print its rank programs.

Under torchrun (RANK and WORLD_SIZE set) `run` is one rank and rank 0 reports;
otherwise it spawns the ranks itself.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, run_costs
from tapestry.graph import Graph, check_name
from tapestry.kernels import DimKind
from tapestry.lower import lower
from tapestry.plan import Plan, build_plan
from tapestry.program import load_program
from tapestry.runtime.launch import Job, RankFailure, RunResult, default_backend, run_torchrun, spawn
from tapestry.runtime.execute import InputSource
from tapestry.sharding import Mesh
from tapestry.verify import compare
from tapestry.zspace import ZRange

PROFILE_WARMUP, PROFILE_REPEAT = 1, 5


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="run a plan or a graph script on N ranks (gloo or nccl)",
                                description="Lower a plan to one program per rank and run it with torch.distributed.")
    _target(run)
    run.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl when CUDA is available, else gloo")
    run.add_argument("--no-compile", dest="compile", action="store_false", help="run shard kernels eagerly")
    run.add_argument("--verify", action="store_true", help="compare with the numpy reference; exit 1 if it differs")
    run.add_argument("--profile", action="store_true", help="time each step per rank, next to the cost model")
    run.add_argument("--cost-profile", default="cpu-gloo", help="device profile for --profile's predictions")
    run.add_argument("--inputs", type=Path, help="folder of NAME.npy / NAME.pt per graph input (default: random)")
    run.add_argument("--seed", type=int, default=0, help="seed for random inputs (as tapestry.random_inputs)")
    run.add_argument("--save-outputs", type=Path, metavar="DIR", help="write each output as DIR/NAME.npy")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck run is killed")
    run.set_defaults(func=_run)

    low = subparsers.add_parser("lower", help="print the per-rank programs of a plan",
                                description="Show what each rank runs: shard kernels and exact communication.")
    _target(low)
    low.add_argument("--rank", type=int, help="print only this rank")
    low.add_argument("--check-collectives", action="store_true",
                     help="trace every rank under the fake process group (no data) and check its collectives match "
                          "across ranks instead of printing; exit 1 if they do not")
    low.set_defaults(func=_lower)


def _target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", type=Path, help="PLAN.json, or SCRIPT.py defining `graph` (and optionally `mesh`)")
    parser.add_argument("--nproc", type=_positive, help="ranks (default: the plan's mesh size)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def load_target(path: Path, nproc: int | None) -> Plan:
    """A saved plan, or a script's graph planned by tapestry.optimize (data parallel until that exists)."""
    if path.suffix != ".py":
        plan = Plan.load(path)  # checked: an edited file is refused
        if nproc is not None and nproc != plan.mesh.size:
            raise ValueError(f"{path}: the plan's mesh {plan.mesh} has {plan.mesh.size} devices, not --nproc {nproc}")
        return plan
    graph, mesh = load_program(path)
    mesh = mesh or Mesh(nproc or 1)
    if nproc is not None and mesh.size != nproc:
        raise ValueError(f"{path}: its mesh {mesh} has {mesh.size} devices, not --nproc {nproc}")
    optimize = getattr(tapestry, "optimize", None)
    return optimize(graph, mesh=mesh).plan if optimize else data_parallel(graph, mesh)


def data_parallel(graph: Graph, mesh: Mesh) -> Plan:
    """Every op splits its first index dim over mesh axis 0 where that dim is parallel and large enough."""
    axes = {}
    for node in graph.ops:
        sig = graph.signature(node.name)
        ok = sig.index.ndim > 0 and sig.dim_kinds[0] is DimKind.PARALLEL and sig.index.shape[0] >= mesh.shape[0]
        axes[node.name] = (0 if ok else None, *(None,) * (mesh.ndim - 1))
    return build_plan(graph, mesh, axes)


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run(args: argparse.Namespace) -> int:
    nproc = args.nproc or (int(os.environ["WORLD_SIZE"]) if _torchrun() else None)
    plan = load_target(args.target, nproc)
    source = InputSource(args.seed, args.inputs)
    source.check(plan.graph)
    warmup, repeat = (PROFILE_WARMUP, PROFILE_REPEAT) if args.profile else (0, 1)
    backend = args.backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", plan.mesh.size)))
    job = Job((lower(plan),), (source,), args.compile, backend, args.timeout, warmup, repeat)
    try:
        results = run_torchrun(job) if _torchrun() else spawn(job)
    except RankFailure as err:
        print(f"tapestry run: {err}", file=sys.stderr)
        return 1
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    result = results[0]
    mode = "compiled" if args.compile else "eager"
    first = " (one run, including compilation)" if args.compile and not args.profile else ""
    print(f"ran {args.target} on {plan.mesh.size} ranks ({backend}, {mode}): {result.seconds * 1e3:.2f} ms{first}")
    if args.save_outputs:
        args.save_outputs.mkdir(parents=True, exist_ok=True)
        for name, array in result.outputs.items():
            np.save(args.save_outputs / f"{check_name(name, 'output')}.npy", array)  # never a path out of the folder
    if args.profile:
        Console().print(profile_table(plan, result, args.cost_profile))
    if args.verify:
        return 0 if verify(plan, result.outputs, source) else 1
    return 0


def _lower(args: argparse.Namespace) -> int:
    program = lower(load_target(args.target, args.nproc))
    if args.check_collectives:
        from tapestry.spmd.check import CollectiveMismatch, check_collectives  # loads torch's fake process group
        try:
            print(check_collectives(program))
        except CollectiveMismatch as err:
            print(f"tapestry lower: {err}", file=sys.stderr)
            return 1
        return 0
    if args.rank is not None and not 0 <= args.rank < len(program.ranks):
        raise ValueError(f"--rank {args.rank}: the plan has ranks 0..{len(program.ranks) - 1}")
    print(program if args.rank is None else program.ranks[args.rank])
    return 0


def verify(plan: Plan, outputs: Mapping[str, np.ndarray], source: InputSource) -> bool:
    """Print each output's error against tapestry.evaluate on the same inputs (tapestry.verify: per-dtype
    tolerance after the precision the plan computes in, NaN agrees only with NaN); True when all agree."""
    graph = plan.graph
    inputs = {n.name: source.block(graph, n.name, ZRange.from_shape(n.shape)) for n in graph.inputs}
    errors = compare(outputs, tapestry.evaluate(graph, inputs), graph, plan)
    for name, err in errors.items():
        verdict = "ok" if err.ok else f"FAIL (tolerance {err.tolerance:g})"
        print(f"verify {name}: {err}  {verdict}")
    return all(e.ok for e in errors.values())


def profile_table(plan: Plan, result: RunResult, cost_profile: str) -> Table:
    """Rows are plan steps, columns ranks (median ms over the timed runs), and the cost model's prediction."""
    model = DefaultCostModel(load_profile(cost_profile))
    table = Table(title=f"per-step wall time, ms (median of {len(result.ranks[0].iterations)} runs)")
    for column in ("step", "kind", *(f"rank {r.rank}" for r in result.ranks), f"predicted ({cost_profile})"):
        table.add_column(column, justify="left" if column in ("step", "kind") else "right")
    by_step = [{t.step: t for t in r.steps} for r in result.ranks]
    labels = {t.step: t for r in result.ranks for t in r.steps}
    predicted = run_costs(plan, model)
    for step, first in sorted(labels.items()):
        cells = [f"{ranks[step].seconds * 1e3:.3f}" if step in ranks else "-" for ranks in by_step]
        guess = predicted.get(step)
        table.add_row(f"[{step}] {first.label}", first.kind, *cells, "-" if guess is None else f"{guess * 1e3:.3f}",
                      end_section=step == max(labels))
    for kind in ("place", "prepare", "compute", "comm"):
        totals = [sum(t.seconds for t in r.steps if t.kind == kind) * 1e3 for r in result.ranks]
        guess = sum(v for k, v in predicted.items() if k in labels and labels[k].kind == kind) * 1e3
        table.add_row(f"total {kind}", "", *(f"{t:.3f}" for t in totals), f"{guess:.3f}")
    walls = [float(np.median(r.iterations)) * 1e3 for r in result.ranks]  # placing is setup, outside the wall
    per_run = sum(v for k, v in predicted.items() if k >= len(plan.steps) or plan.steps[k].out not in plan.prepared)
    table.add_row("wall", "", *(f"{w:.3f}" for w in walls), f"{per_run * 1e3:.3f}")  # prepared steps are setup
    return table

