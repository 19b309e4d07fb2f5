"""What tighter reshard floors could buy extraction at most: the ILP on the floored graph against the ILP on the
graph that floors equal to the prices would allow.

    python benchmarks/floor_bound.py --model gpt_neox [--mesh 2x2] [--repeat 2] [--time-limit 10]

Explores a tiny zoo model (benchmarks/phases.py's names) once, then extracts with the ILP, alternately, from
(a) `FloorPriced`'s graph (egraph.extractor_pricing: optional moves at their floors, none dropped for a cheaper
route) and (b) the graph with every move priced and the moves a cheaper route of priced moves beats dropped
(`Decoder.extraction_graph(drop_dominated=True)`, what main did before extraction-driven pricing). A floor is at
most its price, so no floor can drop more moves than (b) does: (b)'s extraction bounds what tighter floors save
in extraction. Prints the selectable nodes of each and per extraction its CPU seconds (time.process_time), status
and selection cost (the ILP's own objective on that graph: (a)'s is on floors, so it may differ from (b)'s).
"""
from __future__ import annotations

import argparse
import json
import math
import time

from phases import model  # benchmarks/, this script's folder

from tapestry.egraph.driver import Budget
from tapestry.egraph.extractor_pricing import FloorPriced
from tapestry.extract import extract
from tapestry.optimizer import default_cost_model, explore
from tapestry.sharding import Mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    explored = explore(model(args.model, 1), Mesh.parse(args.mesh), None, Budget(seconds=30))
    cost, decoder, roots = default_cost_model(), explored.decoder, list(explored.roots)
    graphs = {"floored": FloorPriced(decoder, roots, cost).graph,
              "priced_pruned": decoder.extraction_graph(roots, cost, math.inf, drop_dominated=True)}
    print(json.dumps({"model": args.model, "mesh": args.mesh, **{
        f"{name}_selectable": sum(1 for c in graph.node_cost if c < math.inf) for name, graph in graphs.items()}}))
    for rep in range(args.repeat):
        for name, graph in graphs.items():
            start = time.process_time()
            selection = extract(graph, "ilp", args.time_limit)
            print(json.dumps({"repeat": rep, "graph": name, "extract_cpu": round(time.process_time() - start, 3),
                              "status": selection.status, "dag_cost": selection.dag_cost}), flush=True)


if __name__ == "__main__":
    main()
