"""The plan the optimizer keeps of those its fits found (`egraph.objective.StepObjective`): the fastest, and of
plans as fast the one with the lower peak per device, whichever was found first."""
from __future__ import annotations

from dataclasses import replace

import tapestry
from training_helpers import adam_step

from tapestry.cost import default_cost_model, peak_memory
from tapestry.egraph.objective import StepObjective
from tapestry.training.plans import baselines


def test_of_equal_time_plans_the_one_with_the_lower_peak_is_kept_in_either_order() -> None:
    imported, _ = adam_step(8, 16, 16)
    hands = baselines(imported.graph, tapestry.Mesh(4))
    lean, full = hands["ZeRO-3"], hands["data parallel"]  # ZeRO-3 shards the weights and Adam's state
    assert max(peak_memory(lean)) < max(peak_memory(full))
    objective = StepObjective(default_cost_model(), 1, (frozenset(), frozenset(), frozenset()))
    lean, full = replace(lean, cost=1.0), replace(full, cost=1.0 + 1e-12)  # as fast, but for rounding in sums
    assert objective.better(lean, full) and not objective.better(full, lean)
    assert objective.least([(full, "data parallel"), (lean, "ZeRO-3")])[1] == "ZeRO-3"
    assert objective.least([(lean, "ZeRO-3"), (full, "data parallel")])[1] == "ZeRO-3"
    faster = replace(full, cost=0.5)  # time first: a faster plan is kept whatever it holds
    assert objective.least([(lean, "ZeRO-3"), (faster, "data parallel")])[1] == "data parallel"


def test_a_plan_found_twice_is_not_better_than_itself_and_its_peak_is_not_read(monkeypatch) -> None:  # noqa: ANN001
    """A refit that chose the same plan (the fused fit on a pipeline's 8x8 layer) ties on time and on peak: reading
    its peak twice (each rank's lowered steps, seconds on 64 devices) decides nothing."""
    from tapestry.egraph import objective as module

    imported, _ = adam_step(8, 16, 16)
    plan = replace(baselines(imported.graph, tapestry.Mesh(4))["ZeRO-3"], cost=1.0)
    objective = StepObjective(default_cost_model(), 1, (frozenset(), frozenset(), frozenset()))

    def unread(plan: object) -> None:
        raise AssertionError("the peak of a plan found twice was read")

    monkeypatch.setattr(module, "peak_memory", unread)
    again = replace(plan, steps=tuple(plan.steps), cost=1.0 + 1e-12)  # equal steps, not the same tuple
    assert not objective.better(again, plan) and not objective.better(plan, again)
