"""Gradient reductions run beside the backward pass, as data parallel training runs them.

A step-by-step sum charges every collective in full, but PyTorch DDP (Li et al., VLDB 2020) all-reduces
gradient buckets on a second stream while the backward pass goes on, and ZeRO-2 does the same with its
reduce-scatters. Without that, replicated weights (one all-reduce per gradient) and sharded optimizer state
(a reduce-scatter now, an all-gather of the weight before its next use) move the same bytes, so the sharded
update, N times smaller, always won: data parallelism never came out, even for a small model at a large batch.

What is credited, per plan:
- reductions: Reshards out of a partial layout of a value no non-carried output needs (off the forward
  path of a training step: gradients, and activation gradients a tensor-parallel backward sums);
- backward: Compute steps off the forward path that such a reduction waits for (the backward pass).
The plan's time is the sum of its steps less min(reductions, backward): the most the backward pass can hide.
This is the upper bound DDP's bucketing approaches (the last bucket's reduction has nothing left to hide
behind); an all-gather on use, a forward value's reduction and the update are never hidden. Plans without
carried state (inference) have no reductions to credit.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Mesh

StepCost = Callable[[Step, Mesh], float]


@dataclass(frozen=True)
class Overlap:
    """Seconds of gradient reductions, seconds of the backward compute beside them, and what that hides."""

    reductions: float = 0.0
    backward: float = 0.0

    @property
    def hidden(self) -> float:
        return min(self.reductions, self.backward)


def upstream(sources: Iterable[str], children: Callable[[str], Iterable[str]]) -> set[str]:
    """Everything `sources` depend on, themselves included (an explicit stack: deep graphs)."""
    found: set[str] = set()
    stack = list(sources)
    while stack:
        value = stack.pop()
        if value not in found:
            found.add(value)
            stack.extend(children(value))
    return found


def forward_outputs(outputs: Mapping[str, str], carried: Collection[str]) -> list[str]:
    """The values of the outputs that are not carried to the next step (the loss): the forward path's ends."""
    return [value for name, value in outputs.items() if name not in carried]


def overlap(plan: Plan, step_cost: StepCost) -> Overlap:
    """What `plan`'s backward pass can hide of its gradient reductions (module docstring)."""
    if not plan.graph.carried:
        return Overlap()
    by_id = plan.by_id

    def args(value: str) -> tuple[str, ...]:
        step = by_id[value]
        return step.args if isinstance(step, Compute) else () if isinstance(step, Place) else (step.src,)

    forward = upstream(forward_outputs(plan.outputs, plan.graph.carried), args)
    reductions = [s for s in plan.steps if isinstance(s, Reshard) and s.src_layout.partial
                  and s.out not in forward and s.out not in plan.prepared]
    waited_for = upstream((s.src for s in reductions), args)
    backward = [s for s in plan.steps if isinstance(s, Compute) and s.out in waited_for
                and s.out not in forward and s.out not in plan.prepared]
    return Overlap(sum(step_cost(s, plan.mesh) for s in reductions), sum(step_cost(s, plan.mesh) for s in backward))
