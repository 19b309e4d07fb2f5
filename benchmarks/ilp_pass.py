"""CPU seconds of the ILP (`extract_ilp`, 10 s limit, its default stop gap) on tiny zoo models' extraction graphs,
with the selection it returns: the phase whose path depended on the load, timed apart from saturation and pricing.

    .venv/bin/python benchmarks/ilp_pass.py [--model mixtral,qwen2_moe,olmoe,llama] [--mesh 2x2]

The graph is priced as `Explored.extract` prices it on an inference graph with outputs "any" (as
benchmarks/lp_bound.py), and the ILP runs with the garbage collector held off, as `Explored.extract` runs it. The
ILP's shares of its limit (the LP pass, its path graphs) end on counts of work (extract/work.py), so the path is
the one an idle machine takes whatever the load (a `--cpu-clock` option once pointed wall-clock deadlines at the
CPU clock for that). One JSON line per model.
"""
from __future__ import annotations

import argparse
import json
import time

from phases import ZOO, model
from tapestry.collector import no_collections
from tapestry.extract import ilp
from tapestry.optimizer import FUSED_EXTRACTION_DEVICES, default_cost_model, explore
from tapestry.sharding import Mesh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mixtral,qwen2_moe,olmoe,llama", help="zoo families, comma-separated")
    parser.add_argument("--mesh", default="2x2")
    args = parser.parse_args()
    names = args.model.split(",")
    if unknown := [n for n in names if n not in ZOO]:
        parser.error(f"unknown zoo families {unknown}; choose from {', '.join(ZOO)}")
    mesh = Mesh.parse(args.mesh)
    for name in names:
        graph = model(name, 1)
        explored = explore(graph, mesh)
        if mesh.size >= FUSED_EXTRACTION_DEVICES or graph.carried:
            raise SystemExit(f"{name} on {mesh}: Explored.extract would add fused costs or steady ties")
        egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model(),
                                                   explored.priced_moves, drop_dominated=True)
        with no_collections():
            start = time.process_time()
            selection = ilp.extract_ilp(egraph, 10.0)
            spent = time.process_time() - start
        print(json.dumps({"model": name, "mesh": args.mesh, "ilp_cpu": round(spent, 2), "dag_cost": selection.dag_cost,
                          "status": selection.status, "gap": round(selection.gap, 6)}), flush=True)


if __name__ == "__main__":
    main()
