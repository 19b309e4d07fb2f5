"""The ILP's two first bounds on a tiny zoo model's extraction graph: the contracted LP's (extract/contract.py)
and the full LP's (extract/relax.py, its first solve, without cuts), each with its size and CPU seconds, against
greedy-dag's plan. One JSON line.

    .venv/bin/python benchmarks/contract.py --model llama --mesh 2x2 [--no-full]

The graph is priced as `tapestry.optimize` prices an inference graph (dominated reshards and runs dropped).
"""
from __future__ import annotations

import argparse
import json
import time

from tapestry.extract import extract_greedy_dag
from tapestry.extract.contract import contracted, value_blocks
from tapestry.extract.reduction import reduce
from tapestry.extract.relax import lp_bound
from tapestry.extract.tree import solvable_tree
from tapestry.importer import from_torch
from tapestry.importer.zoo import EXTRA, FAMILIES
from tapestry.optimizer import default_cost_model, explore
from tapestry.sharding import Mesh
from tapestry.extract.work import unbounded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple({**EXTRA, **FAMILIES}), default="llama")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--no-full", action="store_true", help="skip the full LP (5-11 s on 2x2)")
    args = parser.parse_args()
    module, inputs, kwargs = {**EXTRA, **FAMILIES}[args.model].build()
    explored = explore(from_torch(module, inputs, kwargs, verbose=False).graph, Mesh.parse(args.mesh))
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model(), explored.priced_moves,
                                               drop_dominated=True)
    reduced = reduce(egraph, solvable_tree(egraph))
    block = {c: reduced.block(c) for c in reduced.candidates}
    greedy = extract_greedy_dag(egraph).dag_cost
    row: dict[str, object] = {"model": args.model, "mesh": args.mesh, "greedy_cost": greedy,
                              "candidates": sum(map(len, reduced.candidates.values()))}
    started = time.process_time()
    graph, kept = contracted(egraph, reduced.candidates, block)
    bound = lp_bound(graph, kept, *value_blocks(egraph, reduced.candidates, block, reduced.needs), unbounded()).bound
    row.update(contracted_candidates=sum(map(len, kept.values())),
               contracted_cpu=round(time.process_time() - started, 2), contracted_gap=(greedy - bound) / greedy)
    if not args.no_full:
        started = time.process_time()
        bound = lp_bound(egraph, reduced.candidates, block, reduced.needs, unbounded()).bound
        row.update(full_cpu=round(time.process_time() - started, 2), full_gap=(greedy - bound) / greedy)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
