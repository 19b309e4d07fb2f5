"""A layer's stage-boundary transfers priced into its extraction (`BoundaryPriced`).

A stage receives each micro-batch's layer input from the stage before it and the incoming gradient from the
stage after it, each in the layout its layer plan places them in: one hop of that many bytes per device over the
pipeline axis's link (`planner.best_configuration`'s `transfer`). The optimizer prices a Place as free (inputs
arrive laid out), so it is indifferent between a plan that takes its input whole on every device and one that
takes it split, where the pipeline pays the first eight times the bytes per hop on 8 devices: on the 7B step on
64 GPUs the fastest layer plan took its 134 MB input whole (docs/benchmarks.md, "7B on 64 GPUs at 4M tokens per
step"). Priced with the hops, extraction sees that cost."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tapestry import dtypes
from tapestry.cost import CostModel, Link
from tapestry.graph import Graph
from tapestry.plan import Place, Plan, Reshard, Step
from tapestry.sharding import Mesh
from tapestry.training import LR


def boundary_inputs(graph: Graph) -> tuple[str, ...]:
    """The inputs of a layer's training step (`layer.layer_step`) that cross a stage boundary, in order: the layer's
    input, then the incoming gradient (neither carried, static, a constant nor the learning rate)."""
    return tuple(n.name for n in graph.inputs if n.name not in graph.carried.values() and n.name != LR
                 and n.name not in graph.static and n.name not in graph.constants)


@dataclass(frozen=True)
class BoundaryPriced:
    """`model`, with each Place of a stage-boundary input priced as the layer's share of the hops that carry it
    and that the step waits for (`hops` per layer and micro-batch, `planner.exposed_share`: a stage of k layers
    receives each micro-batch's input once, not k times, and most hops are sent while the receiver computes),
    each its bytes per device (the most any device holds) over the pipeline's link (beta only: the latency is the
    same whatever the layout; a plan that places an input in two layouts pays for both, more than sending the
    larger and slicing it, so extraction prefers that). Everything else is `model`'s, fusion included."""

    model: CostModel
    seconds_per_element: tuple[tuple[str, float], ...]  # input name -> hops x its item size / the link's bandwidth

    @classmethod
    def of(cls, model: CostModel, graph: Graph, link: Link, hops: float) -> BoundaryPriced:
        itemsize = {n.name: dtypes.itemsize(n.dtype) for n in graph.inputs}
        return cls(model, tuple((name, hops * itemsize[name] / link.beta) for name in boundary_inputs(graph)))

    def hop(self, step: Step) -> float:
        """Seconds the pipeline spends sending `step` between stages: 0 but for a boundary input's Place."""
        if not isinstance(step, Place):
            return 0.0
        per_element = dict(self.seconds_per_element).get(step.input)
        if per_element is None:
            return 0.0
        return per_element * max((b.size for b in step.layout.blocks if b is not None), default=0)

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        return self.model.step_cost(step, mesh) + self.hop(step)

    def plan_step_costs(self, plan: Plan) -> dict[str, float]:
        together = getattr(self.model, "plan_step_costs", None)
        costs = together(plan) if together is not None else {
            step.out: self.model.step_cost(step, plan.mesh) for step in plan.steps if step.out not in plan.prepared}
        return {out: cost + self.hop(plan.by_id[out]) for out, cost in costs.items()}

    # What else extraction reads of a cost model, each named (a catch-all delegation would hand out the model's own
    # methods, whose calls through their `self` never see the hops)
    @property
    def profile(self) -> Any:
        return self.model.profile

    @property
    def fused_device(self) -> Any:
        """The model's (`DefaultCostModel.fused_device`), None where it prices no fusion."""
        return getattr(self.model, "fused_device", None)

    @property
    def reshard_floors(self) -> Callable[[Sequence[Reshard], Mesh], Any]:
        """The model's bound to reshards, which cross no stage boundary; an AttributeError where it has none, so
        that extraction prices its moves as the model alone would (`egraph.extractor_pricing`)."""
        return self.model.reshard_floors
