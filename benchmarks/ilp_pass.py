"""CPU seconds of the ILP (`extract_ilp`, 10 s limit, its default stop gap) on tiny zoo models' extraction graphs,
with the selection it returns: the phase whose path depends on the load, timed apart from saturation and pricing.

    .venv/bin/python benchmarks/ilp_pass.py [--model mixtral,qwen2_moe,olmoe,llama] [--mesh 2x2] [--cpu-clock]

The graph is priced as `Explored.extract` prices it on an inference graph with outputs "any" (as
benchmarks/lp_bound.py), and the ILP runs with the garbage collector held off, as `Explored.extract` runs it. The ILP's shares of its limit (the LP pass, its path graphs) are wall-clock deadlines,
so on a loaded machine it skips what an idle one runs; `--cpu-clock` measures them on this process's CPU clock
instead (the extraction modules' `time.perf_counter` pointed at `time.process_time`), so the path is the one an
idle machine takes whatever the load. One JSON line per model.
"""
from __future__ import annotations

import argparse
import json
import time
import types

from phases import ZOO, model
from tapestry.collector import no_collections
from tapestry.extract import contract, greedy_dag, ilp, relax, warm
from tapestry.optimizer import FUSED_EXTRACTION_DEVICES, default_cost_model, explore
from tapestry.sharding import Mesh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mixtral,qwen2_moe,olmoe,llama", help="zoo families, comma-separated")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--cpu-clock", action="store_true", help="the ILP's deadlines on the CPU clock")
    args = parser.parse_args()
    names = args.model.split(",")
    if unknown := [n for n in names if n not in ZOO]:
        parser.error(f"unknown zoo families {unknown}; choose from {', '.join(ZOO)}")
    if args.cpu_clock:
        clock = types.SimpleNamespace(perf_counter=time.process_time, process_time=time.process_time)
        for module in (ilp, relax, contract, greedy_dag, warm):
            if hasattr(module, "time"):
                module.time = clock
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
        print(json.dumps({"model": name, "mesh": args.mesh, "cpu_clock": args.cpu_clock,
                          "ilp_cpu": round(spent, 2), "dag_cost": selection.dag_cost,
                          "status": selection.status, "gap": round(selection.gap, 6)}), flush=True)


if __name__ == "__main__":
    main()
