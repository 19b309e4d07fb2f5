"""Work and CPU seconds of each budgeted phase before extraction, for one benchmarks/cluster.py case (issue 24).

    python benchmarks/phase_counts.py --model Mixtral --mode training --mesh 8x8 --layers 2 [--budget 30]

Prints one JSON line: per phase (rule rounds, generation, making reshards) the work done, counted as the budgets
count it (e-nodes and rounds, sharded runs and layout pairs, values and reshards made), the CPU seconds it took
(`tapestry.clock`) and what stopped it. The counts are what `egraph.driver`'s per-CPU-second rates were calibrated
from: run it on a quiet machine (load below the core count) and compare the counts with the rates.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cluster import Case, build  # noqa: E402  benchmarks/, this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mode", default="training")
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--arch", default="hf", choices=("hf", "block"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds")
    args = parser.parse_args()

    import tapestry
    from tapestry.egraph import driver
    from tapestry.clock import clock

    case = Case(args.model, args.layers, args.mode, args.mesh, args.batch, args.seq, arch=args.arch)
    graph = build(case).graph
    made: dict[str, float] = {}
    distributed_nodes = driver.distributed_nodes

    def timed(*a, **k):  # the reshard-making phase, timed on its own
        tick = clock()
        found = distributed_nodes(*a, **k)
        made.update(seconds=clock() - tick, reshards=sum(n.op == "Reshard" for n in found[0]),
                    values_cut=found[3].values)
        return found

    driver.distributed_nodes = timed
    tick = clock()
    explored = tapestry.explore(graph, tapestry.Mesh(*case.shape), budget=tapestry.Budget(seconds=args.budget))
    total = clock() - tick
    stats, gen = explored.stats, explored.stats.generation
    print(json.dumps({
        "case": f"{args.model} {args.mode} {args.mesh} {args.layers} layers", "load": os.getloadavg()[0],
        "budget": args.budget, "explore_cpu_s": round(total, 2),
        "rules": {"rounds": len(stats.iterations), "enodes": stats.iterations[-1].enodes if stats.iterations else 0,
                  "matches": sum(sum(i.matches.values()) for i in stats.iterations),
                  "cpu_s": round(sum(i.seconds for i in stats.iterations), 2),
                  "stopped_by": stats.stopped_by if stats.stopped_in == "rules" else "fixpoint"},
        "generation": {"nodes": gen.nodes, "runs": gen.runs, "runs_left_out": gen.runs_left_out, "layout_pairs": gen.layout_pairs,
                       "enodes": gen.enodes, "cpu_s": round(gen.seconds, 2), "stopped_by": gen.stopped_by},
        "reshards": {"made": made["reshards"], "values_cut": made["values_cut"],
                     "cpu_s": round(made["seconds"], 2)},
        "undone": stats.undone,
    }))


if __name__ == "__main__":
    main()
