"""Where a held-back call's plan spends its step (issue 24, batch24): `heldback_call.py`'s flags, then the plan's
seconds per step kind (Reshard, or Compute and its kernel) and its costliest steps, each as `tapestry explain`
heads it (layout notation: S(dim per mesh axis), P partial, R replicated).

    python benchmarks/costly_steps.py --batch 12 --mesh 8x8 --seq 2048 --hidden 4096 --intermediate 11008 \
        --heads 32 --vocab 32000 --layers 1 [--search-seconds S] [--top 14] [--generation]

Says which steps a slow plan pays for (an all-reduce of the logits, attention run whole on an axis) where the
status alone says only that the search was cut. With --generation it stops after generation and prints what
`pair_cut.py --generation` prints (its stop, layout pairs at each round's start, the sharded runs made) for this graph.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import heldback_call
import pair_cut

import tapestry
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.cost.breakdown import step_costs
from tapestry.plan.explain import _describe
from tapestry.plan.plan import Compute


def main() -> None:
    argv = sys.argv[1:]
    top = 14
    if "--top" in argv:
        at = argv.index("--top")
        top = int(argv[at + 1])
        del argv[at:at + 2]
    generation = "--generation" in argv
    if generation:
        argv.remove("--generation")
    args = heldback_call.arguments().parse_args(argv)
    model, ids = heldback_call.build(args)

    def loss(module, ids, labels):  # noqa: ANN001, ANN202
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    graph = tapestry.from_torch(model, (ids, ids), verbose=False, training=heldback_call.training(args, loss)).graph
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    if generation:
        rounds, made = pair_cut._rounds()
        pair_cut._generation(graph, mesh, args.search_seconds or 30.0, rounds, made)
        return
    cost_model = DefaultCostModel(load_profile(args.profile))
    cpu = time.process_time()
    search = {} if args.search_seconds is None else {"budget": tapestry.Budget(seconds=args.search_seconds)}
    result = tapestry.optimize(graph, mesh=mesh, memory_budget=int(args.budget_gb * 10**9), cost_model=cost_model,
                               **search)
    print(f"plan {result.plan.cost * 1e3:.2f} ms, {result.status}; optimize {time.process_time() - cpu:.1f} CPU s")
    costs = step_costs(result.plan, cost_model)
    kinds: dict[str, float] = defaultdict(float)
    for step in result.plan.steps:
        kind = type(step).__name__ + (f" {step.signature.kernel.name}" if isinstance(step, Compute) else "")
        kinds[kind] += costs.get(step.out, 0.0)
    for kind, seconds in sorted(kinds.items(), key=lambda item: -item[1])[:8]:
        print(f"{seconds * 1e3:9.3f} ms  {kind}")
    steps = {step.out: step for step in result.plan.steps}
    for out, seconds in sorted(costs.items(), key=lambda item: -item[1])[:top]:
        print(f"{seconds * 1e3:9.3f} ms  {_describe(steps[out], mesh)[0][:240]}")


if __name__ == "__main__":
    main()
