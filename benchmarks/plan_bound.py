"""What `result.bound` (egraph.plan_bound) costs and gives on a cluster case, per HiGHS solver and with every lambda.

Builds one benchmarks/cluster.py case (hf LLaMA, 2 layers, training, 80 GB budget), optimizes it, then times
`plan_bound` on the result's own arguments (unfolded: also `group_launches`, the fusion groups every plan launches,
and its CPU s): with each solver (`plan_bound.SOLVER`: PDLP, the default; the dual
simplex; the interior point), and with the line search over lambda forced (`_exposed` taken true). One JSON line
per run.

    python benchmarks/plan_bound.py --mesh 2x4
    python benchmarks/plan_bound.py --mesh 8x8 --solvers pdlp --every-weight
    python benchmarks/plan_bound.py --layers 4 --solvers pdlp  # folded: the LP at lambda 1 over the periodic plans
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster  # noqa: E402

import tapestry  # noqa: E402
from tapestry import optimizer  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.egraph import plan_bound  # noqa: E402
from tapestry.egraph.group_launches import group_launches  # noqa: E402


def optimized(graph: tapestry.Graph, mesh: tapestry.Mesh, **options: Any
              ) -> tuple[optimizer.OptimizeResult, tuple[Any, ...], dict[str, Any]]:
    """`tapestry.optimize`, and the arguments its result's bound was read from (`plan_bound.lazy_bound`: the
    result keeps no decoder), to make the bound again or take it apart."""
    made: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    lazy = optimizer.lazy_bound

    def kept(*arguments: Any, **keywords: Any) -> Callable[[], plan_bound.PlanBound]:
        made.append((arguments, keywords))
        return lazy(*arguments, **keywords)

    optimizer.lazy_bound = kept
    try:
        result = optimizer.optimize(graph, mesh, **options)
    finally:
        optimizer.lazy_bound = lazy
    return result, *made[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="7B")
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--layers", type=int, default=2, help="from 3 on, folded (graph.layers, `layers=True`)")
    parser.add_argument("--solvers", default="pdlp,simplex,ipm", help="HiGHS `solver` values, comma-separated")
    parser.add_argument("--every-weight", action="store_true", help="also the line search over lambda, forced")
    args = parser.parse_args()
    case = cluster.Case(args.model, args.layers, "training", args.mesh, 8, 2048, memory_budget=80_000_000_000,
                        fold=args.layers > 2)
    imported = cluster.build(case)
    model = DefaultCostModel(load_profile(cluster.PROFILE))
    started = time.process_time()
    result, arguments, keywords = optimized(imported.graph, tapestry.Mesh(*case.shape), cost_model=model,
                                            memory_budget=case.memory_budget, layers=case.fold)
    base = {"model": args.model, "layers": args.layers, "folded": "periodic" in result.plan.notes,
            "status": result.status, "mesh": args.mesh, "seconds": result.plan.cost, "floor": result.floor,
            "optimize_cpu_s": time.process_time() - started, "load": os.getloadavg()[0]}
    if not base["folded"]:  # the fusion groups every plan launches (added at lambda 1), and what counting them takes
        device = model.profile.device
        cpu = time.process_time()
        base["launches"] = group_launches(arguments[0], arguments[1], device.launch_overhead
                                          * device.oversubscription(arguments[0].mesh.size))
        base["launches_cpu_s"] = time.process_time() - cpu
    runs = [(solver, False) for solver in args.solvers.split(",")]
    if args.every_weight:
        runs.append((plan_bound.SOLVER, True))
    exposed = plan_bound._exposed
    for solver, every in runs:
        plan_bound.SOLVER = solver
        plan_bound._exposed = (lambda plan, model: True) if every else exposed
        cpu = time.process_time()
        bound = plan_bound.plan_bound(*arguments, **keywords)
        print(json.dumps({**base, "solver": solver, "every_weight": every, "bound": bound.seconds,
                          "source": bound.source, "lps": bound.lps, "bound_cpu_s": time.process_time() - cpu,
                          "why": bound.why}), flush=True)


if __name__ == "__main__":
    main()
