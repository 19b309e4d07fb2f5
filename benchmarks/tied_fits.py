"""Each extraction and fit of a held-back training step, logged: why the tied ILP returned its start
(docs/benchmarks.md, "The tied ILP improves its start").

    python benchmarks/tied_fits.py [heldback_call.py's model flags] [--extractors greedy-dag,ilp]

Builds the step as benchmarks/heldback_call.py does, explores it once (CPU seconds printed), then extracts it with
each extractor under an 80 GB budget and the gpu-h100-nccl profile, printing every `extract` call (e-graph nodes,
whether the ILP can model them in its time limit, ties, the start's and the result's DAG cost, what stopped it, CPU
seconds), every fit (`Explored._fit`: its plan's node-cost sum and CPU seconds, decoding included) and every
`plan_cost` the optimizer takes, then the plan and the extract's CPU seconds.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import heldback_call

import tapestry
import tapestry.optimizer as optimizer
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.extract.ilp import models_in


def logged(name: str, wrapped: Any, show: Any) -> Any:
    """`wrapped`, printing `show(args, result)` and its CPU seconds after each call."""
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        result = wrapped(*args, **kwargs)
        print(f"{name} {show(args, kwargs, result)} [{time.process_time() - started:.1f} CPU s]", flush=True)
        return result
    return call


def show_extract(args: tuple, kwargs: dict, out: Any) -> str:
    egraph, extractor, limit, _, ties, *rest = (*args, *[None] * 6)
    start = kwargs.get("start", rest[2] if len(rest) > 2 else None)
    ties = kwargs.get("ties", ties) or ()
    return (f"{extractor}: {egraph.num_nodes:,} nodes (modelled in {limit or 60} s: {models_in(egraph, limit or 60)}), "
            f"{len(ties)} ties, start {'-' if start is None else f'{start.dag_cost:.6g}'} -> {out.dag_cost:.6g} "
            f"({out.extractor}, {out.status}, stopped by {out.stopped_by})")


def main() -> None:
    extractors = ["greedy-dag", "ilp"]
    if "--extractors" in sys.argv:
        at = sys.argv.index("--extractors")
        extractors = sys.argv[at + 1].split(",")
        del sys.argv[at:at + 2]
    args = heldback_call.arguments().parse_args(sys.argv[1:])
    model, ids = heldback_call.build(args)
    imported = tapestry.from_torch(model, (ids, ids), verbose=False, training=tapestry.Training(
        loss=lambda m, i, labels: m(input_ids=i, labels=labels, use_cache=False).loss, optimizer="adam", lr=1e-4))
    optimizer.extract = logged("extract", optimizer.extract, show_extract)
    optimizer.Explored._fit = logged("  fit", optimizer.Explored._fit, lambda a, k, out: (
        f"{a[2]}: node costs {out[0].cost * 1e3:.3f} ms ({out[1].extractor})"))
    optimizer.plan_cost = logged("    plan_cost", optimizer.plan_cost, lambda a, k, out: f"{out * 1e3:.3f} ms")
    started = time.process_time()
    explored = optimizer.explore(imported.graph, tapestry.Mesh(*(int(n) for n in args.mesh.split("x"))))
    print(f"explore: {time.process_time() - started:.1f} CPU s ({explored.stats.undone})", flush=True)
    model_ = DefaultCostModel(load_profile(args.profile))
    for extractor in extractors:
        started = time.process_time()
        result = explored.extract(model_, extractor, memory_budget=int(args.budget_gb * 10**9))
        print(f"{extractor}: {result.plan.cost * 1e3:.3f} ms ({result.selection.extractor}, {result.status}), "
              f"{time.process_time() - started:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
