"""Plans under a pricing cut: one cluster case explored once, then extracted with N of its distinct moves priced,
in generation-round order (`decode.pricing_order` with `Interner.rounds`) and by class rounds alone (the rounds
set aside), for each N asked; "all" prices every move. Prints one JSON line per extraction.

    python benchmarks/pricing_cut.py --model Mixtral --mode training --mesh 8x8 --counts 5800,12000,all

The case is benchmarks/cluster.py's (2 layers, 8x2048, gpu-h100-cluster, Budget(seconds=30)); moves priced
once are priced again from the cost model's cache, so the second and later extractions are faster.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

from cluster import PROFILE, Case, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mode", default="training")
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--counts", default="5800,12000,all")
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.optimizer import explore

    case = Case(args.model, 2, args.mode, args.mesh, 8, 2048)
    model = DefaultCostModel(load_profile(PROFILE))
    explored = explore(build(case).graph, tapestry.Mesh(*case.shape), budget=tapestry.Budget(seconds=30))
    rounds = dict(explored.decoder.interner.rounds)
    for count in args.counts.split(","):
        for order in ("generation", "class") if count != "all" else ("all",):
            explored.decoder.interner.rounds.clear()
            explored.decoder.interner.rounds.update(rounds if order != "class" else {})
            cpu = time.process_time()
            result = replace(explored, priced_moves=math.inf if count == "all" else int(count)).extract(model)
            print(json.dumps({"moves priced": count, "order": order, "ms": round(result.plan.cost * 1e3, 2),
                              "status": result.status, "extractor": result.selection.extractor,
                              "replicated": round(result.replicated_share, 3),
                              "cpu_s": round(time.process_time() - cpu, 1)}), flush=True)


if __name__ == "__main__":
    main()
