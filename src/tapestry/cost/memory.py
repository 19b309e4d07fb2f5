"""Memory per device: the second objective next to time.

Counts the blocks of values each device holds (float32), not kernel scratch
space or allocator slack: enough to rank plans and to enforce a budget.
"""
from __future__ import annotations

from tapestry.cost.comm import BYTES_PER_ELEMENT
from tapestry.plan.plan import Compute, Plan, Reshard, Step


def held_bytes(step: Step) -> tuple[int, ...]:
    """Bytes of the step's result on each device: what choosing this e-node adds to memory."""
    return tuple(0 if b is None else BYTES_PER_ELEMENT * b.size for b in step.layout.blocks)


def _args(step: Step) -> tuple[str, ...]:
    if isinstance(step, Compute):
        return step.args
    return (step.src,) if isinstance(step, Reshard) else ()


def peak_memory(plan: Plan) -> list[int]:
    """Per device, the most bytes live at once when the steps run in order.

    A value is live from its step to its last use (plan outputs: to the end).
    At a step, its inputs and its result are live together. Inputs are freed
    after their last use like any other value.
    """
    end = len(plan.steps)
    last_use = {step.out: i for i, step in enumerate(plan.steps)}
    for i, step in enumerate(plan.steps):
        for arg in _args(step):
            last_use[arg] = i
    for value in plan.outputs.values():
        last_use[value] = end
    live = [0] * plan.mesh.size
    peak = [0] * plan.mesh.size
    freed: dict[int, list[str]] = {}
    for value, i in last_use.items():
        freed.setdefault(i, []).append(value)
    for i, step in enumerate(plan.steps):
        live = [a + b for a, b in zip(live, held_bytes(step))]
        peak = [max(a, b) for a, b in zip(peak, live)]
        for value in freed.get(i, []):
            live = [a - b for a, b in zip(live, held_bytes(plan.by_id[value]))]
    return peak
