"""Hand-written training strategies as plans: data parallel, ZeRO-3, Megatron tensor parallel and expert
parallel, the baselines the optimizer's plans are priced against (benchmarks/training.py, benchmarks/cluster.py,
tests).

Each is one rule for splitting every op of a training step, found by following a split tensor dim through the
ops' index maps (`split_by_propagation`): data parallel follows the batch dim of the step's arguments through
forward and backward; ZeRO-3 does too, and splits every weight and optimizer state on its first dim between
steps (gathered whole before the forward and backward use them, gradients reduce-scattered, the update run on
shards); Megatron follows the hidden dim of an MLP's weights (column-parallel then row-parallel); expert
parallel follows a MoE's expert weights split by expert, and where a split meets an exchange kernel's rows,
experts or routing blocks the kernel exchanges (`Compute.exchange`: rows moved to their experts' devices by
all-to-all), for either routing: batch-wide (grouped_mm, take_rows) or block by block (grouped_mm_blocks, the
capture's default, whose dispatch and combine are gathers within each sequence, so they stay data parallel). Every
plan is made steady: each carried output is moved back into the layout its input was placed in, where the rule
left it elsewhere.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from tapestry.graph import Graph
from tapestry.kernels import DimKind, Signature
from tapestry.plan import Place, Plan, Reshard, Step, build_plan
from tapestry.plan.build import expand_linears, take_rows_of
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.partition import make_partition, returns
from tapestry.training import ADAM_SLOTS, state_name

Seeds = Mapping[str, int]  # input name -> the tensor dim to split
EXCHANGE = "exchange"  # an op's choice in `propagated_splits`: its exchange dims (rows and experts) split together
# a MoE's experts and their weight gradients, routed batch-wide (grouped_mm) or block by block (grouped_mm_blocks)
EXPERTS = frozenset({"grouped_mm", "grouped_mm_k", "grouped_mm_blocks", "grouped_mm_blocks_k"})
ROUTES = frozenset({"take_rows", "scatter_rows"})  # its tokens' dispatch to rows sorted by expert, their combine,
# and their backwards (an embedding's backward too: the token gradients sent to their vocabulary rows' devices)


def split_by_propagation(graph: Graph, mesh: Mesh, seeds: Sequence[Seeds]) -> Plan:
    """Every op splits, over all of the mesh's devices (every axis splits the same dim), the index dim that maps
    to a split dim of one of its arguments (seed maps earlier in `seeds` win; within one, the first argument), if
    that dim divides evenly and the kernel can be split there; its result is split on the dim that index dim maps
    to. Ops with none run replicated. Inputs are placed as their first user reads them (build_plan)."""
    return _split_every_axis(graph, mesh, propagated_splits(graph, mesh.size, seeds))


def _split_every_axis(graph: Graph, mesh: Mesh, splits: Mapping[str, int]) -> Plan:
    """The plan splitting each op in `splits` on its index dim over every device (every axis the same dim)."""
    return build_plan(graph, mesh, {op: (dim,) * mesh.ndim for op, dim in splits.items()})


def propagated_splits(graph: Graph, parts: int, seeds: Sequence[Seeds], exchanged: frozenset[str] = frozenset(),
                      whole: frozenset[str] = frozenset()) -> dict[str, int | str]:
    """Per op, the index dim `split_by_propagation` splits `parts` ways (ops absent: not split), or EXCHANGE for
    an op of a kernel in `exchanged` whose chosen dim travels with its exchange's rows (`_moving`; rows and experts
    dividing evenly): it splits rows and experts together, its output on the dim the rows map to (else the
    experts'). The ops in `whole` split nothing, and pass no split on."""
    split: dict[str, tuple[int, int]] = {}  # value -> (priority, tensor dim)
    for priority, chosen in enumerate(seeds):
        for name, dim in chosen.items():
            split.setdefault(name, (priority, dim))
    axes: dict[str, int | str] = {}
    for node in graph.ops:
        if node.name in whole:
            continue
        sig = graph.signature(node.name)
        chosen = _first_split(sig, node.args, split, parts)
        if chosen is None:
            continue
        priority, index_dim = chosen
        axes[node.name] = index_dim
        ex = sig.kernel.exchange
        if node.op in exchanged and ex is not None and index_dim in _moving(sig) \
                and all(sig.spec.sizes[sig.dims.index(d)] % parts == 0 for d in (ex.rows, ex.experts)):
            axes[node.name] = EXCHANGE
            index_dim = sig.dims.index(ex.rows if returns(sig) else ex.experts)
        out = [t for t, row in enumerate(sig.output.matrix) if row[index_dim] != 0]
        if out:
            split[node.name] = (priority, out[0])
    return axes


def _moving(sig: Signature) -> set[int]:
    """An exchange kernel's index dims a split of which the exchange takes over: its rows, its experts, and the
    dims its routing input (the last, whose values the exchange's select reads) is read along, grouped_mm_blocks'
    blocks (ends[B, E]): a batch split arriving there gives way to the exchange, each device then holding its row
    block of every block."""
    ex = sig.kernel.exchange
    routing = sig.projections[-1].matrix
    return {sig.dims.index(ex.rows), sig.dims.index(ex.experts),
            *(i for i in range(len(sig.dims)) if any(row[i] for row in routing))}


def _first_split(sig: Signature, args: Sequence[str], split: Mapping[str, tuple[int, int]], parts: int
                 ) -> tuple[int, int] | None:
    """(priority, index dim) an op splits `parts` ways in `propagated_splits`: the index dim that maps to the split
    dim of its argument of highest priority (within one, the first argument), if splittable and dividing evenly."""
    options = sorted(
        (split[arg][0], k, i)
        for k, (arg, projection) in enumerate(zip(args, sig.projections)) if arg in split
        for i in range(len(sig.dims))
        if projection.matrix[split[arg][1]][i] != 0 and i in sig.splittable and sig.spec.sizes[i] % parts == 0
    )
    return (options[0][0], options[0][2]) if options else None


def tensor_parallel_seeds(graph: Graph, parts: int, weights: Collection[str] | None = None) -> Seeds:
    """Megatron's split of each weight, found from the graph's structure rather than its names (what `megatron`
    and `data_tensor_parallel` take as `hidden`). In op order, each carried tensor is settled at its first reader,
    followed to it through one-argument ops that read each dim from one dim (a transpose, a cast): where the
    reader splits on a dim of the weight (the activation arriving split on the dim a contraction sums: a
    row-parallel linear; or on the features a bias adds to) the weight splits there; where the reader is a
    contraction that splits on nothing yet, the weight splits on the dim it alone gives the output (a
    column-parallel linear's output features), if some row-parallel contraction later sums what that split
    (Megatron's pairs; an LM head's vocabulary split would leave its logits split); else it stays whole (norms,
    embeddings). Optimizer state splits like the gradient its update reads. `weights` are the tensors to split,
    default the carried ones (a training step's); an inference graph names its parameters."""
    weights = graph.carried.values() if weights is None else weights
    whole: set[str] = set()
    while True:
        seeds, unpaired = _megatron_pass(graph, parts, whole, weights)
        if not unpaired:
            return seeds
        whole |= unpaired


def _megatron_pass(graph: Graph, parts: int, whole: set[str], weights: Collection[str]
                   ) -> tuple[dict[str, int], set[str]]:
    """One pass of `tensor_parallel_seeds` over `weights` with those in `whole` kept whole: the seeds, and the
    column-parallel weights no row-parallel contraction pairs."""
    origin: dict[str, tuple[str, tuple[int, ...]]] = {w: (w, tuple(range(len(graph[w].shape)))) for w in weights}
    split: dict[str, tuple[int, int]] = {}
    columns: dict[str, set[str]] = {}  # a split value -> the column-parallel weights its split comes from
    settled, seeds, paired = set(whole), {}, set()
    for node in graph.ops:
        sig = graph.signature(node.name)
        followed = [(k, arg) for k, arg in enumerate(node.args) if arg in origin and origin[arg][0] not in settled]
        through = _one_to_one(sig) if len(node.args) == 1 and followed else None
        if through is not None:
            weight, dims = origin[node.args[0]]
            origin[node.name] = (weight, tuple(dims[t] for t in through))
            continue
        chosen = _first_split(sig, node.args, split, parts)
        sources = set().union(*(columns.get(arg, ()) for arg in node.args))
        contraction = sig.dims_of(DimKind.REDUCTION)
        for k, arg in followed:
            weight, dims = origin[arg]
            if weight in settled:
                continue
            settled.add(weight)
            reads = {i: t for t, row in enumerate(sig.projections[k].matrix) for i, c in enumerate(row) if c}
            if chosen is not None and chosen[1] in reads:
                seeds[weight] = dims[reads[chosen[1]]]
                if chosen[1] in contraction:
                    paired |= sources
            elif chosen is None and contraction:
                alone = [i for i in reads if i in sig.splittable and sig.spec.sizes[i] % parts == 0
                         and any(row[i] for row in sig.output.matrix)
                         and not any(row[i] for j, p in enumerate(sig.projections) if j != k for row in p.matrix)]
                if alone:
                    seeds[weight] = dims[reads[alone[0]]]
                    split[arg], chosen, sources = (0, reads[alone[0]]), (0, alone[0]), {weight}
        if chosen is not None:
            out = [t for t, row in enumerate(sig.output.matrix) if row[chosen[1]] != 0]
            if out:
                split[node.name], columns[node.name] = (0, out[0]), sources
    unpaired = {w for w in set().union(*columns.values()) if w not in paired} if columns else set()
    return seeds, unpaired


def _one_to_one(sig: Signature) -> tuple[int, ...] | None:
    """For a one-argument op, the argument dim each output dim reads, if each reads exactly one; else None."""
    through = []
    for row in sig.output.matrix:
        read = {t for i, c in enumerate(row) if c for t, arg_row in enumerate(sig.projections[0].matrix) if arg_row[i]}
        if len(read) != 1:
            return None
        through.append(read.pop())
    return tuple(through)


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


def sequence_seeds(graph: Graph, arguments: Sequence[str]) -> Seeds:
    return {name: 1 for name in arguments if len(graph[name].shape) > 1}


def data_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str]) -> Plan:
    """The batch split over every device; weights and optimizer state whole on each, gradients all-reduced. A
    batch that does not split over every device is refused (ValueError), not run replicated under this name (Falcon's
    inference on 8x8 at batch 8 priced its "data parallel" as the all-replicated plan, as its "tensor parallel")."""
    batch = batch_seeds(graph, arguments)
    sizes = {name: graph[name].shape[0] for name in batch}
    if not sizes or any(n % mesh.size for n in sizes.values()):
        raise ValueError(f"data parallel: the batch (dim 0 of the arguments: {sizes}) does not split over the "
                         f"mesh's {mesh.size} devices; every op would run replicated")
    return steady(split_by_propagation(graph, mesh, [batch]))


def zero3(graph: Graph, mesh: Mesh, arguments: Sequence[str]) -> Plan:
    """Data parallel compute, with every carried tensor that splits evenly stored split on its first dim between
    steps (ZeRO stage 3): placed so, gathered before the forward and backward use it, gradients reduce-scattered
    and the update run on shards (`split_backward`: a gradient's own update ops, Adam's squares among them, split
    like the state they update, and the update reads the stored shard, not a gathered copy). The state's split
    reaches only ops the batch does not flow through: where the batch does not divide among the devices, the
    forward and backward run replicated, as data parallel's do, rather than split along the weights' first dims (a
    tensor-parallel plan by accident, whose partial sums reduced into a chunk's half moved point to point:
    Mixtral's step on 64 devices priced 5.3 s where data parallel's is 139 ms)."""
    state = {name: 0 for name in graph.carried.values()
             if graph[name].shape and graph[name].shape[0] % mesh.size == 0}
    batch = batch_seeds(graph, arguments)
    flows = propagated_splits(graph, 1, [batch])  # every op the batch flows through, whether or not it divides
    whole = frozenset(flows) - frozenset(propagated_splits(graph, mesh.size, [batch]))
    splits = propagated_splits(graph, mesh.size, [batch, state], whole=whole)
    splits.update(split_backward(graph, splits, mesh.size, whole))
    stored = {name: Layout.split(graph[name].shape, mesh, (0,) * mesh.ndim) for name in state}
    return steady(build_plan(graph, mesh, {op: (dim,) * mesh.ndim for op, dim in splits.items()}, stored=stored))


def fsdp(graph: Graph, mesh: Mesh, arguments: Sequence[str]) -> Plan:
    """FSDP (ZeRO-3) on any mesh: every carried tensor stored split over all devices between steps (on its first
    dim that divides among them), gathered before use; the batch split over the mesh axes it divides (taken in
    order) and the sequence (dim 1 of the batch arguments) over the others, so that the weight gradients, summed
    over batch and sequence, come out partial over every axis and are reduce-scattered into the state's layout,
    the update run on shards. Where the batch splits over every device this is `zero3`. An op that would split a
    sum over some axes but run replicated over others (partial sums held twice) splits that sum over those too
    where it divides, else splits no sum (`_summed_over_every_axis`)."""
    batch_axes, sequence_axes = _batch_axes(graph, mesh, arguments, range(mesh.ndim))
    if not arguments or not batch_axes and not any(len(graph[a].shape) > 1 for a in arguments):
        raise ValueError(f"fsdp: the step's batch arguments {list(arguments)} split over no axis of mesh "
                         f"{mesh.shape}, batch or sequence")
    data = propagated_splits(graph, math.prod(mesh.shape[i] for i in batch_axes), [batch_seeds(graph, arguments)])
    sequence = propagated_splits(graph, math.prod(mesh.shape[i] for i in sequence_axes),
                                 [sequence_seeds(graph, arguments)])
    stored = {name: next(d for d, n in enumerate(graph[name].shape) if n % mesh.size == 0)
              for name in graph.carried.values() if any(n % mesh.size == 0 for n in graph[name].shape)}
    if not stored:
        raise ValueError(f"fsdp: no carried tensor has a dim that divides among the mesh's {mesh.size} devices")
    update = propagated_splits(graph, mesh.size, [stored])
    axes: dict[str, tuple[int | None, ...]] = {}
    for node in graph.ops:
        if node.name in data or node.name in sequence:
            chosen = [data.get(node.name) if axis in batch_axes else sequence.get(node.name)
                      for axis in range(mesh.ndim)]
            axes[node.name] = _summed_over_every_axis(graph.signature(node.name), mesh, chosen)
        elif node.name in update:
            axes[node.name] = (update[node.name],) * mesh.ndim
    backward = split_backward(graph, update, mesh.size, frozenset(data) | frozenset(sequence))
    axes.update({op: (dim,) * mesh.ndim for op, dim in backward.items()})
    layouts = {name: Layout.split(graph[name].shape, mesh, (dim,) * mesh.ndim) for name, dim in stored.items()}
    return steady(build_plan(graph, mesh, axes, stored=layouts))


def _summed_over_every_axis(sig: Signature, mesh: Mesh, chosen: Sequence[int | str | None],
                            summed: set[int] | None = None, exchange: Sequence[int] = ()) -> tuple[int | None, ...]:
    """Per mesh axis the index dim an op splits (`chosen`, None: replicated there) made valid: a dim chosen on
    several axes must divide among all of them (else the later axes drop it), and where a sum (`summed`, default
    the reduction dims) splits on some axis, no axis may replicate (a partial layout's value is the sum over every
    device holding it): each replicated axis takes a split sum that divides among it too, else no axis splits a
    sum. The axes an op's exchange runs over (`exchange`) are neither: the exchange's own."""
    axes: list[int | None] = []
    for axis, dim in enumerate(chosen):
        if not isinstance(dim, int):
            axes.append(None)
            continue
        parts = math.prod(mesh.shape[i] for i, d in enumerate(axes) if d == dim) * mesh.shape[axis]
        axes.append(dim if sig.spec.sizes[dim] % parts == 0 else None)
    sums = sig.dims_of(DimKind.REDUCTION) if summed is None else summed
    if not any(d in sums for d in axes):
        return tuple(axes)
    for axis, dim in enumerate(axes):
        if dim is None and axis not in exchange:
            axes[axis] = next((r for r in sums if r in axes and sig.spec.sizes[r] % (
                math.prod(mesh.shape[i] for i, d in enumerate(axes) if d == r) * mesh.shape[axis]) == 0), None)
    if any(d is None for axis, d in enumerate(axes) if axis not in exchange):
        return tuple(None if d in sums else d for d in axes)
    return tuple(axes)


def _batch_axes(graph: Graph, mesh: Mesh, arguments: Sequence[str], among: Sequence[int]
                ) -> tuple[list[int], list[int]]:
    """Of the mesh axes `among`, those the batch (dim 0 of every batch argument) splits over, taken in order while
    it divides among them all ("as far as the batch divides"), and the rest, over which the sequence splits."""
    batch: list[int] = []
    for axis in among:
        if all(graph[a].shape[0] % (math.prod(mesh.shape[i] for i in batch) * mesh.shape[axis]) == 0
               for a in arguments):
            batch.append(axis)
    return batch, [axis for axis in among if axis not in batch]


def _data_splits(graph: Graph, mesh: Mesh, arguments: Sequence[str], exchanged: frozenset[str] = frozenset(),
                 split_sequence: bool = True, split_batch: bool = True
                 ) -> tuple[list[int], dict[str, int | str], dict[str, int | str]]:
    """The n-D recipes' data part over the outer axes (`_outer_axes`): the axes the batch splits over (with
    `split_batch`; else none: whole over every outer axis), and per op its `propagated_splits` over them
    (`exchanged` as there) and over the other outer axes by the sequence (with `split_sequence`; else whole there)."""
    batch_axes, sequence_axes = _batch_axes(graph, mesh, arguments, _outer_axes(mesh)) if split_batch else ([], [])
    sequence_axes = sequence_axes if split_sequence else []
    data = propagated_splits(graph, math.prod(mesh.shape[a] for a in batch_axes), [batch_seeds(graph, arguments)],
                             exchanged) if batch_axes else {}
    sequence = propagated_splits(graph, math.prod(mesh.shape[a] for a in sequence_axes),
                                 [sequence_seeds(graph, arguments)]) if sequence_axes else {}
    return batch_axes, data, sequence


def step_arguments(graph: Graph) -> tuple[str, ...]:
    """A training step's batch arguments: the inputs with a shape that are neither carried state nor fixed."""
    return tuple(node.name for node in graph.inputs if node.shape and node.name not in graph.carried.values()
                 and node.name not in graph.fixed)


def expert_weights(graph: Graph) -> Seeds:
    """Each carried tensor some grouped_mm (or grouped_mm_blocks) reads as its experts' weights, and its expert
    dim: followed back from the weight argument through ops that read that dim from one argument dim only (a
    transpose, a cast) to the input it comes from."""
    producers = {node.name: node for node in graph.ops}
    found: dict[str, int] = {}
    for node in graph.ops:
        if node.op not in ("grouped_mm", "grouped_mm_blocks"):
            continue
        sig = graph.signature(node.name)
        source = _reader(sig, node.args, {sig.dims.index(sig.kernel.exchange.experts)}, among=(1,))  # the weights
        while source is not None and source[0] in producers:
            value, dim = source
            sig = graph.signature(value)
            source = _reader(sig, producers[value].args, {i for i, c in enumerate(sig.output.matrix[dim]) if c})
        if source is not None and source[0] in graph.carried.values():
            found[source[0]] = source[1]
    return found


def _reader(sig: Signature, args: Sequence[str], index_dims: set[int], among: Sequence[int] | None = None
            ) -> tuple[str, int] | None:
    """The argument (of those at positions `among`, default all) and its dim that `sig`'s `index_dims` read,
    if just one dim of one argument does."""
    reads = [(args[k], t) for k in (range(len(args)) if among is None else among)
             for t, row in enumerate(sig.projections[k].matrix) if any(row[i] for i in index_dims)]
    return reads[0] if len(reads) == 1 else None


def baselines(graph: Graph, mesh: Mesh, refused: dict[str, str] | None = None) -> dict[str, Plan]:
    """The hand plans of a training step (`graph.carried`) on `mesh`: Megatron tensor parallel over every device
    (the mesh's axes taken as one) and, on a mesh of 2 or more axes, the n-D recipes (a node's devices the last
    axis): data parallel over the outer axes jointly with tensor parallel over the last, their weights' splits found
    from the graph's structure (`tensor_parallel_seeds`); where the step's batch arguments all split on their first dim
    over every device, data parallel and ZeRO-3 over all devices (where they do not, FSDP: the state over every device,
    the batch over the axes it divides, the sequence over the rest), and for a MoE (`expert_weights`) expert parallel
    over every device and, on 2 or more axes, data and expert parallel (attention and dense layers data parallel over
    the outer axes only, whole over the last) and data, tensor and expert parallel (DP x (TP + EP), Megatron's and
    DeepSpeed-MoE's layout: attention and dense layers tensor parallel over the last axis as in "data and tensor
    parallel", the experts split by expert there). The n-D recipes split the batch over the outer axes as far as it
    divides and the sequence over the rest (`_batch_axes`), whether or not the batch divides; where it leaves outer axes
    over, a MoE also gets data and expert parallel with the sequence whole there, and data, tensor and expert parallel
    with the data part whole over every outer axis (each node a replica). A strategy build_plan cannot make of this
    graph (a ValueError naming the op, or experts that do not split over the devices) is no baseline either: the
    optimizer's plan stands without it. `refused` gets, per dense strategy not made, why (a 7B step on Mesh(4, 6), whose
    devices divide no weight pair and no batch, had none, unexplained)."""
    refused = {} if refused is None else refused
    if not graph.carried:
        refused["every strategy"] = "not a training step (no carried state)"
        return {}
    arguments = step_arguments(graph)
    makers = {}
    expanded = expand_linears(graph)
    hidden = tensor_parallel_seeds(expanded, mesh.size)
    if hidden:
        makers["tensor parallel"] = lambda: megatron(graph, mesh, hidden)
    else:
        refused["tensor parallel"] = f"no weight pair splits evenly over the mesh's {mesh.size} devices"
    if mesh.ndim >= 2 and arguments:
        inner = tensor_parallel_seeds(expanded, mesh.shape[-1])
        if inner:
            makers["data and tensor parallel"] = lambda: data_tensor_parallel(graph, mesh, arguments, inner)
        else:
            refused["data and tensor parallel"] = f"no weight pair splits evenly over the last axis ({mesh.shape[-1]})"
    sizes = {a: graph[a].shape[0] for a in arguments}
    if not arguments:
        refused["data parallel"] = "the step has no batch arguments"
    elif any(n % mesh.size for n in sizes.values()):
        makers["FSDP"] = lambda: fsdp(graph, mesh, arguments)
        for name in ("data parallel", "ZeRO-3"):
            refused[name] = f"the batch (dim 0 of {sizes}) does not split over the mesh's {mesh.size} devices"
    experts = expert_weights(graph) if arguments else {}
    if arguments and not any(n % mesh.size for n in sizes.values()):
        makers["data parallel"] = lambda: data_parallel(graph, mesh, arguments)
        makers["ZeRO-3"] = lambda: zero3(graph, mesh, arguments)
        if experts:
            makers["expert parallel"] = lambda: expert_parallel(graph, mesh, arguments, experts)
    if experts and mesh.ndim >= 2:  # the batch split over the outer axes where it divides, else replicated there
        makers["data and expert parallel"] = lambda: data_expert_parallel(graph, mesh, arguments, {}, experts)
        if _batch_axes(graph, mesh, arguments, _outer_axes(mesh))[1]:  # Mixtral on 8x8x8: 57.4 ms, the split 67.4
            makers["data and expert parallel, sequence whole"] = lambda: data_expert_parallel(
                graph, mesh, arguments, {}, experts, split_sequence=False)
        dense = dense_seeds(expanded, mesh.shape[-1], experts)
        if dense:
            makers["data, tensor and expert parallel"] = lambda: data_expert_parallel(graph, mesh, arguments,
                                                                                      dense, experts)
            if _batch_axes(graph, mesh, arguments, _outer_axes(mesh))[1]:  # Mixtral on 8x8x8: 52.1 ms
                makers["data, tensor and expert parallel, outer whole"] = lambda: data_expert_parallel(
                    graph, mesh, arguments, dense, experts, split_sequence=False, split_batch=False)
    found = {}
    for name, make in makers.items():
        try:
            found[name] = make()
        except ValueError as err:
            refused[name] = str(err).splitlines()[0]
    return found


def megatron(graph: Graph, mesh: Mesh, hidden: Seeds) -> Plan:
    """Tensor parallel over the graph with linears expanded (so a row-parallel contraction can split):
    `hidden` names each weight's dim to split (column-parallel weights on their output dim, row-parallel ones
    on their input dim); each weight's optimizer state is split like it. Where no op splits (no weight named, or
    none dividing among the devices) it is refused (ValueError), not priced as the all-replicated plan."""
    expanded = expand_linears(graph)
    splits = propagated_splits(expanded, mesh.size, [_with_state(graph, hidden)])
    if not splits:
        raise ValueError(f"tensor parallel: none of the {len(hidden)} weights given splits an op over the mesh's "
                         f"{mesh.size} devices; every op would run replicated")
    return steady(_split_every_axis(expanded, mesh, splits))


def data_tensor_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str], hidden: Seeds) -> Plan:
    """The usual n-D recipe: data parallel over the mesh's outer axes jointly (all but the last) and Megatron
    tensor parallel over the last (a node); an op both split on one index dim splits it over both, linears
    expanded as `megatron` does. The batch splits over the outer axes as far as it divides (`_batch_axes`), the
    sequence over the rest, so the weight gradients stay partial over every outer axis (`_summed_over_every_axis`).
    Where no weight splits an op over the last axis it is refused (ValueError), not data parallel under this name."""
    expanded = expand_linears(graph)
    batch_axes, data, sequence = _data_splits(expanded, mesh, arguments)
    tensor = propagated_splits(expanded, mesh.shape[-1], [_with_state(graph, hidden)])
    if not tensor:
        raise ValueError(f"data and tensor parallel: none of the {len(hidden)} weights given splits an op over the "
                         f"mesh's last axis ({mesh.shape[-1]} devices); it would be data parallel over the others")
    axes = {op.name: _summed_over_every_axis(expanded.signature(op.name), mesh, _per_axis(
        mesh, batch_axes, data.get(op.name), sequence.get(op.name)) + (tensor.get(op.name),)) for op in expanded.ops}
    return steady(build_plan(expanded, mesh, axes))


def expert_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str], experts: Seeds) -> Plan:
    """Data and expert parallel over every device (Switch, DeepSpeed-MoE), the mesh's axes taken as one: the batch
    split over every device, each MoE's experts (`experts` names each expert weight's expert dim) and their
    optimizer state split by expert; the experts' grouped mms and weight gradients exchange rows by all-to-all
    over the whole mesh (routed by block: each device's row block of every block, its batch block traded for them
    before and back after), and so do batch-wide routing's dispatch and combine (take_rows; takes of a table's rows
    made take_rows); everything else data parallel."""
    _check_experts(graph, experts, mesh.size)
    graph = take_rows_of(graph)
    splits = propagated_splits(graph, mesh.size, [batch_seeds(graph, arguments), _with_state(graph, experts)],
                               EXPERTS | ROUTES)
    every_axis = tuple(range(mesh.ndim))
    partitions = {op: make_partition(graph.signature(op), mesh, (None,) * mesh.ndim, exchange=every_axis)
                  for op, dim in splits.items() if dim == EXCHANGE}
    axes = {op: (dim,) * mesh.ndim for op, dim in splits.items() if dim != EXCHANGE}
    return steady(build_plan(graph, mesh, axes, partitions))


def data_expert_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str], hidden: Seeds, experts: Seeds,
                         split_sequence: bool = True, split_batch: bool = True) -> Plan:
    """The MoE recipe on an n-D mesh: data parallel over the outer axes jointly (all but the last), and over
    the last (a node) Megatron tensor parallel for attention and dense linears (`hidden`, as `data_tensor_parallel`)
    and expert parallel for the experts (`experts`: each expert weight's expert dim), their grouped mms and weight
    gradients exchanging rows within the node. Routed by block, the experts' steps split over the data axes by the
    batch's blocks, as data; routed batch-wide, the tokens' dispatch and combine (take_rows) exchange across the
    data axes, between the data groups' tokens and the rows sorted by expert, which the experts' steps split there
    as data. Either way the weight gradients are partial over the data axes, summed across the data groups as data
    parallel's are. Outer axes the batch does not divide over split the sequence, or with `split_sequence` False
    run it whole; with `split_batch` False every outer axis runs the data part whole (each node a replica)."""
    _check_experts(graph, experts, mesh.shape[-1])
    last = mesh.ndim - 1
    expanded = take_rows_of(expand_linears(graph))
    batch_axes, data, sequence = _data_splits(expanded, mesh, arguments, ROUTES, split_sequence, split_batch)
    model = propagated_splits(expanded, mesh.shape[-1], [_with_state(graph, {**hidden, **experts})], EXPERTS)
    axes, partitions = {}, {}
    for op in expanded.ops:
        sig, first, second = expanded.signature(op.name), data.get(op.name), model.get(op.name)
        if EXCHANGE in (first, second):
            over_data = first == EXCHANGE
            other = second if over_data else first
            expert_dim = sig.dims.index(sig.kernel.exchange.experts)
            refused = {expert_dim, *sig.dims_of(DimKind.REDUCTION)}
            summed = set(sig.dims_of(DimKind.REDUCTION))
            if not returns(sig):  # rows (and blocks) summed: split on an axis the exchange is not over, partial
                summed |= _moving(sig) - {expert_dim}
                if not over_data:  # they may split as data on the outer axes
                    refused -= _moving(sig) - {expert_dim}
            choice = other if other not in refused and other != EXCHANGE else None
            along = sequence.get(op.name) if sequence.get(op.name) not in refused else None
            exchange = tuple(batch_axes) if over_data else (last,)
            chosen = _per_axis(mesh, batch_axes, None if over_data else choice, along) + (
                choice if over_data else None,)
            chosen = _summed_over_every_axis(sig, mesh, chosen, summed, exchange)
            partitions[op.name] = make_partition(sig, mesh, chosen, exchange=exchange)
        else:
            axes[op.name] = _summed_over_every_axis(sig, mesh, _per_axis(mesh, batch_axes, first, sequence.get(
                op.name)) + (second,))
    return steady(build_plan(expanded, mesh, axes, partitions))


def expert_group_mesh(mesh: Mesh, experts: int) -> Mesh | None:
    """The same devices, in the same order, as a mesh whose last axis is the largest group of a node (`mesh`'s last
    axis) whose size divides `experts`, the rest of the node an axis before it: Qwen2-MoE's 60 experts on 8x8 give
    Mesh(8, 2, 4) (expert parallel over 4 devices of each node, data parallel over 16 groups), 4 experts on Mesh(8)
    give Mesh(2, 4). None where the node's size divides the experts (the n-D recipes split them over it) or no group
    of 2 or more does."""
    node = mesh.shape[-1]
    group = math.gcd(experts, node)
    return None if group in (1, node) else Mesh(*mesh.shape[:-1], node // group, group)


def expert_group_parallel(graph: Graph, mesh: Mesh, arguments: Sequence[str], experts: Seeds, tensor: bool = False,
                          weights: Collection[str] | None = None) -> Plan:
    """Data and expert parallel where a node's devices do not divide the experts: `data_expert_parallel` on
    `expert_group_mesh` (the experts split over the largest group of a node that divides them, all-to-all within
    it; the batch over the other axes as far as it divides, the sequence over the rest); with `tensor`, attention and
    dense layers tensor parallel over the group too (DP x (TP + EP), their weights found among `weights` as
    `dense_seeds` does). The plan's mesh is that one, not `mesh`: the same devices, but a partition splits experts
    over a whole mesh axis only, so the optimizer's e-graph on `mesh` cannot hold it (priced beside its plans:
    benchmarks/cluster.py's "DPxEP group" and "DPx(TP+EP) group")."""
    counts = {graph[name].shape[dim] for name, dim in experts.items()}
    grouped = expert_group_mesh(mesh, math.gcd(*counts)) if counts else None
    if grouped is None:
        raise ValueError(f"expert parallel in groups: the {sorted(counts)} experts split over no group of 2 or more "
                         f"of a node's {mesh.shape[-1]} devices smaller than the node")
    dense = dense_seeds(expand_linears(graph), grouped.shape[-1], experts, weights) if tensor else {}
    if tensor and not dense:
        raise ValueError(f"expert parallel in groups: no attention or dense weight splits over groups of "
                         f"{grouped.shape[-1]} devices")
    return data_expert_parallel(graph, grouped, arguments, dense, experts)


def dense_seeds(expanded: Graph, parts: int, experts: Seeds, weights: Collection[str] | None = None) -> Seeds:
    """Megatron's splits (`tensor_parallel_seeds` of `weights`, default the carried tensors) of a MoE's attention
    and dense layers over `parts` devices, in its graph with linears expanded: every weight but the experts' and
    their optimizer state."""
    expert_state = _with_state(expanded, experts)
    return {w: d for w, d in tensor_parallel_seeds(expanded, parts, weights).items() if w not in expert_state}


def _outer_axes(mesh: Mesh) -> tuple[int, ...]:
    """The axes the n-D recipes split the batch over jointly: all but the last, which they give to tensor or expert
    parallelism (a node)."""
    if mesh.ndim < 2:
        raise ValueError(f"the n-D recipes plan meshes of 2 or more axes; got {mesh.shape}")
    return tuple(range(mesh.ndim - 1))


def _check_experts(graph: Graph, experts: Seeds, parts: int) -> None:
    """Expert parallel over `parts` devices needs experts to split: some expert weight, each of whose experts
    divide among them."""
    if not experts:
        raise ValueError("expert parallel needs the expert weights (and their expert dims); none were given")
    for name, dim in experts.items():
        if graph[name].shape[dim] % parts:
            raise ValueError(f"expert weight {name!r} has {graph[name].shape[dim]} experts (dim {dim}), which do "
                             f"not split evenly over {parts} devices")


def _per_axis(mesh: Mesh, batch_axes: Sequence[int], data: int | str | None, sequence: int | str | None
              ) -> tuple[int | str | None, ...]:
    """An op's splits over the outer axes under an n-D recipe: `data` over the batch's axes, `sequence` over the
    others."""
    return tuple(data if axis in batch_axes else sequence for axis in _outer_axes(mesh))


def _with_state(graph: Graph, hidden: Seeds) -> Seeds:
    """`hidden`, plus each weight's optimizer state split like the weight."""
    seeds = dict(hidden)
    for weight, dim in hidden.items():
        seeds.update({state_name(slot, weight): dim for slot in ADAM_SLOTS if state_name(slot, weight) in graph})
    return seeds


def split_backward(graph: Graph, splits: Mapping[str, int | str], parts: int,
                   whole: frozenset[str] = frozenset()) -> dict[str, int]:
    """Per op that `splits` (`propagated_splits`') leaves whole, other than those in `whole`, where an op split `parts`
    ways reads its result along a split dim, the index dim that result dim maps from, if splittable, dividing and no sum
    (readers first, so chains of them split): what no split of the batch or state reached but a split reader asks of it,
    as Adam's squares of a gradient summed over the batch, made where the state they update is."""
    users = graph.users()
    chosen = dict(splits)
    found: dict[str, int] = {}
    for node in reversed(graph.ops):
        if node.name in chosen or node.name in whole:
            continue
        sig = graph.signature(node.name)
        for user in users[node.name]:
            if user not in chosen or not isinstance(chosen[user], int):
                continue
            usig, unode = graph.signature(user), graph[user]
            dims = [t for k, arg in enumerate(unode.args) if arg == node.name
                    for t, row in enumerate(usig.projections[k].matrix) if row[chosen[user]]]
            index = [i for t in dims[:1] for i, c in enumerate(sig.output.matrix[t]) if c
                     and i in sig.splittable and sig.spec.sizes[i] % parts == 0]
            if index and index[0] not in sig.dims_of(DimKind.REDUCTION):
                chosen[node.name] = found[node.name] = index[0]
                break
    return found
