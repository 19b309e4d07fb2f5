"""Whether a zoo model's plan moves out of a footprint: a layout no Run or Place computes that holds only part of
its value (what one reader reads; `egraph.decode.distributed_nodes` makes no move out of one). Where a tree that
still makes those moves gives a plan that takes none, that plan is in the e-graph of a tree without them too, so
leaving them out cannot make its optimum dearer (docs/benchmarks.md, "Footprints and the contracted bound").
One JSON line per case; it uses only APIs older trees have, to run against one (PYTHONPATH=OLD/src).

    .venv/bin/python benchmarks/footprint_moves.py gpt_neox@2x2 stablelm@4 ...
"""
from __future__ import annotations

import json
import sys

from tapestry.importer import from_torch
from tapestry.importer.zoo import EXTRA, FAMILIES
from tapestry.optimizer import explore
from tapestry.plan.plan import Reshard
from tapestry.sharding import Mesh


def main() -> None:
    for case in sys.argv[1:]:
        name, mesh = case.split("@")
        module, inputs, kwargs = {**EXTRA, **FAMILIES}[name].build()
        explored = explore(from_torch(module, inputs, kwargs, verbose=False).graph, Mesh.parse(mesh))
        decoder = explored.decoder
        computed = {n.eclass for n in decoder.nodes if n.op not in ("Reshard", "Deliver")}
        footprints = {c for c in decoder.class_layout
                      if c not in computed and not decoder.interner.whole(decoder.class_layout[c])}
        # (shape, layout) pairs: a computed layout of another value alike in both is counted too (never fewer)
        layouts = {decoder.interner.layouts[decoder.class_layout[c]] for c in footprints}
        plan = explored.extract().plan
        reshards = [s for s in plan.steps if isinstance(s, Reshard)]
        print(json.dumps({
            "model": name, "mesh": mesh, "footprints": len(footprints),
            "moves_out_of_footprints": sum(n.op == "Reshard" and n.children[0] in footprints for n in decoder.nodes),
            "plan_reshards": len(reshards),
            "plan_moves_out_of_footprints": sum((s.shape, s.src_layout) in layouts for s in reshards),
            "cost": plan.cost}), flush=True)


if __name__ == "__main__":
    main()
