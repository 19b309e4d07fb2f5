"""Activation recomputation (Chen et al. 2016; Megatron's full recomputation) as a rewrite of a training step, so
that hand plans of the rewritten step trade compute for memory where a budget binds.

The search never recomputes a value (an e-class is made once), so a step's peak in the backward holds every forward
value the backward reads (LLaMA 7B, 2 layers, float32 Adam on 8 devices: ZeRO-3 peaks at 3.67 GB, 1.78 GB of it
activations; no plan of the step as captured fits 3 GB). `recomputed` keeps only the residual stream from the
forward to the backward and makes the rest again just before its first backward reader; ZeRO-3 of it peaks at
2.92 GB for 26% more time. Its plans embed in the e-graph as their originals do (a value made twice is one e-node,
`egraph.embed`), and are returned as built (`LeanPlans.hand`).
"""
from __future__ import annotations

from collections.abc import Mapping

from tapestry.cost.overlap import forward_outputs, upstream
from tapestry.graph import Graph
from tapestry.plan import Plan
from tapestry.sharding import Mesh
from tapestry.training.plans import fsdp, step_arguments, zero3

AGAIN = "{}.re"  # a forward value made again in the backward
RECOMPUTED = "{}, recomputed"  # the hand plan of the recomputed step, by its plan's name


def forward_ops(graph: Graph) -> set[str]:
    """The ops the step's loss (its outputs that are not carried) depends on: the forward pass."""
    ops = {node.name for node in graph.ops}
    return upstream(forward_outputs(graph.outputs, graph.carried), lambda v: graph[v].args) & ops


def checkpoints(graph: Graph, forward: set[str]) -> set[str]:
    """The residual stream: each forward embedding's output, and each forward add of the same shape that reads a
    checkpoint (a transformer's residual adds, two per layer): what recomputation keeps from forward to backward.
    A step without them keeps nothing and makes its backward's forward values again from the inputs."""
    kept = {node.name for node in graph.ops if node.name in forward and node.op == "embedding"}
    for node in graph.ops:
        if node.name in forward and node.op == "add" and any(
                a in kept and graph[a].shape == node.shape for a in node.args):
            kept.add(node.name)
    return kept


def recomputed(graph: Graph) -> Graph:
    """The same step computing the same values, where each backward or update op that reads a forward value other
    than a checkpoint reads a copy of it (AGAIN) made again from the checkpoints and inputs, added just before its
    first reader: between forward and backward only the checkpoints stay live (a plan in the graph's step order
    frees the forward's own values after their last forward reader). Constants and carried outputs are kept."""
    forward = forward_ops(graph)
    kept = checkpoints(graph, forward)
    g = Graph()
    made: dict[str, str] = {}

    def again(value: str) -> str:
        if value not in forward or value in kept:
            return value
        if value not in made:
            node = graph[value]
            args = [again(a) for a in node.args]
            made[value] = g.op(node.op, *args, name=AGAIN.format(value), **dict(node.params)).name
        return made[value]

    for node in graph.nodes:
        if node.is_input:
            g.input(node.name, node.shape, node.dtype, static=node.name in graph.static)
        elif node.name in forward:
            g.op(node.op, *node.args, name=node.name, **dict(node.params))
        else:
            g.op(node.op, *(again(a) for a in node.args), name=node.name, **dict(node.params))
    for name, value in graph.outputs.items():
        g.output(name, value)
    g.constants.update(graph.constants)
    g.examples.update(graph.examples)
    g.nonnegative.update(graph.nonnegative)
    for output, name in graph.carried.items():
        g.carry(output, name)
    return g


def recomputed_baselines(graph: Graph, mesh: Mesh, hands: Mapping[str, Plan]) -> dict[str, Plan]:
    """ZeRO-3 and FSDP (whichever of `hands`, `training.plans.baselines` of `graph` on `mesh`, has them) again on
    the `recomputed` step, named RECOMPUTED: the leanest hand plans where activations are most of a peak. None for
    a step without backward reads of forward values to drop."""
    makers = {"ZeRO-3": zero3, "FSDP": fsdp}
    chosen = [name for name in makers if name in hands]
    if not chosen or not graph.carried:
        return {}
    again = recomputed(graph)
    if len(again) == len(graph):
        return {}
    found = {}
    for name in chosen:
        try:
            found[RECOMPUTED.format(name)] = makers[name](again, mesh, step_arguments(again))
        except ValueError:
            continue
    return found
