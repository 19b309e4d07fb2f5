"""Why the tiny MoE decoders' plans shard ~1% of their FLOPs: the search's plan against data parallel by hand and
against an estimate of data parallel with each device routing its own tokens.

    .venv/bin/python benchmarks/moe_routing.py [--family mixtral llama] [--meshes 4 2x2] [--by-block] [--zoo NAME ...]

Per family (the importer zoo's `small` 2-layer decoders, rebuilt here at batch 4 and at batch 1): the plan cost of
`optimize` on each mesh and the share of FLOPs it splits; the cost of data parallel by hand
(`training.plans.split_by_propagation` from the token ids' batch dim; an op that cannot split runs whole, its
arguments gathered); and, as the price of a plan in which every device routes only its own tokens (an option the
e-graph does not hold: the MoE's sort of all tokens by expert is one op over the whole batch), a quarter of the
batch planned on one device times the mesh's slowdown of a replicated plan (every op whole on every device,
priced, over the model's plan on one device: the cpu-gloo profile's ranks share the host's cores). For a dense
decoder (llama) the estimate should be what the search finds (every op splits on the batch, no move), which
checks it. Prints one line per family and mesh.

Every graph but `--by-block`'s is captured with batch-wide routing (importer/rewrites.py's BATCH_WIDE_REWRITES: the
opt-out of the default). `--by-block` also captures each family with its MoE routed sequence by sequence (the
default, importer/block_routing.py) and prints the search's plan of that graph, with how many of its expert steps
(grouped_mm_blocks) run expert parallel (exchanged). `--zoo NAME...` plans the named
importer zoo families as the zoo builds them (e.g. olmoe, qwen2_moe), batch-wide and routed by block, and nothing
else. Each `optimize` is timed in CPU seconds of this process (time.process_time).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch

from tapestry.cost import plan_cost
from tapestry.graph import Graph
from tapestry.importer import from_torch, zoo
from tapestry.importer.report import flops_of
from tapestry.importer.rewrites import BATCH_WIDE_REWRITES, REWRITES, exact_rewrites
from tapestry.optimizer import default_cost_model, optimize
from tapestry.plan import Plan
from tapestry.plan.plan import Compute
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.training.plans import split_by_propagation

# the zoo's 2-layer decoders (importer/zoo.py FAMILIES), buildable at any batch
BUILDS = {"mixtral": zoo._decoder("MixtralConfig", "MixtralModel", num_local_experts=4, num_experts_per_tok=2),
          "llama": zoo._decoder("LlamaConfig", "LlamaModel")}


def graph_of(family: str, batch: int, by_block: bool = False) -> Graph:
    torch.manual_seed(0)
    module, args, kwargs = BUILDS[family](dataclasses.replace(zoo.SIZES["small"], batch=batch))
    with exact_rewrites(REWRITES if by_block else BATCH_WIDE_REWRITES):
        return from_torch(module.eval(), args, kwargs, verbose=False).graph


def zoo_graph(name: str, by_block: bool) -> Graph:
    module, args, kwargs = zoo.FAMILIES[name].build()
    with exact_rewrites(REWRITES if by_block else BATCH_WIDE_REWRITES):
        return from_torch(module.eval(), args, kwargs, verbose=False).graph


def timed_plan(graph: Graph, mesh: Mesh) -> tuple[Plan, float]:
    """The search's plan and the CPU seconds `optimize` took."""
    start = time.process_time()
    plan = optimize(graph, mesh).plan
    return plan, time.process_time() - start


def sharded_share(plan: Plan) -> float:
    """The share of the plan's compute FLOPs in steps split over devices (import-report's `plan shards`)."""
    computes = [s for s in plan.steps if isinstance(s, Compute)]
    return sum(flops_of(s.signature) for s in computes if len(set(s.blocks)) > 1) / sum(
        flops_of(s.signature) for s in computes)


def experts_line(plan: Plan) -> str:
    """How many of the plan's expert steps (grouped_mm_blocks) exchange rows (expert parallel), if it has any."""
    experts = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "grouped_mm_blocks"]
    return f", {sum(bool(s.exchange) for s in experts)} of {len(experts)} expert steps exchanged" if experts else ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--by-block", action="store_true", help="also plan the graph routed sequence by sequence")
    parser.add_argument("--zoo", nargs="+", default=[], help="plan these zoo families batch-wide and by block only")
    args = parser.parse_args()
    if args.zoo:
        for name, text, by_block in itertools.product(args.zoo, args.meshes, (False, True)):
            plan, seconds = timed_plan(zoo_graph(name, by_block), Mesh(*map(int, text.split("x"))))
            print(f"{name} on {text}{', routed by block' if by_block else ''}: search {plan.cost:.4e} "
                  f"({sharded_share(plan):.1%} of FLOPs split, {seconds:.1f} CPU s{experts_line(plan)})", flush=True)
        return
    model = default_cost_model()
    for family in args.family:
        graph = graph_of(family, 4)
        blocked = graph_of(family, 4, by_block=True) if args.by_block else None
        one_device = optimize(graph, Mesh(1)).plan.cost
        quarter = optimize(graph_of(family, 1), Mesh(1)).plan.cost
        ids = {node.name: 0 for node in graph.inputs if node.shape == (4, zoo.SIZES["small"].tokens)}
        for text in args.meshes:
            mesh = Mesh(*map(int, text.split("x")))
            searched, seconds = timed_plan(graph, mesh)
            by_hand = split_by_propagation(graph, mesh, [ids])
            validate_plan(by_hand)
            replicated = plan_cost(split_by_propagation(graph, mesh, []), model)  # every op whole on every device
            print(f"{family} on {text}: search {searched.cost:.4e} ({sharded_share(searched):.1%} of FLOPs split, "
                  f"{seconds:.1f} CPU s); "
                  f"data parallel by hand {plan_cost(by_hand, model):.4e} ({sharded_share(by_hand):.1%} split); "
                  f"replicated {replicated:.4e}; one device: batch 4 {one_device:.4e}, batch 1 {quarter:.4e}; "
                  f"each device its own quarter, estimated {quarter * replicated / one_device:.4e}", flush=True)
            if blocked is not None:
                plan, seconds = timed_plan(blocked, mesh)
                print(f"{family} on {text}, routed by block: search {plan.cost:.4e} ({sharded_share(plan):.1%} of "
                      f"FLOPs split, {seconds:.1f} CPU s{experts_line(plan)})", flush=True)


if __name__ == "__main__":
    main()
