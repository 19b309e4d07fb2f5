"""Extraction under unfused against fusion-aware node costs, on one saturated e-graph (egraph/fused_prices.py).

Each case is explored once; then `Explored.extract` runs twice with the default model: once through a wrapper that
prices plans the same (fused, `plan_step_costs`) but offers extraction no `fused_device`, which is what extraction
did before it saw fused prices, and once as is. Both plans are priced by `plan_cost` (fused), so the columns differ
only by what extraction saw, never by what a budget cut from the search. The optimizer's mesh-size gate
(`optimizer.FUSED_EXTRACTION_DEVICES`) is lifted, so small meshes are compared too. Prints one JSON line per case.

    python benchmarks/fused_extraction.py --case llama --mesh 2x2          # an importer zoo family, cpu-gloo
    python benchmarks/fused_extraction.py --case block --mesh 8x8          # 2 LLaMA-7B blocks' training step,
                                                                           # gpu-h100-cluster (as benchmarks/cluster.py)
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from tapestry.cost import DefaultCostModel
from tapestry.plan import Plan
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class UnfusedNodeCosts:
    """`model` for plans, without the fused node costs it offers extraction: the optimizer before them."""

    model: DefaultCostModel

    def step_cost(self, step: Any, mesh: Mesh) -> float:
        return self.model.step_cost(step, mesh)

    def plan_step_costs(self, plan: Plan) -> dict[str, float]:
        return self.model.plan_step_costs(plan)


def case_graph(name: str) -> tuple[Any, DefaultCostModel]:
    """The graph and the cost model: an importer zoo family with the default model, or `block` (benchmarks/cluster.py's
    7B-width LLaMA blocks, 2 layers, training, batch 8 x 2048) with gpu-h100-cluster."""
    from tapestry.cost import default_cost_model, load_profile

    if name == "block":
        from cluster import PROFILE, Case, build

        return build(Case("7B", 2, "training", "8x8", 8, 2048, arch="block")).graph, DefaultCostModel(
            load_profile(PROFILE))
    from phases import model

    return model(name, 1), default_cost_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama", help="an importer zoo family (phases.py --model) or 'block'")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds (the default)")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    from tapestry import optimizer
    from tapestry.optimizer import Budget, explore

    optimizer.FUSED_EXTRACTION_DEVICES = 1  # compare on every mesh, the gate's own small ones included
    graph, model = case_graph(args.case)
    explored = explore(graph, Mesh.parse(args.mesh), budget=Budget(seconds=args.budget))
    row: dict[str, Any] = {"case": args.case, "mesh": args.mesh, "status": ""}
    for name, seen in (("unfused", UnfusedNodeCosts(model)), ("fused", model)):
        cpu = time.process_time()
        result = explored.extract(seen, time_limit=args.time_limit)
        row[f"{name}_s"] = result.plan.cost
        row[f"{name}_extract_cpu"] = round(time.process_time() - cpu, 2)
        row["status"] += f"{name}: {result.status} ({result.plan.notes.get('node_costs', 'unfused')}) "
    row["ratio"] = row["fused_s"] / row["unfused_s"]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
