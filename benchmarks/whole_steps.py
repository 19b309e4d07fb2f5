"""Which of a model's compute steps its plan runs whole (one block on every device) each run, by kernel, with their
share of the FLOPs a run pays: what `plan shards` in the held-back zoo's tables leaves out, and whether each could
split. The plan's prepared steps are reported beside them, once.

    PYTHONPATH=src python benchmarks/whole_steps.py xlnet --mesh 4 [--top 12] [--weights-per-run]

The model is a held-back zoo family (benchmarks/heldback_zoo.py) or a test family (importer/zoo.py), imported and
optimized as the held-back zoo does. `could split` says whether some candidate partition of the step's index space
on the mesh splits it (import_report's `shardable`): "no" is a kernel that must run whole (an opaque op, an axis
its signature keeps inside every block), "yes" one the cost model chose to keep whole. A step computed from the
static weights and constants alone is prepared (run once ahead of time, priced 0 per run: docs/rules.md), so
which way it runs costs a run nothing: its FLOPs are counted apart, in no run's; `--weights-per-run` imports the
weights as run-time inputs (as a training step reads them), so such steps are paid for every run.
"""
from __future__ import annotations

import argparse
import collections

import torch
from heldback_zoo import MODELS

import tapestry
from tapestry.importer.report import PlanFlops, flops_of
from tapestry.importer.zoo import FAMILIES
from tapestry.plan import Compute
from tapestry.sharding.partition import candidate_partitions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", help="a held-back zoo or test family")
    parser.add_argument("--mesh", default="4")
    parser.add_argument("--top", type=int, default=12, help="kernels listed, most whole FLOPs first")
    parser.add_argument("--steps", action="store_true", help="also each whole step with FLOPs: shapes, origin")
    parser.add_argument("--weights-per-run", action="store_true", help="weights as run-time inputs, not static")
    args = parser.parse_args()
    module, inputs, kwargs = {**FAMILIES, **MODELS}[args.name].build()
    imported = tapestry.from_torch(module, inputs, kwargs, verbose=False)
    if args.weights_per_run:
        imported.graph.static.clear()
    mesh = tapestry.Mesh.parse(args.mesh)
    plan = tapestry.optimize(imported.graph, mesh).plan
    computes = [s for s in plan.steps if isinstance(s, Compute)]
    prepared = [s for s in computes if s.out in plan.prepared]
    split = PlanFlops.of(plan)
    whole: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
    for step in computes:
        if len(set(step.blocks)) == 1:
            if step.out not in plan.prepared:
                splits = any(any(p.axes) for p in candidate_partitions(step.signature, mesh))
                whole[step.kernel, splits].append(flops_of(step.signature))
            if args.steps and flops_of(step.signature):
                print(f"whole: {step.kernel} {[list(s) for s in step.input_shapes]} -> {list(step.shape)}, "
                      f"{flops_of(step.signature):.4g} FLOPs, inputs {list(step.args)}, origin {step.origin}"
                      f"{', prepared' if step.out in plan.prepared else ''}")
    kept = sum(sum(f) for f in whole.values())
    total = split.per_run or 1.0
    print(f"{args.name} on Mesh({args.mesh}): plan cost {plan.cost:.6g} s, {len(computes) - len(prepared)} compute "
          f"steps a run, {split.per_run:.4g} FLOPs; whole: {sum(map(len, whole.values()))} steps, {kept / total:.1%} "
          f"of the FLOPs a run pays; prepared once ahead of time: {len(prepared)} steps, {split.prepared:.4g} FLOPs "
          f"({sum(len(set(s.blocks)) == 1 for s in prepared)} steps whole)")
    print("| kernel | could split | whole steps | FLOPs | share of a run's |\n|---|---|---:|---:|---:|")
    for (kernel, splits), flops in sorted(whole.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"| {kernel} | {'yes' if splits else 'no'} | {len(flops)} | {sum(flops):.4g} | "
              f"{sum(flops) / total:.1%} |")


if __name__ == "__main__":
    with torch.no_grad():
        main()
