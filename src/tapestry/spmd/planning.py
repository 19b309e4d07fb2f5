"""The plan every rank runs: made once, on rank 0, and shared as plan JSON; cached on disk across starts.

Planning is not deterministic across processes (the ILP runs under a time limit), so one rank plans and
`dist.broadcast_object_list` hands the others its JSON. The cache (`~/.cache/tapestry/plans`, or
$TAPESTRY_PLAN_CACHE) is keyed by everything the plan depends on: the graph, the mesh, the cost model (its
profile's numbers), the rule files' text, and the planning options; a second start with the same key loads the
plan and skips planning, and says so.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tapestry.graph import Graph, graph_to_json
from tapestry.plan.plan import Plan
from tapestry.plan.validate import validate_loaded
from tapestry.runtime.launch import _main_module_hidden
from tapestry.sharding import Mesh
from tapestry.spmd.launch import forked

CACHE_ENV = "TAPESTRY_PLAN_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "tapestry" / "plans"


class PlanningError(RuntimeError):
    """Planning failed on rank 0; every rank raises this with rank 0's message (none is left waiting)."""


def plan_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE))


def plan_key(graph: Graph, mesh: Mesh, options: dict[str, Any]) -> str:
    """A digest of the graph, mesh, cost model, rules and options: equal keys plan alike."""
    from tapestry.cost import default_cost_model
    from tapestry.egraph.rules import builtin_rule_paths, rule_paths

    rules: Sequence[str | Path] | None = options.get("rules")
    paths = rule_paths(rules) if rules is not None else builtin_rule_paths()
    parts = {
        "graph": graph_to_json(graph),
        "mesh": mesh.to_json(),
        "cost_model": repr(options.get("cost_model") or default_cost_model()),
        "rules": [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths],
        "options": {k: repr(v) for k, v in sorted(options.items()) if k not in ("rules", "cost_model", "progress")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def shared_plan(graph: Graph, mesh: Mesh, cache: bool = True, verbose: bool = True, **options: Any) -> Plan:
    """`tapestry.optimize(graph, mesh, **options).plan`, made on rank 0 (or read from the plan cache) and sent to
    every rank of the default process group (if there is one). Collective: every rank calls it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    message: list[Any] = [None]
    if rank == 0:
        try:
            message = [("ok", _plan_on_rank0(graph, mesh, cache, verbose, options).to_json())]
        except Exception as err:  # every rank must hear of it, or the others wait in the broadcast
            message = [("error", f"planning failed on rank 0: {type(err).__name__}: {err}")]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        raise PlanningError(payload)
    return Plan.from_json(payload, "the plan from rank 0")


def _plan_on_rank0(graph: Graph, mesh: Mesh, cache: bool, verbose: bool, options: dict[str, Any]) -> Plan:
    path = plan_cache() / f"{plan_key(graph, mesh, options)}.json" if cache else None
    if path is not None and path.exists():
        plan = Plan.load(path, check=False)
        validate_loaded(plan, str(path), meaning=False)  # its steps; its meaning was checked before it was saved
        _say(verbose, f"tapestry: plan cache hit, planning skipped ({path})")
        return plan
    start = time.perf_counter()
    if forked():  # egglog's native thread pools do not survive fork: plan in a fresh process
        with concurrent.futures.ProcessPoolExecutor(1, mp.get_context("spawn")) as pool, _main_module_hidden():
            plan = Plan.from_json(pool.submit(_optimized_json, graph_to_json(graph), mesh.to_json(), options).result())
    else:
        from tapestry.optimizer import optimize  # imported only to plan: a cache hit never loads egglog

        plan = optimize(graph, mesh, **options).plan
    _say(verbose, f"tapestry: planned {len(graph.ops)} ops on mesh {mesh} in {time.perf_counter() - start:.1f} s"
                  + (f", cached as {path}" if path is not None else ""))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".tmp{os.getpid()}")
        plan.save(scratch)
        scratch.replace(path)  # atomic: a concurrent start reads a whole plan or none
    return plan


def _optimized_json(graph: dict[str, Any], mesh: list[int], options: dict[str, Any]) -> dict[str, Any]:
    from tapestry.graph import graph_from_json
    from tapestry.optimizer import optimize

    return optimize(graph_from_json(graph), Mesh(*mesh), **options).plan.to_json()


def _say(verbose: bool, line: str) -> None:
    if verbose:
        print(line, file=sys.stderr, flush=True)
