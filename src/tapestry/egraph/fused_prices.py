"""Node costs that see fusion: each e-node priced as the member of a fusion group its neighbourhood promises.

`cost.fusion` prices a plan's chains of fusible kernels (elementwise, reductions, shapes, views) as one kernel,
but which chains a plan has depends on every choice at once, and an extractor sums costs node by node. So each
node is priced by what its e-graph neighbourhood allows: a class is *fusibly made* when some per-run fusible
Run (not a view) makes it, or a view of a fusibly made class does (a view's memory is its source's). Then

- a fusible Run reads a fusibly made argument for free (the group keeps it in registers) and pays the launch
  only if none of its arguments is fusibly made (a group's first member: one launch a group);
- its own write is paid by what reads its value from outside a group: a Reshard out of the class, a Run that
  is not fusible (a matmul), a Deliver (the plan's output), each the write of the source a view stands for;
- every other node keeps its cost.

The prices are exact for a plan whose fusibly made classes are made by their fusible Runs, each read from
outside once, at one epoch (`cost.fusion`); they are too low where a Reshard makes such a class or a forward value
is read in the backward pass, and too high where two outside readers share one write. Extraction under them is a
heuristic: `Explored.extract` keeps it only where its plan is cheaper by `plan_cost` than the one extracted under
the unfused costs (docs/cost-models.md).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from tapestry.cost.fusion import fusible, member_time, write_time
from tapestry.cost.profile import DeviceProfile
from tapestry.cost import CostModel
from tapestry.egraph.decode import Decoder
from tapestry.extract import EGraph as ExtractGraph

READERS = ("Reshard", "Deliver")  # besides unfusible Runs, nodes that read a value from memory


def fusibly_made(decoder: Decoder) -> dict[str, str]:
    """Fusibly made class -> the class whose write it stands for (itself, or a view's source's, through views)."""
    made: dict[str, str] = {}
    views: dict[str, list[str]] = {}  # source class -> classes its views make
    for node in decoder.nodes:
        if node.op in ("Place", *READERS) or decoder.prepared(node):
            continue
        step = decoder.interner.runs[node.key]
        if not fusible(step):
            continue
        if step.signature.kernel.is_view:
            views.setdefault(node.children[0], []).append(node.eclass)
        else:
            made.setdefault(node.eclass, node.eclass)
    ready = list(made)
    while ready:  # views of fusibly made classes, to a fixpoint
        source = ready.pop()
        for c in views.get(source, ()):
            if c not in made:
                made[c] = made[source]
                ready.append(c)
    return made


def fused_node_costs(decoder: Decoder, costs: Sequence[float], device: DeviceProfile) -> list[float]:
    """`costs` (per node, unfused; infinite: unselectable, kept so) with each node priced as the fusion group
    member its neighbourhood promises (module docstring)."""
    made = fusibly_made(decoder)
    devices = decoder.mesh.size
    layouts = decoder.interner.layouts
    writes: dict[str, float] = {}
    members: dict[tuple[str, tuple[bool, ...], tuple[int, ...]], float] = {}

    def write(c: str) -> float:
        source = made[c]
        if source not in writes:
            layout = layouts[decoder.class_layout[source]][1]
            writes[source] = write_time(layout, decoder.class_dtype[source], device, devices)
        return writes[source]

    fused = list(costs)
    for i, (node, cost) in enumerate(zip(decoder.nodes, costs)):
        if not math.isfinite(cost) or node.op == "Place" or decoder.prepared(node):
            continue
        step = None if node.op in READERS else decoder.interner.runs[node.key]
        if step is not None and fusible(step):
            if step.signature.kernel.is_view:
                continue
            internal = tuple(c in made for c in node.children)
            same = tuple(map(node.children.index, node.children))  # which arguments are one value, read once
            key = (decoder.interner.priced_as[node.key], internal, same)
            if key not in members:
                members[key] = member_time(decoder.step(node, args=node.children), device, devices, internal,
                                           not any(internal))
            fused[i] = min(cost, members[key])
        else:
            fused[i] = cost + sum(write(c) for c in dict.fromkeys(node.children) if c in made)
    return fused


def fused_graph(decoder: Decoder, egraph: ExtractGraph, model: CostModel) -> ExtractGraph | None:
    """`egraph` with each node priced as the fusion group member its neighbourhood promises (`fused_node_costs`),
    where `model` fuses (its `fused_device`) and that changes a price; else None."""
    device = getattr(model, "fused_device", None)
    if device is None:
        return None
    costs = fused_node_costs(decoder, egraph.node_cost, device)
    return None if costs == list(egraph.node_cost) else egraph.with_costs(costs)
