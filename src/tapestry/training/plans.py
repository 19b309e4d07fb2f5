"""Hand-written training strategies as plans: data parallel, ZeRO-3 and Megatron tensor parallel, the baselines
the optimizer's plans are priced against (benchmarks/training.py, tests).

Each is one rule for splitting every op of a training step, found by following a split tensor dim through the
ops' index maps (`split_by_propagation`): data parallel follows the batch dim of the step's arguments through
forward and backward; ZeRO-3 does too, and splits every weight and optimizer state on its first dim between
steps (gathered whole before the forward and backward use them, gradients reduce-scattered, the update run on
shards); Megatron follows the hidden dim of an MLP's weights (column-parallel then row-parallel). Every plan is
made steady: each carried output is moved back into the layout its input was placed in, where the rule left it
elsewhere.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from tapestry.graph import Graph
from tapestry.kernels import DimKind, Signature
from tapestry.plan import Place, Plan, Reshard, Step, build_plan
from tapestry.plan.build import expand_linears
from tapestry.sharding import Layout, Mesh
from tapestry.training import ADAM_SLOTS, state_name

Seeds = Mapping[str, int]  # input name -> the tensor dim to split


def split_by_propagation(graph: Graph, mesh: Mesh, seeds: Sequence[Seeds]) -> Plan:
    """Every op splits, over all of the mesh's devices (every axis splits the same dim), the index dim that maps
    to a split dim of one of its arguments (seed maps earlier in `seeds` win; within one, the first argument), if
    that dim divides evenly and the kernel can be split there; its result is split on the dim that index dim maps
    to. Ops with none run replicated. Inputs are placed as their first user reads them (build_plan)."""
    splits = propagated_splits(graph, mesh.size, seeds)
    return build_plan(graph, mesh, {op: (dim,) * mesh.ndim for op, dim in splits.items()})


def propagated_splits(graph: Graph, parts: int, seeds: Sequence[Seeds]) -> dict[str, int]:
    """Per op, the index dim `split_by_propagation` splits `parts` ways (ops absent: not split)."""
    split: dict[str, tuple[int, int]] = {}  # value -> (priority, tensor dim)
    for priority, chosen in enumerate(seeds):
        for name, dim in chosen.items():
            split.setdefault(name, (priority, dim))
    axes: dict[str, int] = {}
    for node in graph.ops:
        sig = graph.signature(node.name)
        options = sorted(
            (split[arg][0], k, i)
            for k, (arg, projection) in enumerate(zip(node.args, sig.projections)) if arg in split
            for i in range(len(sig.dims))
            if projection.matrix[split[arg][1]][i] != 0 and i in sig.splittable
            and sig.spec.sizes[i] % parts == 0
        )
        if not options:
            continue
        priority, _, index_dim = options[0]
        axes[node.name] = index_dim
        out = [t for t, row in enumerate(sig.output.matrix) if row[index_dim] != 0]
        if out:
            split[node.name] = (priority, out[0])
    return axes


def placed(plan: Plan, layouts: Mapping[str, Layout]) -> Plan:
    """The plan with inputs placed in `layouts` and moved, before anything reads them, into the layout the plan
    placed them in."""
    steps: list[Step] = []
    for step in plan.steps:
        layout = layouts.get(step.input) if isinstance(step, Place) else None
        if layout is None or layout == step.layout:
            steps.append(step)
        else:
            stored = f"{step.out}.stored"
            dtype = plan.graph[step.input].dtype
            steps += [replace(step, out=stored, layout=layout),
                      Reshard(step.out, stored, step.shape, layout, step.layout, dtype)]
    return replace(plan, steps=tuple(steps))


def steady(plan: Plan) -> Plan:
    """The plan with each carried output moved into the layout its input is placed in, where it is not."""
    where = {s.input: s.layout for s in plan.steps if isinstance(s, Place)}
    steps, outputs = list(plan.steps), dict(plan.outputs)
    for out, name in plan.graph.carried.items():
        value = plan.by_id[outputs[out]]
        if name in where and value.layout != where[name]:
            steps.append(Reshard(f"{value.out}.back", value.out, plan.graph[name].shape, value.layout, where[name],
                                 plan.dtypes[value.out]))
            outputs[out] = steps[-1].out
    return replace(plan, steps=tuple(steps), outputs=outputs)


def batch_seeds(graph: Graph, arguments: Sequence[str]) -> Seeds:
    return {name: 0 for name in arguments if graph[name].shape}


def data_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str]) -> Plan:
    """The batch split over every device; weights and optimizer state whole on each, gradients all-reduced."""
    return steady(split_by_propagation(graph, mesh, [batch_seeds(graph, arguments)]))


def zero3(graph: Graph, mesh: Mesh, arguments: Sequence[str]) -> Plan:
    """Data parallel compute, with every carried tensor that splits evenly stored split on its first dim between
    steps (ZeRO stage 3): gathered before use, gradients reduce-scattered, the update run on shards."""
    state = {name: 0 for name in graph.carried.values()
             if graph[name].shape and graph[name].shape[0] % mesh.size == 0}
    plan = split_by_propagation(graph, mesh, [batch_seeds(graph, arguments), state])
    return steady(placed(plan, {name: Layout.split(graph[name].shape, mesh, (0,) * mesh.ndim) for name in state}))


def step_arguments(graph: Graph) -> tuple[str, ...]:
    """A training step's batch arguments: the inputs with a shape that are neither carried state nor fixed."""
    return tuple(node.name for node in graph.inputs if node.shape and node.name not in graph.carried.values()
                 and node.name not in graph.fixed)


def baselines(graph: Graph, mesh: Mesh) -> dict[str, Plan]:
    """Data parallel and ZeRO-3 over all of `mesh`'s devices, for a training step (`graph.carried`) whose batch
    arguments all split on their first dim over every device; else none (a batch that does not split leaves
    both mostly replicated: no baseline worth pricing). A strategy build_plan cannot make of this graph (a
    ValueError naming the op) is no baseline either: the optimizer's plan stands without it."""
    arguments = step_arguments(graph)
    if not graph.carried or not arguments or any(graph[a].shape[0] % mesh.size for a in arguments):
        return {}
    found = {}
    for name, make in (("data parallel", data_parallel), ("ZeRO-3", zero3)):
        try:
            found[name] = make(graph, mesh, arguments)
        except ValueError:
            continue
    return found


def megatron(graph: Graph, mesh: Mesh, hidden: Seeds) -> Plan:
    """Tensor parallel over the graph with linears expanded (so a row-parallel contraction can split):
    `hidden` names each weight's dim to split (column-parallel weights on their output dim, row-parallel ones
    on their input dim); each weight's optimizer state is split like it."""
    return steady(split_by_propagation(expand_linears(graph), mesh, [_with_state(graph, hidden)]))


def data_tensor_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str], hidden: Seeds) -> Plan:
    """The usual 2-D recipe on a 2-D mesh: data parallel over mesh axis 0 and Megatron tensor parallel over axis
    1 (an op both split on one index dim splits it over the whole mesh), linears expanded as `megatron` does."""
    if mesh.ndim != 2:
        raise ValueError(f"data_tensor_parallel plans 2-D meshes; got {mesh.shape}")
    expanded = expand_linears(graph)
    data = propagated_splits(expanded, mesh.shape[0], [batch_seeds(expanded, arguments)])
    tensor = propagated_splits(expanded, mesh.shape[1], [_with_state(graph, hidden)])
    axes = {op.name: _joint(expanded.signature(op.name), data.get(op.name), tensor.get(op.name), mesh.size)
            for op in expanded.ops}
    return steady(build_plan(expanded, mesh, axes))


def _joint(sig: Signature, first: int | None, second: int | None, devices: int) -> tuple[int | None, int | None]:
    """The two axes' splits of one op, where a reduction split over one axis only would leave partial sums
    replicated over the other (counted twice): then the reduction splits over both (if it divides among all
    devices) or over neither."""
    reductions = sig.dims_of(DimKind.REDUCTION)
    alone = first if second is None else second if first is None else None
    if alone is None or alone not in reductions:
        return first, second
    return (alone, alone) if sig.spec.sizes[alone] % devices == 0 else (None, None)


def _with_state(graph: Graph, hidden: Seeds) -> Seeds:
    """`hidden`, plus each weight's optimizer state split like the weight."""
    seeds = dict(hidden)
    for weight, dim in hidden.items():
        seeds.update({state_name(slot, weight): dim for slot in ADAM_SLOTS if state_name(slot, weight) in graph})
    return seeds
