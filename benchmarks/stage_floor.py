"""Whether a stage count can be skipped before its layer extraction: an exact floor under its pipelined step, from
the LP relaxation of its sub-mesh's e-graph (issue 24's planning time).

    python benchmarks/stage_floor.py --width 7B --seq 2048 --micro-batch 8 --micro-batches 256 --layers 32 \
        --mesh 8x8 [--stages 8,4,2,1]

For each stage count S, the layer (benchmarks/pipeline.py's) is explored on S's sub-mesh (`pipeline.stage_mesh`)
and its extraction graph priced by the `gpu-h100-cluster` model, as `plan_pipeline` does. Each e-node is then
priced at a floor under what any plan holding it pays for it per update (`cost.breakdown.phase_times`): `m` times
(`--micro-batches`) a Reshard's price and a Run's that no fusion group takes in (`cost.fusion.fusible`: a group's
members share its time, at most their own costs); a fusible Run at its FLOPs at the profile's peak averaged over
the devices (a group's time is at least its members' summed on its slowest device); Places, Delivers and prepared
steps at 0, and the update's e-nodes and the weight gradients' reductions (`egraph.objective.overlap_split`,
accumulated) at 0 too. The LP of that graph (`extract.relax.lp_bound`, no path cuts, no steady ties, no output
layouts asked: each relaxes the problem) bounds every selection's forward and backward for `m` micro-batches, so
`L / S` times it floors the step of any schedule and recomputation (a device's makespan is at least its share of
the layers' compute: `planner.ideal_time`'s argument). A stage count whose floor is at or above the best step found
could be skipped. Beside it, the same LP under the plain node prices (no floor: fusion prices plans below their
node sums, so it bounds only plans without fusion). CPU seconds of each phase (time.process_time).
"""
from __future__ import annotations

import argparse
import json
import math
import time

from pipeline import PROFILE, layer_arguments, layer_builder

from tapestry.cost import DefaultCostModel, load_profile
from tapestry.cost.fusion import fusible
from tapestry.cost.roofline import compute_dtype
from tapestry.egraph.decode import Decoder
from tapestry.egraph.driver import Budget
from tapestry.egraph.objective import overlap_split
from tapestry.extract.egraph import EGraph
from tapestry.extract.reduction import reduce
from tapestry.extract.relax import lp_bound
from tapestry.extract.tree import solvable_tree
from tapestry.extract.work import unbounded
from tapestry.optimizer import explore
from tapestry.pipeline.planner import stage_mesh
from tapestry.sharding import Mesh
from tapestry.training import LR


def floor_costs(decoder: Decoder, priced: EGraph, device: object, off: frozenset[int], runs: int) -> list[float]:
    """Per e-node, a floor under its seconds per update in any plan (module docstring); inf kept (unselectable)."""
    devices = decoder.mesh.size
    floors = []
    for n, (node, cost) in enumerate(zip(decoder.nodes, priced.node_cost)):
        if not math.isfinite(cost):
            floors.append(cost)
            continue
        if n in off or node.op in ("Place", "Deliver") or decoder.prepared(node):
            floors.append(0.0)
            continue
        if node.op != "Reshard" and fusible(decoder.interner.runs[node.key]):
            step = decoder.step(node, args=node.children)
            sig = step.signature
            flops = 0.0 if sig.kernel.is_view else sum(sig.cost(b)[0] for b in step.blocks
                                                         if b is not None and not b.is_empty)
            cost = min(cost, flops / devices / device.peak(compute_dtype(sig)) * device.oversubscription(devices))
        floors.append(cost * runs)
    return floors


def lp(graph: EGraph) -> tuple[float, float]:
    """The LP bound of `graph` (no cuts) and its CPU seconds."""
    started = time.process_time()
    reduced = reduce(graph, solvable_tree(graph))
    block = {c: reduced.block(c) for c in reduced.candidates}
    return lp_bound(graph, reduced.candidates, block, reduced.needs, unbounded()).bound, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(parser)
    parser.add_argument("--micro-batches", type=int, default=256, help="micro-batches per update")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--stages", default="8,4,2,1")
    args = parser.parse_args()
    model = DefaultCostModel(load_profile(PROFILE))
    graph = layer_builder(args.width, args.seq, args.kv_heads)(args.micro_batch)
    mesh, m = Mesh.parse(args.mesh), args.micro_batches
    for stages in map(int, args.stages.split(",")):
        started = time.process_time()
        explored = explore(graph, stage_mesh(mesh, 0, stages), budget=Budget())
        explored_s = time.process_time() - started
        started = time.process_time()
        decoder = explored.decoder
        priced = decoder.extraction_graph(list(explored.roots), model, explored.priced_moves)
        priced_s = time.process_time() - started
        reductions, _, update = overlap_split(decoder, explored.graph.carried,
                                              {explored.names[r]: r for r in explored.roots}, (LR,), accumulated=True)
        off = reductions | update
        plain = [c if not math.isfinite(c) else 0.0 if n in off else c * m for n, c in enumerate(priced.node_cost)]
        floor, floor_s = lp(priced.with_costs(floor_costs(decoder, priced, model.fused_device, off, m)))
        unfloored, plain_s = lp(priced.with_costs(plain))
        share = args.layers / stages * 1e3  # ms of the step per second of one layer's m micro-batches
        print(json.dumps({"stages": stages, "sub_mesh": str(explored.mesh), "nodes": len(decoder.nodes),
                          "floor_ms": round(floor * share, 1), "plain_lp_ms": round(unfloored * share, 1),
                          "cpu_s": {"explore": round(explored_s, 2), "pricing": round(priced_s, 2),
                                    "floor_lp": round(floor_s, 2), "plain_lp": round(plain_s, 2)}}), flush=True)


if __name__ == "__main__":
    main()
