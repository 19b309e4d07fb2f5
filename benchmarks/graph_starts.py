"""Whether the ILP's per-graph warm starts change a plan (issue 24, pipe70's follow-up): each case of
benchmarks/cluster.py planned twice, each in a fresh process, with greedy-dag's steady picks of every graph the ILP
solves (`Explored._warm_starts` in every fit, as is), and with those of the first graph only (one run's costs,
before pipe70): the plan's price, peak, degrees and status, and the CPU s of optimize.

    python benchmarks/graph_starts.py --models 7B,Mixtral --meshes 8,2x4,8x8 --memory-budget 80

Training steps of --layers layers, batch 8 x 2048, the gpu-h100-cluster profile, hand plans not priced.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
from typing import Any

from cluster import Case, run_case

ARMS = ("every graph", "first graph")


def first_graph_only() -> None:
    """`Explored._warm_starts` as before pipe70: the starts made for the first graph (hand plans and greedy-dag's
    steady picks of one run's costs) passed to every later fit unchanged."""
    from tapestry.optimizer import Explored

    made: set[int] = set()
    every = Explored._warm_starts

    def once(self: Any, egraph: Any, hands: tuple, *rest: Any) -> tuple:
        if id(hands) in made:
            return hands
        found = every(self, egraph, hands, *rest)
        made.add(id(found))
        return found

    Explored._warm_starts = once


def run(case: Case, arm: str, queue: Any) -> None:
    if arm == "first graph":
        first_graph_only()
    run_case(case, 30.0, 10.0, queue, hand=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="7B,Mixtral")
    parser.add_argument("--meshes", default="8,2x4,8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-budget", type=float, default=80.0, help="GB per device")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    rows = []
    for model in args.models.split(","):
        for mesh in args.meshes.split(","):
            case = Case(model, args.layers, "training", mesh, 8, 2048, memory_budget=int(args.memory_budget * 10**9))
            for arm in ARMS:
                queue = context.Queue()
                process = context.Process(target=run, args=(case, arm, queue))
                process.start()
                row = queue.get()
                process.join()
                row["arm"] = arm
                rows.append(row)
                print(f"{model} {mesh} {arm}: {row.get('seconds', float('nan')) * 1e3:.4f} ms, "
                      f"{row.get('peak_memory', 0) / 2**30:.2f} GiB, {row.get('degrees')}, {row.get('status')}, "
                      f"optimize {row.get('optimize_cpu_s', float('nan')):.1f} CPU s {row.get('error', '')}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
