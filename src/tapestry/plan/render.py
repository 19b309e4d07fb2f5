"""Graphviz pictures of plans: one cluster per device, communication as edges between clusters."""
from __future__ import annotations

from collections import Counter

import graphviz

from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding.collectives import classify_reshard
from tapestry.sharding.comm import transfers

_FILL = {Place: "#D6EAF8", Compute: "#FFFFFF", Reshard: "#FDEBD0"}


def _node(value: str, device: int) -> str:
    return f"{value}@{device}"


def _label(step: Step, device: int) -> str:
    """What this device does in the step: the kernel and its index block, or the block it receives."""
    if isinstance(step, Compute):
        return f"{step.kernel} {step.blocks[device]}"
    if isinstance(step, Place):
        return f"{step.input} {step.layout.blocks[device]}"
    return f"{step.out} {step.layout.blocks[device]}"


def plan_to_dot(plan: Plan) -> graphviz.Digraph:
    dot = graphviz.Digraph("plan", graph_attr={"rankdir": "TB", "compound": "true"},
                           node_attr={"fontname": "Helvetica", "shape": "box", "style": "filled"})
    holders = {s.out: [k for k, b in enumerate(s.layout.blocks) if b is not None] for s in plan.steps}
    for k in plan.mesh.devices:
        coords = f" {plan.mesh.coords(k)}" if plan.mesh.ndim > 1 else ""
        with dot.subgraph(name=f"cluster_d{k}", graph_attr={"label": f"device {k}{coords}"}) as cluster:
            for step in plan.steps:
                if k in holders[step.out]:
                    cluster.node(_node(step.out, k), _label(step, k), fillcolor=_FILL[type(step)], tooltip=step.out)
    for step in plan.steps:
        if isinstance(step, Compute):
            for k in holders[step.out]:
                for arg in step.args:
                    if k in holders[arg]:
                        dot.edge(_node(arg, k), _node(step.out, k))
        elif isinstance(step, Reshard):
            _reshard_edges(dot, plan, step, holders)
    for name, value in plan.outputs.items():
        dot.node(f"output {name}", name, shape="doubleoctagon", fillcolor="#D5F5E3")
        for k in holders[value]:
            dot.edge(_node(value, k), f"output {name}")
    return dot


def _reshard_edges(dot: graphviz.Digraph, plan: Plan, step: Reshard, holders: dict[str, list[int]]) -> None:
    """Local slices as plain edges; moves as one labelled edge per device pair, summing the elements."""
    collective = classify_reshard(step.src_layout, step.layout, step.shape, plan.mesh)
    moved: Counter[tuple[int, int]] = Counter()
    for t in transfers(step.src_layout, step.layout):
        moved[t.src, t.dst] += t.region.size
    for k in holders[step.out]:
        if k in holders[step.src]:
            dot.edge(_node(step.src, k), _node(step.out, k), style="dashed")
    for (src, dst), n in sorted(moved.items()):
        dot.edge(_node(step.src, src), _node(step.out, dst), label=f"{collective} {n}", color="#C0392B", fontcolor="#C0392B")
