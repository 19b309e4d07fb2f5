"""What the bound's LP at lambda 1 (egraph.plan_bound) pays, by kind of node, on a cluster case: where it is loose.

Builds one benchmarks/cluster.py case (hf LLaMA, training, 80 GB budget, unfolded), optimizes it, then solves the LP
at lambda 1 as `plan_bound` does under fusion (fusible nodes and gradient reductions at 0; the constants it adds,
the fusion floor and the groups' launches, left out) and sums its solution's x times the node price per kind:
library kernels (forward, or could be backward), fusible kernels, gradient reductions (priced 0 at lambda 1), other
reshards, Places and Delivers; and how many layouts each input is placed in at x above 1%. One JSON line.

    python benchmarks/plan_bound_parts.py --mesh 2x4
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster  # noqa: E402
from plan_bound import optimized  # noqa: E402

import tapestry  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.egraph import plan_bound  # noqa: E402
from tapestry.extract.work import Meter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="7B")
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    case = cluster.Case(args.model, args.layers, "training", args.mesh, 8, 2048, memory_budget=80_000_000_000,
                        fold=False)
    imported = cluster.build(case)
    model = DefaultCostModel(load_profile(cluster.PROFILE))
    _, arguments, _ = optimized(imported.graph, tapestry.Mesh(*case.shape), cost_model=model,
                                memory_budget=case.memory_budget, layers=False)
    decoder, egraph, model, plan = arguments[:4]
    reductions, backward = plan_bound.overlap_roles(decoder, plan.graph.carried)
    floors = plan_bound.node_floors(decoder, egraph.node_cost, model)
    costs = [0.0 if n in reductions or plan_bound._fusible(decoder, node) else f
             for n, (f, node) in enumerate(zip(floors, decoder.nodes))]
    started = time.process_time()
    solved = plan_bound._lp(egraph.with_costs(costs), Meter(60.0).until(60.0))
    if solved.values is None:
        raise SystemExit("the LP was not solved within 60 s of work")
    bound, values = solved.bound, solved.values

    def kind(n: int) -> str:
        node = decoder.nodes[n]
        if node.op == "Reshard":
            return "reduction" if n in reductions else "reshard"
        if node.op in ("Place", "Deliver"):
            return node.op
        return ("fusible" if plan_bound._fusible(decoder, node) else "library") + (" (could be backward)"
                                                                                   if n in backward else "")

    paid: dict[str, float] = defaultdict(float)
    for n, x in values.items():
        if math.isfinite(costs[n]):
            paid[kind(n)] += x * costs[n]
    placed = Counter(decoder.nodes[n].key for n, x in values.items() if decoder.nodes[n].op == "Place" and x > 0.01)
    print(json.dumps({"model": args.model, "layers": args.layers, "mesh": args.mesh, "plan_ms": plan.cost * 1e3,
                      "lp_ms": bound * 1e3, "lp_cpu_s": time.process_time() - started,
                      "paid_ms": {k: round(v * 1e3, 4) for k, v in sorted(paid.items())},
                      "layouts_per_placed_input": dict(sorted(Counter(placed.values()).items()))}))


if __name__ == "__main__":
    main()
