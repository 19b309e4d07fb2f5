"""Exact checks that a plan computes what its graph means, with islpy as the oracle.

A plan that passes can be run step by step on every device without any device
reading a cell it does not hold, and every step's recorded layout is the one its
inputs and blocks actually produce. Cost models and lowering rely on both.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools

import numpy as np

from tapestry import zspace
from tapestry.dtypes import DtypeError
from tapestry.kernels import DimKind, KernelError, Shape, Signature
from tapestry.plan import ring
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Block, Layout, Mesh
from tapestry.sharding.comm import CommError, can_move, transfers
from tapestry.sharding.layout import ValueNumbers
from tapestry.sharding.partition import Partition, exchanged_blocks, output_layout, partition_issues
from tapestry.zspace import IndexProjection, ZRange


class PlanError(ValueError):
    """An invalid plan; the message lists every problem found."""


def validate_plan(plan: Plan) -> None:
    problems = plan_problems(plan)
    if problems:
        raise PlanError(f"invalid plan ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))


def validate_loaded(plan: Plan, source: str, meaning: bool = True) -> None:
    """Check a plan read from a file before explaining or running it: an edited plan fails here, naming each
    step at fault, instead of with a KeyError deep inside; then, with `meaning`, its meaning against its graph
    (verify.meaning_check: simulated whole when small, sampled output lines when large), so a step edited to compute
    something else is refused too (a plan cache entry skips it: optimize checked it before saving it). The checks
    need islpy; where it is missing (a node that only runs plans) they are skipped and lowering's own checks
    remain."""
    try:
        if importlib.util.find_spec("islpy") is None:
            return
    except ImportError:
        return
    problems = plan_problems(plan)
    if problems:
        raise PlanError(f"{source}: invalid plan ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))
    if not meaning:
        return
    from tapestry.verify import PlanMeaningError, meaning_check  # verify builds on this module

    try:  # a valid plan may still compute something else: a kernel edited into another (linear_relu -> linear_gelu)
        meaning_check(plan)
    except PlanMeaningError as err:
        raise PlanError(f"{source}: {err}") from None


def plan_problems(plan: Plan) -> list[str]:
    """Every problem, each naming the step (and kernel and device) at fault; empty when valid."""
    problems: list[str] = []
    defined: dict[str, Step] = {}
    value_dtypes: dict[str, str] = {}
    clean: set[tuple] = set()  # the keys (`_computed`, `_moved`) of the steps found valid (`_step_problems`)
    number = ValueNumbers()  # layouts compared by number: a deep plan names few layout objects, many times
    for step in plan.steps:
        where = _where(step)
        if step.out in defined:
            problems.append(f"{where}: value {step.out!r} is defined twice")
        problems += [f"{where}: {p}" for p in _step_problems(plan, step, defined, clean, number)]
        problems += [f"{where}: {p}" for p in _dtype_problems(plan, step, value_dtypes)]
        defined[step.out] = step
    problems += _output_problems(plan, defined)
    for name, value in plan.outputs.items():
        target = plan.graph.outputs.get(name)
        if target is not None and value in value_dtypes and value_dtypes[value] != plan.graph[target].dtype:
            problems.append(f"output {name!r} ({value}) is {value_dtypes[value]}, but the graph's is "
                            f"{plan.graph[target].dtype}")
    return problems


def _dtype_problems(plan: Plan, step: Step, value_dtypes: dict[str, str]) -> list[str]:
    """Each value's dtype follows from the inputs and kernels (Plan.dtypes); a step that says otherwise (a kernel
    reading an argument as another dtype, a reshard pricing another) was edited. Records the step's own dtype."""
    problems = []
    if isinstance(step, Place):
        if step.input in plan.graph:
            value_dtypes[step.out] = plan.graph[step.input].dtype
    elif isinstance(step, Reshard):
        if step.src in value_dtypes:
            value_dtypes[step.out] = value_dtypes[step.src]
            if step.dtype != value_dtypes[step.src]:
                problems.append(f"says its source {step.src!r} is {step.dtype}, but it is {value_dtypes[step.src]}")
    else:
        try:
            sig = step.signature
        except (KernelError, DtypeError):
            return []  # _compute_problems reports it
        for i, (arg, dtype) in enumerate(zip(step.args, sig.input_dtypes)):
            if arg in value_dtypes and value_dtypes[arg] != dtype:
                problems.append(f"arg {i} ({sig.kernel.inputs[i]}) {arg!r} is {value_dtypes[arg]}, but the step "
                                f"reads it as {dtype}")
        value_dtypes[step.out] = sig.dtype
    return problems


def _where(step: Step) -> str:
    if isinstance(step, Compute):
        return f"step {step.out} (compute {step.kernel})"
    return f"step {step.out} ({type(step).__name__.lower()})"


def _step_problems(plan: Plan, step: Step, defined: dict[str, Step], clean: set[tuple],
                   number: ValueNumbers) -> list[str]:
    """The step's problems. A Compute or Reshard step whose key (`_computed`, `_moved`) was found valid already
    (`clean`: each later copy of an expanded plan's layer runs the step of copy 1, under other names) has only its
    sources left to check: whatever else `_compute_problems` or `_reshard_problems` checks is a function of that
    key."""
    if isinstance(step, Place):
        return _place_problems(plan, step)
    if isinstance(step, Reshard):
        return _reshard_problems(plan.mesh, step, defined, clean, number)
    binding = step.numbered_binding(number)
    alias = binding, id(step.blocks)  # an expanded plan's copies share blocks: no 512 blocks hashed again
    if alias in clean:
        return _sources_problems(step, defined, number)
    key = _computed(step, binding)
    if key in clean:
        clean.add(alias)
        return _sources_problems(step, defined, number)
    problems = _compute_problems(plan.mesh, step, defined, number)
    if not problems:
        clean.update((key, alias))
    return problems


def _sources_problems(step: Compute, defined: dict[str, Step], number: ValueNumbers) -> list[str]:
    """What is left to check of a Compute step alike to one found valid: the values it reads, by name."""
    return [problem for i, (arg, layout, shape) in enumerate(zip(step.args, step.arg_layouts, step.input_shapes))
            for problem in _source_problems(arg, shape, layout, defined, _arg_what(step.signature, i), number)]


def _computed(step: Compute, binding: tuple) -> tuple:
    """What `_compute_problems` judges of a step but its sources (the values it reads, by name): its kernel
    binding (`Compute.numbered_binding`), blocks and layouts (the mesh is the plan's)."""
    return binding, step.blocks


def _arg_what(sig: Signature, i: int) -> str:
    """How a problem names a step's argument i."""
    return f"arg {i} ({sig.kernel.inputs[i]})"


def layout_problems(layout: Layout, shape: Shape, mesh: Mesh, what: str = "layout") -> list[str]:
    """A layout must give one block per device, each inside the tensor."""
    if len(layout.blocks) != mesh.size:
        return [f"{what} has {len(layout.blocks)} blocks for {mesh.size} devices"]
    return [f"{what}: device {k} holds {layout.blocks[k]}, outside the tensor {ZRange.from_shape(shape)}"
            for k in _outside(layout, shape)]


@functools.lru_cache(maxsize=1 << 12)  # a layout's hash is kept: asked again of each Place and Reshard alike
def _outside(layout: Layout, shape: Shape) -> tuple[int, ...]:
    """The devices whose block of `layout` lies outside a tensor of `shape`."""
    whole = ZRange.from_shape(shape)
    outside = {b for b in set(layout.blocks)  # each distinct block once: 64 devices hold a few
               if b is not None and (b.ndim != whole.ndim or not whole.contains(b))}
    return tuple(k for k, b in enumerate(layout.blocks) if b in outside) if outside else ()


def _place_problems(plan: Plan, step: Place) -> list[str]:
    if step.input not in plan.graph or not plan.graph[step.input].is_input:
        return [f"places {step.input!r}, which is not an input of the graph"]
    problems = layout_problems(step.layout, step.shape, plan.mesh)
    if step.shape != plan.graph[step.input].shape:
        problems.append(f"shape {list(step.shape)} differs from input {step.input!r}'s "
                        f"{list(plan.graph[step.input].shape)}")
    if step.layout.partial:
        problems.append("an input cannot be placed partial")
    return problems


def _shape(step: Step) -> Shape | None:
    """None when a Compute's kernel does not bind: that step reports it, later ones need not."""
    try:
        return step.shape
    except (KernelError, DtypeError):
        return None


def _source_problems(value: str, shape: Shape, layout: Layout, defined: dict[str, Step], what: str,
                     number: ValueNumbers) -> list[str]:
    """`value` must be defined earlier, with the shape and layout the step says it has (layouts compared by
    `number`)."""
    if value not in defined:
        return [f"{what} refers to {value!r}, which no earlier step defines"]
    source, source_shape = defined[value], _shape(defined[value])
    problems = []
    if source_shape is not None and source_shape != shape:
        problems.append(f"{what} {value!r} has shape {list(source_shape)}, but the step says {list(shape)}")
    if number(source.layout) != number(layout):
        problems.append(f"{what} {value!r} is laid out {source.layout}, but the step says {layout}")
    return problems


def _moved(step: Reshard, number: ValueNumbers) -> tuple:
    """What `_reshard_problems` judges of a reshard but its source (by name): its shape and both layouts (by
    number; the mesh is the plan's)."""
    return "reshard", step.shape, number(step.src_layout), number(step.layout)


def _reshard_problems(mesh: Mesh, step: Reshard, defined: dict[str, Step], clean: set[tuple],
                      number: ValueNumbers) -> list[str]:
    problems = _source_problems(step.src, step.shape, step.src_layout, defined, "source", number)
    key = _moved(step, number)
    if key in clean:
        return problems
    problems += layout_problems(step.layout, step.shape, mesh)
    if not problems and not can_move(step.src_layout, step.layout):  # transfers says why (64 devices: slow)
        try:
            transfers(step.src_layout, step.layout)
        except CommError as err:
            problems.append(f"impossible move: {err}")
    if not problems:
        clean.add(key)
    return problems


def _compute_problems(mesh: Mesh, step: Compute, defined: dict[str, Step], number: ValueNumbers) -> list[str]:
    try:
        sig = step.signature
    except (KernelError, DtypeError) as err:
        return [str(err)]
    if not len(step.args) == len(step.arg_layouts) == len(sig.projections):
        return [f"{len(step.args)} args and {len(step.arg_layouts)} arg layouts for {len(sig.projections)} inputs"]
    if len(step.blocks) != mesh.size:
        return [f"{len(step.blocks)} index blocks for {mesh.size} devices"]
    if any(b is not None and b.ndim != sig.index.ndim for b in set(step.blocks)):
        return [f"index blocks must have {sig.index.ndim} dims like the index space {sig.index}"]
    if step.exchange and (sig.kernel.exchange is None or not all(0 <= a < mesh.ndim for a in step.exchange)):
        return [f"exchange over mesh axes {list(step.exchange)}, but {sig.kernel.name} has no exchange dims "
                f"or the mesh {list(mesh.shape)} lacks those axes"]
    if step.exchange_group and (len(step.exchange) != 1 or not 1 < step.exchange_group < mesh.shape[step.exchange[0]]
                                or mesh.shape[step.exchange[0]] % step.exchange_group):
        return [f"exchange in groups of {step.exchange_group} devices over mesh axes {list(step.exchange)}: the "
                f"group must divide one axis of the mesh {list(mesh.shape)}, and be smaller"]
    if step.ring and (sig.kernel.ring is None or not all(0 <= a < mesh.ndim for a in step.ring)):
        return [f"ring over mesh axes {list(step.ring)}, but {sig.kernel.name} has no ring (its keys cannot split) "
                f"or the mesh {list(mesh.shape)} lacks those axes"]
    problems = _ring_only_problems(sig, step)
    if not problems and step.ring and sig.kernel.ring.gradients:
        problems = _gradient_ring_problems(mesh, step)
    if problems:
        return problems
    covered = exchanged_blocks(sig, step.blocks, step.exchange, mesh, step.exchange_group)
    problems = [f"blocks do not partition the index space: {p}" for p in partition_issues(sig, covered)]
    problems += _layout_claim_problems(sig, step, covered)
    for i, (arg, layout, shape) in enumerate(zip(step.args, step.arg_layouts, step.input_shapes)):
        what = _arg_what(sig, i)
        problems += _source_problems(arg, shape, layout, defined, what, number)
        malformed = layout_problems(layout, shape, mesh, f"{what} layout")
        problems += malformed
        if layout.partial:
            problems.append(f"{what} {arg!r} is partial: kernels read true values")
        elif not malformed and step.ring and ring.travelling(step)[i]:
            problems += _ring_read_problems(mesh, step, i, what)
        elif not malformed:
            problems += _read_problems(sig, i, step, what)
    return problems


def _ring_only_problems(sig: Signature, step: Compute) -> list[str]:
    """A dim that splits only in a ring (`Kernel.ring_only`: the fused backward's rows, whose row block's dk and dv
    need every query) split by a step that is no ring."""
    if step.ring:
        return []
    return [f"splits {name!r} of {sig.kernel.name} without a ring; it splits only in one"
            for d, name in enumerate(sig.dims) if name in sig.kernel.ring_only
            and any(b is not None and b.shape[d] != sig.index.shape[d] for b in step.blocks)]


def _gradient_ring_problems(mesh: Mesh, step: Compute) -> list[str]:
    """A gradient ring (the fused backward's): each device's query rows are its key block (its output rows pack
    both: kernels.ring), so a ring's members' rows must cover every key."""
    sig, ring_of = step.signature, step.signature.kernel.ring
    if ring_of.rows not in sig.dims:
        return [f"ring over mesh axes {list(step.ring)}, but {sig.kernel.name} has no {ring_of.rows!r} dim"]
    rows = sig.dims.index(ring_of.rows)
    spans = [None if b is None else (b.start[rows], b.end[rows]) for b in step.blocks]
    problems = []
    for group in ring.members(step, mesh):
        held = sorted(spans[k] for k in group if spans[k] is not None)
        if len(held) < len(group) or [a for a, _ in held] != [0, *(b for _, b in held[:-1])] \
                or held[-1][1] != sig.index.shape[rows]:
            problems.append(f"ring {list(group)} holds rows {held}, not every one of the {sig.index.shape[rows]} "
                            f"keys: a gradient ring's members' rows are its key blocks")
    return problems[:3]


def _ring_read_problems(mesh: Mesh, step: Compute, arg: int, what: str) -> list[str]:
    """A travelling input of a ring step: every member's read of each member's key block must be held by that
    member, to be passed round the ring (plan.ring)."""
    keys, shape = ring.keys(step, mesh), ZRange.from_shape(step.input_shapes[arg])
    problems = []
    for group in ring.members(step, mesh):
        if any(step.blocks[k] is None for k in group):
            problems.append(f"a member of ring {list(group)} idles: every member must hold and pass its key block")
            continue
        for k in group:
            for src in group:
                need = shape.intersection(ring.reads(step, k, keys[src])[arg])
                held = step.arg_layouts[arg].blocks[src]
                if need is not None and not need.is_empty and (held is None or not held.contains(need)):
                    problems.append(f"device {k} meets {need} of {what} {step.args[arg]!r} on ring member {src}, "
                                    f"which holds only {held}")
    return problems


def _layout_claim_problems(sig: Signature, step: Compute, covered: tuple[Block, ...]) -> list[str]:
    """The output layout must be what the blocks write: their output boxes, partial where a reduction
    is split (in the blocks an exchange covers, `covered`), and never partial where replicated blocks would be
    summed twice."""
    implied = output_layout(sig, _partition(step.blocks))
    problems = []
    if step.layout.blocks != implied.blocks:
        problems.append(f"layout {Layout(step.layout.blocks)} is not what the blocks write: {implied}")
    split = _splits_reduction(sig, covered)
    if split and not step.layout.partial:
        problems.append("a reduction dim is split, so the output is partial sums, but the layout is not partial")
    distinct = {b for b in step.blocks if b is not None}
    if step.layout.partial and not split and len(distinct) < sum(b is not None for b in step.blocks):
        problems.append("the layout is partial, but replicated blocks would be summed more than once")
    return problems


def _partition(blocks: tuple[Block, ...]) -> Partition:
    """A plan keeps only the blocks; the partition's axes merely name it, and partial is judged from the blocks."""
    return Partition(blocks, axes=())


def _splits_reduction(sig: Signature, blocks: tuple[Block, ...]) -> bool:
    reductions = sig.dims_of(DimKind.REDUCTION)
    return any(b is not None and b.shape[d] != sig.index.shape[d] for b in set(blocks) for d in reductions)


def _read_problems(sig: Signature, arg: int, step: Compute, what: str) -> list[str]:
    """Each device must hold every cell of the input its index block reads (cells outside the tensor are zero).
    What it reads is islpy's image of the block under the signature's projection, not plan generation's own
    `needed_layout`: a slip there (a halo a row short) must not pass both."""
    projection, shape = sig.projections[arg], sig.input_shapes[arg]
    pairs = list(zip(step.blocks, step.arg_layouts[arg].blocks))
    distinct = [pair for pair in set(pairs) if pair[0] is not None]
    held = _surely_held(projection, shape, distinct)
    unheld = {pair: None if pair in held else _unheld_read(projection, shape, *pair) for pair in distinct}
    return [f"device {device} reads {unheld[pair]} of {what} {step.args[arg]!r} but holds only {pair[1]}"
            for device, pair in enumerate(pairs) if unheld.get(pair) is not None]


def _surely_held(projection: IndexProjection, shape: Shape, pairs: list[tuple[ZRange, Block]]
                 ) -> set[tuple[ZRange, Block]]:
    """The (block, held) pairs whose reads `held` holds for sure: the box between the least and the most cell
    the projection's map selects from the block's corners (a linear map's extremes over a box are at its
    corners), within the tensor, lies in `held`; it holds every cell the block reads. Found for all pairs at
    once, without islpy, which stays the judge of the rest: 512 devices' reads one at a time were a fifth of
    validating a plan on 8x8x8."""
    boxes = [(block, held) for block, held in pairs if held is not None and not block.is_empty]
    if not boxes:
        return set()
    matrix = np.array(projection.matrix, np.int64).reshape(projection.out_dim, projection.in_dim)
    starts = np.array([b.start for b, _ in boxes], np.int64).reshape(len(boxes), 1, projection.in_dim)
    lasts = np.array([b.end for b, _ in boxes], np.int64).reshape(len(boxes), 1, projection.in_dim) - 1
    corners = np.array(list(itertools.product((False, True), repeat=projection.in_dim)), bool)
    corners = corners.reshape(1, 2 ** projection.in_dim, projection.in_dim)
    points = np.where(corners, lasts, starts)  # (boxes, corners, index dims)
    cells = points @ matrix.T + np.array(projection.offset, np.int64)  # each corner's first selected cell
    low = np.maximum(cells.min(axis=1), 0)
    high = np.minimum(cells.max(axis=1) + np.array(projection.shape, np.int64), np.array(shape, np.int64))
    held_starts = np.array([h.start for _, h in boxes], np.int64).reshape(len(boxes), projection.out_dim)
    held_ends = np.array([h.end for _, h in boxes], np.int64).reshape(len(boxes), projection.out_dim)
    nothing = (low >= high).any(axis=1)
    inside = ((held_starts <= low) & (high <= held_ends)).all(axis=1)
    return {pair for pair, ok in zip(boxes, (nothing | inside).tolist()) if ok}


@functools.lru_cache(maxsize=1 << 16)  # identical layers, and devices of a replicated axis, ask the same
def _unheld_read(projection: IndexProjection, shape: Shape, block: ZRange, held: Block) -> ZRange | None:
    """The bounding box of what `block` reads of a tensor of `shape` through `projection`, if `held` does not hold
    all of it (islpy's image); None when it does."""
    reads = zspace.footprint(projection, block).intersect(zspace.to_isl_set(ZRange.from_shape(shape)))
    if reads.is_empty() or (held is not None and reads.is_subset(zspace.to_isl_set(held))):
        return None
    return zspace.bounding_box(reads)


def _output_problems(plan: Plan, defined: dict[str, Step]) -> list[str]:
    problems = []
    if set(plan.outputs) != set(plan.graph.outputs):
        problems.append(f"plan outputs {sorted(plan.outputs)} differ from the graph's {sorted(plan.graph.outputs)}")
    for name, value in plan.outputs.items():
        if value not in defined:
            problems.append(f"output {name!r} refers to {value!r}, which no step defines")
            continue
        step, shape = defined[value], _shape(defined[value])
        if shape is None:
            continue
        where = f"output {name!r} ({_where(step)})"
        if step.layout.partial:
            problems.append(f"{where} is partial: reduce it before returning it")
        held = [b for b in step.layout.blocks if b is not None]
        if not layout_problems(step.layout, shape, plan.mesh) and not zspace.covers(held, ZRange.from_shape(shape)):
            problems.append(f"{where}: the devices together do not hold the whole tensor")
        target = plan.graph.outputs.get(name)
        if target is not None and plan.graph[target].shape != shape:
            problems.append(f"{where} has shape {list(shape)}, but the graph's is {list(plan.graph[target].shape)}")
    return problems
