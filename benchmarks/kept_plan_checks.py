"""CPU seconds of the checks `tapestry.optimize` runs on the plan it keeps (validate_plan, the meaning check) and of
pricing it (plan_cost), on a saved plan: the folded 7B training step on 8x8 takes minutes to plan, its checks
seconds, so they are timed apart (issue 24, item 2).

    python benchmarks/kept_plan_checks.py --save PLAN.json   # plan it as benchmarks/cluster.py does, save it
    python benchmarks/kept_plan_checks.py PLAN.json          # time the checks of the saved plan

A loaded plan holds its own copy of every layout and block, where the optimizer's expanded plan shares one per
interned step between its layer copies: hashing them costs more here, and pricing's reuse by shared blocks
(DefaultCostModel.plan_step_costs) finds nothing to reuse.
"""
from __future__ import annotations

import argparse
import time
import warnings

from cluster import PROFILE, Case, build


def save(path: str) -> None:
    """The folded 7B/32 training step on 8x8 planned with cluster.py's defaults (budget 30 s, time limit 10 s)."""
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile

    imported = build(Case("7B", 32, "training", "8x8", 8, 2048))
    cpu = time.process_time()
    result = tapestry.optimize(imported.graph, tapestry.Mesh(8, 8), cost_model=DefaultCostModel(load_profile(PROFILE)),
                               time_limit=10.0, budget=tapestry.Budget(seconds=30.0))
    print(f"optimize: {time.process_time() - cpu:.1f} CPU s, {result.plan.cost * 1e3:.2f} ms, {result.status}")
    result.plan.save(path)


def checks(path: str) -> None:
    from tapestry.cost import DefaultCostModel, load_profile, plan_cost
    from tapestry.plan import Plan
    from tapestry.plan.validate import validate_plan
    from tapestry.verify import meaning_check

    plan = Plan.load(path, check=False)
    model = DefaultCostModel(load_profile(PROFILE))
    timed = {"validate_plan": lambda: validate_plan(plan), "meaning_check": lambda: meaning_check(plan),
             "plan_cost": lambda: plan_cost(plan, model)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unchecked meaning is said in its note
        for name, check in timed.items():
            cpu = time.process_time()
            out = check()
            print(f"{name}: {time.process_time() - cpu:.2f} CPU s" + ("" if out is None else f" ({out})"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="the saved plan (JSON)")
    parser.add_argument("--save", action="store_true", help="plan the step and save it there first")
    args = parser.parse_args()
    if args.save:
        save(args.plan)
    else:
        checks(args.plan)


if __name__ == "__main__":
    main()
