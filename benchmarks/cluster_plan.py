"""One benchmarks/cluster.py case planned and its plan saved, or a saved plan priced again (issue 24: which plan
did an older tree's search find, and what does it cost under this tree's model).

    python benchmarks/cluster_plan.py --model Mixtral --mesh 8x8x8 --memory-budget 80 --save plan.json
    python benchmarks/cluster_plan.py --price plan.json

Planning: cluster.py's import (`build`: transformers' model at real width on the meta device, a training step of
--layers layers, batch 8 x 2048) and its `tapestry.optimize` call (the gpu-h100-cluster profile, the default budget
and time limit); prints the plan's ms, status, extractor and optimize's CPU s. Pricing: the saved plan's ms by this
tree's cost model and its time per phase and kind (cost.breakdown); with --egraph, whether this tree's search (one
`explore` of the plan's graph and mesh) holds the plan's steps, and which it lacks.
"""
from __future__ import annotations

import argparse
import time

from cluster import PROFILE, Case, build


def plan_case(args: argparse.Namespace) -> None:
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile

    case = Case(args.model, args.layers, "training", args.mesh, args.batch, args.seq,
                memory_budget=None if args.memory_budget is None else int(args.memory_budget * 10**9))
    imported = build(case)
    model = DefaultCostModel(load_profile(PROFILE))
    cpu = time.process_time()
    result = tapestry.optimize(imported.graph, tapestry.Mesh(*case.shape), cost_model=model,
                               budget=tapestry.Budget(seconds=args.budget), memory_budget=case.memory_budget)
    print(f"{case.model} {case.mesh}: {result.plan.cost * 1e3:.4f} ms, {result.status}, "
          f"{result.selection.extractor}, optimize {time.process_time() - cpu:.1f} CPU s", flush=True)
    if args.save:
        result.plan.save(args.save)


def price(args: argparse.Namespace) -> None:
    from tapestry.cost import DefaultCostModel, load_profile, plan_cost
    from tapestry.cost.breakdown import breakdown
    from tapestry.plan import Plan

    profile = load_profile(PROFILE)
    model = DefaultCostModel(profile)
    plan = Plan.load(args.price, check=False)
    print(f"{args.price}: saved {plan.cost * 1e3:.4f} ms, priced here {plan_cost(plan, model) * 1e3:.4f} ms")
    print(breakdown(plan, model, profile.device).table())
    if args.egraph:
        lacking(plan, model)


def lacking(plan, model) -> None:  # noqa: ANN001
    """Whether one `explore` of the plan's graph on its mesh holds the plan's steps (the first few it lacks)."""
    from tapestry.egraph.embed import NotInEGraph, plan_selection
    from tapestry.extract import validate
    from tapestry.optimizer import explore

    cpu = time.process_time()
    explored = explore(plan.graph, plan.mesh)
    egraph = explored.decoder.extraction_graph(list(explored.roots), model, explored.priced_moves)
    try:
        problems = validate(egraph, plan_selection(explored.decoder, egraph, plan, "saved"))
    except NotInEGraph as err:
        problems = [str(err)]
    print(f"explore {time.process_time() - cpu:.1f} CPU s; {explored.stats.generation}")
    print("in the e-graph" if not problems else f"not in the e-graph: {len(problems)} problems", *problems[:12],
          sep="\n  ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mesh", default="8x8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--memory-budget", type=float, help="GB (10**9 bytes) per device")
    parser.add_argument("--save", help="write the plan here (JSON)")
    parser.add_argument("--price", help="a saved plan to price with this tree's model instead of planning")
    parser.add_argument("--egraph", action="store_true", help="with --price: is the plan in this tree's e-graph")
    args = parser.parse_args()
    price(args) if args.price else plan_case(args)


if __name__ == "__main__":
    main()
