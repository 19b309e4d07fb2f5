"""The cost-model protocol: price one distributed step, in seconds.

Each plan step (and each distributed e-node, which decodes 1:1 into a step)
carries everything needed to price it, so a model never sees the whole plan:
that keeps node costs local, which exact DAG extraction relies on. Two terms are
plan-wide: a model may price a plan's steps together (`plan_step_costs`:
DefaultCostModel prices fused elementwise chains as one kernel, `cost.fusion`), and a
training step's gradient reductions hide behind its backward pass (the
model-independent `cost.overlap`), both applied by `plan_cost`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from collections.abc import Mapping

from tapestry.cost.overlap import StepCost, overlap
from tapestry.plan.plan import Compute, Plan, Reshard, Step, output_gathers
from tapestry.sharding import Mesh


@runtime_checkable
class CostModel(Protocol):
    """Anything with `step_cost`; subclassing is not needed."""

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        """Seconds the mesh spends on `step` (a Place, Compute or Reshard). A Compute's `origin` is for
        explanations only: extraction prices each distinct step once, without it."""
        ...


def step_costs(plan: Plan, model: CostModel) -> dict[str, float]:
    """Seconds per per-run step (by value; prepared steps left out): the model's `plan_step_costs(plan)` where it
    has one (pricing steps together: fusion), else each step's `step_cost`."""
    together = getattr(model, "plan_step_costs", None)
    if together is not None:
        return together(plan)
    return {step.out: model.step_cost(step, plan.mesh) for step in plan.steps if step.out not in plan.prepared}


def alike_key(step: Step) -> tuple:
    """A key shared by steps alike but for their names (and a Compute's origin), which is all a model's
    `step_cost` reads: its blocks by identity, as the steps of an expanded plan's copies share them (hashing every
    device's block per step is not free)."""
    if isinstance(step, Compute):
        return step.binding, id(step.blocks)
    if isinstance(step, Reshard):
        return step.shape, step.dtype, step.src_layout, step.layout
    return step.shape, step.layout


def from_costs(costs: Mapping[str, float]) -> StepCost:
    """`costs` (from step_costs) as the StepCost `cost.overlap` takes."""
    return lambda step, mesh: costs[step.out]


def plan_cost(plan: Plan, model: CostModel) -> float:
    """The sequential SPMD time per run: steps run one after another, each as slow as its slowest device, priced by
    `step_costs` (fused chains as one kernel under DefaultCostModel); prepared steps (`Plan.prepared`: computed
    from static inputs alone) run once ahead of time, so they cost nothing; a training step's gradient reductions
    hide behind its backward pass as far as it lasts (`cost.overlap`)."""
    costs = step_costs(plan, model)
    return sum(costs.values()) - overlap(plan, from_costs(costs)).hidden


def run_costs(plan: Plan, model: CostModel) -> dict[int, float]:
    """Seconds per plan step, then per output gather the runtime adds (numbered on, as lowering numbers them):
    what running the plan should take, step by step."""
    steps = [*plan.steps, *output_gathers(plan)]
    return {k: model.step_cost(step, plan.mesh) for k, step in enumerate(steps)}
