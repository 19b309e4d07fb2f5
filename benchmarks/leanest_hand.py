"""The leanest hand plans of a training step under a memory budget, priced by the project's memory and cost models
(issue 24, lean24: LLaMA 7B, 2 layers, float32 Adam at 3 GB per device on 8 devices: is there a plan?).

    python benchmarks/leanest_hand.py --layers 2 --meshes 8,2x4,4x4 [--json OUT]

For each mesh: every hand plan of `training.plans.baselines` (ZeRO-3/FSDP: weights, gradients and Adam state
sharded, batch and sequence split) and ZeRO-3/FSDP of the step with activation recomputation
(`training.recompute`, the hand plans the optimizer falls back on where a budget binds), each in its leaner step
order (`budget.leaner`), with its peak per device split by phase (`budget.by_phase`) and its predicted step time;
and two floors under every plan that computes each value once (`activation_floor`, by hand). The case is
benchmarks/heldback_call.py's (transformers' LLaMA on the meta device, batch 8 x 2048, the gpu-h100-nccl profile).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping
from typing import Any

from heldback_call import arguments, build

import tapestry
from tapestry.cost import DefaultCostModel, layout_bytes, load_profile, plan_cost
from tapestry.cost.breakdown import phases
from tapestry.cost.overlap import upstream
from tapestry.dtypes import itemsize
from tapestry.egraph.budget import by_phase, leaner
from tapestry.graph import Graph
from tapestry.kernels import get_kernel
from tapestry.plan import Place, Plan
from tapestry.training.plans import baselines
from tapestry.training.recompute import forward_ops, recomputed_baselines


def activation_floor(graph: Graph, devices: int) -> dict[str, Any]:
    """Floors under the peak per device of every plan of `graph` that computes each value once (no recomputation,
    the search's plans), by hand: the inputs split over every device, plus, at a backward op b, the forward values b
    depends on that some backward op depending on b reads (made before b, read after it: live while b runs, in any
    step order; "activations"), and with them b's own arguments and result ("program": the step as imported, no
    fusion of b with its neighbours), split over every device (the fullest device holds at least the mean; a view,
    `always_view`, holds its source's storage, counted once). Each at its worst b."""
    forward = forward_ops(graph)

    def storage(value: str) -> str:
        while not graph[value].is_input and get_kernel(graph[value].op).always_view:
            value = graph[value].args[0]
        return value

    size = {n.name: math.prod(n.shape) * itemsize(n.dtype) for n in graph.nodes}
    users, inputs = graph.users(), {n.name for n in graph.inputs}
    worst = {"activations": (0, ""), "program": (0, "")}
    for node in graph.ops:
        if node.name in forward:
            continue
        before = upstream([node.name], lambda v: graph[v].args) & forward
        after = upstream([node.name], lambda v: users[v]) - {node.name}
        across = {storage(f) for f in before if any(r in after for r in users[f])} - inputs
        own = {storage(v) for v in (*node.args, node.name)} - inputs
        for name, held in (("activations", across), ("program", across | own)):
            worst[name] = max(worst[name], (sum(size[v] for v in held), node.name))
    return {"inputs": math.ceil(sum(size[v] for v in inputs) / devices),
            **{name: math.ceil(held / devices) for name, (held, _) in worst.items()},
            **{f"{name}_at": at for name, (_, at) in worst.items()}}


def priced(plan: Plan, model: Any) -> dict[str, Any]:
    """The plan's peak (leaner order), its phases at the peak and its predicted step."""
    lean, _, peaks = leaner(plan, list(range(len(plan.steps))))
    rank = max(range(len(peaks)), key=lambda r: peaks[r].bytes)
    live = peaks[rank].live
    phase = phases(lean)
    newest = lean.steps[max(live)]
    resident = max(map(sum, zip(*(layout_bytes(s.layout, lean.dtypes[s.out]) for s in lean.steps
                                  if isinstance(s, Place)))))
    return {"peak": peaks[rank].bytes, "resident": resident, "phase": phase[newest.out],
            "by_phase": by_phase(lean, live, phase, phase[newest.out]), "ms": plan_cost(lean, model) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--meshes", default="8,2x4,4x4")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args()
    call = arguments().parse_args(["--hidden", "4096", "--intermediate", "11008", "--heads", "32", "--vocab", "32000",
                                   "--layers", str(args.layers), "--seq", "2048"])
    model, ids = build(call)

    def loss(module: Any, ids: Any, labels: Any) -> Any:
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    started = time.process_time()
    graph = tapestry.from_torch(model, (ids, ids), verbose=False,
                                training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4)).graph
    cost_model = DefaultCostModel(load_profile(call.profile))
    rows = []
    for shape in args.meshes.split(","):
        mesh = tapestry.Mesh(*map(int, shape.split("x")))
        floor = activation_floor(graph, mesh.size)
        print(f"{shape}: floors without recomputation: inputs {floor['inputs'] / 10**9:.2f} GB + activations live "
              f"across backward op {floor['activations_at']} {floor['activations'] / 10**9:.2f} = "
              f"{(floor['inputs'] + floor['activations']) / 10**9:.2f} GB; with that op's arguments and result, at "
              f"{floor['program_at']}: {(floor['inputs'] + floor['program']) / 10**9:.2f} GB", flush=True)
        plans: Mapping[str, Plan] = baselines(graph, mesh)
        found = {name: priced(plan, cost_model) for name, plan in plans.items()}
        lean = recomputed_baselines(graph, mesh, plans)
        found.update({name: priced(plan, cost_model) for name, plan in lean.items()})
        for name, row in found.items():
            print(f"  {name}: {row['peak'] / 10**9:.2f} GB at its peak (in the {row['phase']}; resident "
                  f"{row['resident'] / 10**9:.2f}), {row['ms']:.2f} ms; {row['by_phase']}", flush=True)
            rows.append({"mesh": shape, "layers": args.layers, "plan": name, **row,
                         "floor": floor})
    print(f"CPU {time.process_time() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
