"""How far the ILP's LP bounds sit under the best plan known, on tiny zoo models' extraction graphs: the full LP's
first solve, the full LP with read rows (extract/relax.py, `read_rows_bound`; its warm re-solve's CPU seconds) and
the contracted LP (extract/contract.py). A markdown table, one row per model.

    .venv/bin/python benchmarks/lp_bound.py [--model mixtral,qwen2_moe,olmoe,llama] [--mesh 2x2] [--time-limit 60]

The graph is priced as `Explored.extract` prices it on an inference graph with outputs "any" (dominated reshards
and runs dropped; no steady ties; no fused pricing below 8 devices); the best plan is `extract_ilp` on it (its
default stop gap), and each bound is given as a share of that plan's extraction (dag) cost under it.
"""
from __future__ import annotations

import argparse

from phases import ZOO, model
from tapestry.extract import extract_ilp
from tapestry.extract.contract import contracted_bound
from tapestry.extract.reduction import reduce
from tapestry.extract.relax import read_rows_bound
from tapestry.extract.tree import solvable_tree
from tapestry.extract.work import unbounded
from tapestry.optimizer import FUSED_EXTRACTION_DEVICES, default_cost_model, explore
from tapestry.sharding import Mesh


def row(name: str, mesh: Mesh, time_limit: float) -> str:
    graph = model(name, 1)
    explored = explore(graph, mesh)
    if mesh.size >= FUSED_EXTRACTION_DEVICES or graph.carried:
        raise SystemExit(f"{name} on {mesh}: Explored.extract would add fused costs or steady ties; not measured")
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model(), explored.priced_moves,
                                               drop_dominated=True)
    best = extract_ilp(egraph, time_limit)
    reduced = reduce(egraph, solvable_tree(egraph))
    block = {c: reduced.block(c) for c in reduced.candidates}
    reads = read_rows_bound(egraph, reduced.candidates, block, reduced.needs)
    contracted = contracted_bound(egraph, reduced.candidates, block, reduced.needs, unbounded()).bound

    def under(bound: float) -> str:
        return f"{(best.dag_cost - bound) / best.dag_cost:.3%}"

    return (f"| {name} | {best.dag_cost:.5e} ({best.status}) | {under(reads.without)} | {under(reads.bound)} "
            f"| {reads.resolve_cpu_s:.2f} | {under(contracted)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mixtral,qwen2_moe,olmoe,llama", help="zoo families, comma-separated")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--time-limit", type=float, default=60.0, help="extract_ilp's (its default: 60)")
    args = parser.parse_args()
    names = args.model.split(",")
    if unknown := [n for n in names if n not in ZOO]:
        parser.error(f"unknown zoo families {unknown}; choose from {', '.join(ZOO)}")
    mesh = Mesh.parse(args.mesh)
    print("| model | best plan's dag cost (ILP status) | full LP | with read rows | re-solve CPU s | contracted LP |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        print(row(name, mesh, args.time_limit), flush=True)


if __name__ == "__main__":
    main()
