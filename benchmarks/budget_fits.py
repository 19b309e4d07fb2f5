"""Which fit of a folded training step under a memory budget made which plan (issue 24: the 70B step on 8x8x8).

`Explored.extract` fits a folded step once, and where the budget does not bind that first fit (its plan, chosen
without the budget, fits) again under fused prices, the plain sum of node costs and the overlap weights, each fit
that the budget binds running the budgeted fallback (`FoldedCandidates.within_budget`). This prints, as the search
goes, each fit's unbudgeted selection (its memory floor, its exact peak where decoded, its ILP cost and status), what
each fit returned, and each comparison that kept one plan over another, and the budgeted fallback's candidates (each
expanded one's peak and plan_cost, each folded plan's floor), with the process's CPU seconds; then the plan kept.
The case is benchmarks/cluster.py's (transformers' LLaMA on the meta device, Adam, bf16).

    python benchmarks/budget_fits.py --model 70B --layers 80 --mesh 8x8x8 --memory-budget 80
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cluster import PROFILE, Case, build


def log(*what: Any) -> None:
    print(f"[{time.process_time():7.1f} CPU s]", *what, flush=True)


def traced() -> None:
    """`Explored._unbound`, `_fit` and `StepObjective.better` / `least` wrapped to print what they decide."""
    from tapestry import optimizer
    from tapestry.egraph import objective
    from tapestry.extract import NoFiniteChoiceError

    def unbound(self: Any, egraph: Any, extractor: str, time_limit: float, ties: Any, carried: Any,
                memory_budget: int, stop_gap: float | None = None, model: Any = None, hands: Any = ()) -> Any:
        """`Explored._unbound` as it is, with what it saw printed."""
        try:
            selection = self._select(egraph, extractor, time_limit, None, ties, carried, stop_gap, model, hands)
        except NoFiniteChoiceError:
            log("unbudgeted fit: no selection")
            return None
        floor = max(self._lean.floor(selection))
        said = f"unbudgeted fit: {selection.extractor} {selection.status}, cost {selection.dag_cost:.6g}, " \
               f"floor {floor:,}"
        if floor > memory_budget:
            log(said, "(over the budget: not decoded)")
            return None
        plan, _, peaks = self._lean.leaner(egraph, selection)
        peak = max(p.bytes for p in peaks)
        log(said, f"peak {peak:,}, plan_cost {self._lean.cost(plan, model):.6g}")
        if peak > memory_budget:
            return None
        return replace(plan, notes={**plan.notes, "memory_budget": "not binding"}), selection

    optimizer.Explored._unbound = unbound
    logged(optimizer.Explored, "_fit",
           lambda made, *_: f"fit -> {made[0].cost:.6g} s, memory_budget: {made[0].notes.get('memory_budget')}")
    logged(objective.StepObjective, "better",
           lambda kept, _, plan, than: f"better({plan.cost:.6g}, than {than.cost:.6g}) = {kept}")
    logged(objective.StepObjective, "least",
           lambda kept, _, found: f"least of {[round(p.cost, 6) for p, _ in found]} -> {kept[0].cost:.6g}")
    candidates()


def candidates() -> None:
    """The budgeted fallback's (`FoldedCandidates.within_budget`) candidates: each one expanded (its extractor: a hand
    plan, a price of a ladder, the ILP), its exact peak, its plan_cost, and each folded plan's floor (`floor`: its
    moves alone, what keeps a hand plan unexpanded where it is over a plan that fits)."""
    from tapestry.egraph import folded_candidates as fc

    logged(fc.FoldedCandidates, "decode", lambda _, __, ___, selection: f"candidate expanded: {selection.extractor}")
    logged(fc, "leaner", lambda made, *_: f"  its peak {max(p.bytes for p in made[2]):,}")
    logged(fc, "plan_cost", lambda cost, *_: f"  its plan_cost {cost:.6g}")
    logged(fc.FoldedCandidates, "_folded_estimate", lambda made, _, __, selection, ___:
           f"folded plan of {selection.extractor}: estimate {made[0]:.6g}, floor {made[1]:.6g}")


def logged(owner: Any, name: str, say: Callable[..., str]) -> None:
    """`owner.name` replaced by a function that calls it and logs `say(result, *its arguments)`."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        log(say(result, *args))
        return result

    setattr(owner, name, wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="70B")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--mesh", default="8x8x8")
    parser.add_argument("--memory-budget", type=float, default=80, help="GB (10**9 bytes) per device")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile

    traced()
    case = Case(args.model, args.layers, "training", args.mesh, args.batch, args.seq)
    imported = build(case)
    log(f"imported {len(imported.graph.ops)} ops; {len(imported.graph.constants)} constants")
    cpu = time.process_time()
    result = tapestry.optimize(imported.graph, tapestry.Mesh(*case.shape),
                               cost_model=DefaultCostModel(load_profile(PROFILE)), time_limit=10.0,
                               budget=tapestry.Budget(seconds=30.0), memory_budget=int(args.memory_budget * 10**9))
    log(f"kept {result.plan.cost:.10g} s, {result.peak_memory:,} bytes on the fullest device, "
        f"memory_budget: {result.plan.notes.get('memory_budget')}; optimize {time.process_time() - cpu:.1f} CPU s")


if __name__ == "__main__":
    main()
