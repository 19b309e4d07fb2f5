"""Seconds per optimizer phase (saturation, pricing, extraction) for a transformer stack, one case per run.

    .venv/bin/python benchmarks/phases.py --mesh 2x4 --layers 12 [--rules fusion,substitution] [--budget 30]
        [--extractor greedy-dag] [--time-limit 10] [--optimize]

Prints one JSON line. With --optimize it times `tapestry.optimize` whole instead (validation and the
plan's meaning check included). It uses only APIs older trees have too, so the same file can time an older
checkout side by side (PYTHONPATH=OLD/src .venv/bin/python benchmarks/phases.py ...).
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from collections import Counter

from tapestry.egraph.driver import Budget
from tapestry.egraph.rules import BUILTIN_DIR
from tapestry.extract import extract
from tapestry.models import transformer_stack
from tapestry.optimizer import default_cost_model, explore, optimize
from tapestry.sharding import Mesh


FUSED = {"linear_relu", "linear_gelu", "add_relu"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rules", default="", help="rule files by name (default: all shipped)")
    parser.add_argument("--budget", type=float, default=30.0, help="Budget(seconds=...)")
    parser.add_argument("--extractor", default="greedy-dag")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--optimize", action="store_true", help="time tapestry.optimize end to end")
    args = parser.parse_args()
    mesh = Mesh.parse(args.mesh)
    rules = [BUILTIN_DIR / f"{r}.egg" for r in args.rules.split(",")] if args.rules else None
    graph = transformer_stack(args.layers, 4, 256, 1024, 16)
    start = time.perf_counter()
    if args.optimize:
        result = optimize(graph, mesh, rules, Budget(seconds=args.budget), extractor=args.extractor,
                          time_limit=args.time_limit)
        kernels = Counter(getattr(step, "kernel", "") for step in result.plan.steps)
        print(json.dumps({
            "mesh": args.mesh, "layers": args.layers, "rules": args.rules or "all", "budget": args.budget,
            "optimize_s": round(time.perf_counter() - start, 2), "stopped_by": result.stats.stopped_by,
            "undone": getattr(result.stats, "undone", ""), "enodes": result.stats.enodes,
            "cost": result.plan.cost, "extractor": args.extractor, "status": result.selection.status,
            "gap": result.selection.gap, "fused_kernels": sum(n for k, n in kernels.items() if k in FUSED),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        }), flush=True)
        return
    explored = explore(graph, mesh, rules, Budget(seconds=args.budget))
    saturated = time.perf_counter()
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model(),
                                               *([explored.pricing_seconds] if hasattr(explored, "pricing_seconds")
                                                 else []))
    priced = time.perf_counter()
    selection = extract(egraph, args.extractor, args.time_limit)
    done = time.perf_counter()
    stats = explored.stats
    plan = explored.decoder.plan(egraph, selection, graph, explored.names)
    kernels = Counter(getattr(step, "kernel", "") for step in plan.steps)
    print(json.dumps({
        "mesh": args.mesh, "layers": args.layers, "rules": args.rules or "all", "budget": args.budget,
        "saturate_s": round(saturated - start, 2), "price_s": round(priced - saturated, 2),
        "extract_s": round(done - priced, 2), "total_s": round(done - start, 2),
        "stopped_by": stats.stopped_by, "stopped_in": getattr(stats, "stopped_in", ""),
        "undone": getattr(stats, "undone", ""), "enodes": stats.enodes,
        "extraction_nodes": len(explored.decoder.nodes), "cost": selection.dag_cost,
        "extractor": args.extractor, "status": selection.status,
        "fused_kernels": sum(n for k, n in kernels.items() if k in FUSED),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }), flush=True)


if __name__ == "__main__":
    main()
