"""Chains of memory-bound elementwise kernels priced as the one kernel inductor makes of them.

The roofline prices every plan step as its own kernel: an elementwise op reads its inputs from memory and
writes its result back. But a rank's program is compiled whole by inductor (spmd.trace), which fuses pointwise,
broadcast and reduction loops that meet on one device into one generated kernel: an intermediate read only by
such neighbours stays in registers. RMSNorm, SiLU times up, the residual adds and the dtype casts of a LLaMA
block, and their gradients, are such chains; priced op by op they took 35% of one 7B block's training step.

A fusion group: the per-run Compute steps of FUSIBLE kernels joined wherever one reads another's value directly
and both lie after as many unfusible steps (its epoch: the most matmuls, attention kernels or Reshards on a path
from the inputs), so a group is one kernel in program order: no member waits, through a step outside the group,
for another (a forward value a backward elementwise op reads is written in between, as a kernel must). A
Reshard between two steps breaks the group (the value must be in memory to be moved), as does any other kernel
(a matmul or an attention kernel is a library call inductor does not fuse into). A group moves, per device:
- each value it reads from outside, once (the largest block any member reads of it);
- each value it makes that anything outside the group reads, or that the plan delivers, once;
and pays one launch; its FLOPs are its members' at each one's dtype peak. The group's time, like a step's, is
its slowest device's max(FLOPs / peak, bytes / bandwidth) + launch, stretched by oversubscription; it never
exceeds the members' summed step costs, and each member is charged its share of it in proportion to its own
step cost, so per-step costs still sum to the plan's time exactly.

Extraction cannot see groups (a node's neighbours are chosen with it), so it prices a fusible e-node as a group
member by what its own e-graph neighbourhood promises (`member_time`, `write_time`; egraph/fused_prices.py):
its reads of values some fusible kernel makes in the same layout are free, its own write goes to whatever reads
its value from outside (a reshard, a matmul, the output), and only a member none of whose inputs is so made
pays the launch. An estimate, not a bound; the plan kept is priced by `fused_costs` (docs/cost-models.md).

What is not modelled: inductor splitting a group into several kernels (a reduction feeding a pointwise op of
another shape: two loops, an input read twice), and the backward recomputing a forward intermediate instead of
saving it (AOTAutograd's min-cut): both are cheap next to the bytes a group saves. The per-step runtime
(`run_plan`, one compiled kernel per step) fuses nothing: `run_costs` prices its steps unfused.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tapestry import dtypes
from tapestry.components import connected_groups
from tapestry.cost.profile import DeviceProfile
from tapestry.cost.roofline import compute_dtype
from tapestry.cost.memory import layout_bytes
from tapestry.plan.plan import Compute, Place, Plan
from tapestry.sharding import Layout
from tapestry.sharding.layout import ValueNumbers
from tapestry.zspace import ZRange
from tapestry.zspace.affine import IndexProjection

# Kernels inductor lowers to pointwise or reduction loops (elementwise ops, reductions and row-wise maps such as
# softmax and the norms) or folds into a loop's indexing (views, slices, expands, pads), by their defining module.
FUSIBLE = frozenset({"tapestry.kernels.elementwise", "tapestry.kernels.reductions", "tapestry.kernels.shape",
                     "tapestry.kernels.views"})


def fusible(step: Compute) -> bool:
    kernel = step.signature.kernel
    return kernel.signature.__module__ in FUSIBLE and not step.exchange and not step.ring


@dataclass(frozen=True)
class Group:
    """Steps (by value, in plan order) inductor would compile into one kernel, and the values it writes."""

    members: tuple[str, ...]
    written: tuple[str, ...]  # in plan order


def footprint(projection: IndexProjection, block: ZRange) -> int:
    """Elements of the box an index block reads through `projection` (Signature.footprint_expr, numerically)."""
    extents = block.shape
    return math.prod(sum(abs(a) * (e - 1) for a, e in zip(row, extents)) + size
                     for row, size in zip(projection.matrix, projection.shape))


def fusion_groups(plan: Plan) -> list[Group]:
    """The plan's fusion groups of two or more steps (module docstring), in plan order of their first member."""
    by_id = plan.by_id
    per_run = {s.out: s for s in plan.steps if isinstance(s, Compute) and s.out not in plan.prepared and fusible(s)}
    links: list[tuple[str, str]] = []
    readers: dict[str, list[str]] = {}
    epoch: dict[str, int] = {}  # the most unfusible steps (matmuls, attention, reshards) on a path to the value
    for step in plan.steps:
        args = step.args if isinstance(step, Compute) else () if isinstance(step, Place) else (step.src,)
        for a in args:
            readers.setdefault(a, []).append(step.out)
        if step.out in plan.prepared:
            epoch[step.out] = 0  # made ahead of time: an input to every run
            continue
        epoch[step.out] = max((epoch[a] + (a not in per_run and not isinstance(by_id[a], Place)
                                           and a not in plan.prepared) for a in args), default=0)
        if step.out in per_run:
            for a in step.args:
                if a in per_run and epoch[a] == epoch[step.out]:
                    links.append((step.out, a))
    delivered = set(plan.outputs.values())
    groups = []
    for chain in connected_groups(per_run, links):
        if len(chain) < 2:
            continue
        inside = set(chain)
        escaping = [v for v in chain if v in delivered or any(r not in inside for r in readers.get(v, ()))]
        written: set[str] = set()
        for v in escaping:  # a view's value is its source's memory: the source is what is written
            while by_id[v].signature.kernel.is_view and by_id[v].args[0] in inside:
                v = by_id[v].args[0]
            if not by_id[v].signature.kernel.is_view:
                written.add(v)
        groups.append(Group(tuple(chain), tuple(v for v in chain if v in written)))
    return groups


def group_time(plan: Plan, group: Group, device: DeviceProfile) -> float:
    """Seconds of `group` as one kernel: its slowest device's roofline time plus one launch, stretched. Devices
    whose members' blocks cost alike (the same blocks, or the same shapes where a kernel's work is its shape's:
    Roofline.compute_time) are priced once."""
    by_id = plan.by_id
    inside, written = set(group.members), set(group.written)
    steps = [by_id[v] for v in group.members]
    outside = [[a not in inside for a in step.args] for step in steps]
    shaped = [step.signature.kernel.work is None for step in steps]
    alike = {tuple(None if b is None or b.is_empty else b.shape if by_shape else b
                   for b, by_shape in zip(blocks, shaped)): blocks
             for blocks in zip(*(step.blocks for step in steps))}
    slowest = 0.0
    for blocks in alike.values():
        seconds, nbytes, reads = 0.0, 0, {}
        for step, block, read in zip(steps, blocks, outside):
            if block is None or block.is_empty:
                continue
            sig = step.signature
            if not sig.kernel.is_view:
                seconds += sig.cost(block)[0] / device.peak(compute_dtype(sig))
            _add_reads(step, block, read, reads)
            if step.out in written:
                nbytes += footprint(sig.output, block) * dtypes.itemsize(sig.dtype)
        nbytes += sum(reads.values())
        if seconds or nbytes:
            slowest = max(slowest, max(seconds, nbytes / device.mem_bandwidth) + device.launch_overhead)
    return slowest * device.oversubscription(plan.mesh.size)


def group_key(plan: Plan, group: Group, number: ValueNumbers) -> tuple:
    """All `group_time` reads of `group` besides the mesh and device: per member in order, its binding (kernel,
    shapes, params and dtypes: one Signature), its blocks (as `number` numbers them: equal for equal blocks, each
    blocks object hashed once, where hashing a member's 512 blocks per group was most of pricing an expanded 70B
    plan on 8x8x8), whether the group writes it, and each argument as made inside the group or as the k-th distinct
    value read from outside (a value two members read is read once). Groups of one key take one time: a layer's
    groups in every copy of an expanded plan."""
    by_id = plan.by_id
    inside, written = set(group.members), set(group.written)
    outside: dict[str, int] = {}
    return tuple((step.kernel, step.input_shapes, step.params, step.input_dtypes, number(step.blocks), v in written,
                  tuple(-1 if a in inside else outside.setdefault(a, len(outside)) for a in step.args))
                 for v in group.members for step in (by_id[v],))


def _add_reads(step: Compute, block: ZRange, outside: Sequence[bool], reads: dict[str, int]) -> None:
    """Into `reads` (argument -> bytes), what `block` of `step` reads of each argument flagged `outside` the group:
    a value read once, at its largest footprint."""
    sig = step.signature
    for a, projection, dtype, read in zip(step.args, sig.projections, sig.input_dtypes, outside):
        if read:
            reads[a] = max(reads.get(a, 0), footprint(projection, block) * dtypes.itemsize(dtype))


def fused_costs(plan: Plan, costs: Mapping[str, float], device: DeviceProfile) -> dict[str, float]:
    """`costs` (seconds per per-run step, unfused) with each fusion group's members charged their share of the
    group's time (module docstring); steps outside groups keep their cost."""
    fused = dict(costs)
    times: dict[tuple, float] = {}  # by `group_key`: each distinct group priced once
    number = ValueNumbers()
    for group in fusion_groups(plan):
        unfused = sum(costs[v] for v in group.members)
        if unfused <= 0.0:
            continue
        key = group_key(plan, group, number)
        if key not in times:
            times[key] = group_time(plan, group, device)
        scale = min(times[key], unfused) / unfused
        for v in group.members:
            fused[v] = costs[v] * scale
    return fused


def member_time(step: Compute, device: DeviceProfile, devices: int, internal: Sequence[bool], head: bool) -> float:
    """Seconds of fusible `step` as one member of a fusion group on `devices` devices: its FLOPs, its reads of the
    arguments not `internal` (made inside the group) once each, no write (what reads the value from outside
    pays it, `write_time`), and the launch only if it is a `head` (one launch a group). Never more than the
    step alone (Roofline.step_cost)."""
    sig = step.signature
    blocks = {b for b in step.blocks if b is not None and not b.is_empty}
    if sig.kernel.work is None:  # then a block costs what its shape does: once per shape (Roofline.compute_time)
        blocks = set({b.shape: b for b in blocks}.values())
    slowest = 0.0
    for block in blocks:
        reads: dict[str, int] = {}
        _add_reads(step, block, [not inside for inside in internal], reads)
        seconds = sig.cost(block)[0] / device.peak(compute_dtype(sig))
        slowest = max(slowest, max(seconds, sum(reads.values()) / device.mem_bandwidth)
                      + (device.launch_overhead if head else 0.0))
    return slowest * device.oversubscription(devices)


def write_time(layout: Layout, dtype: str, device: DeviceProfile, devices: int) -> float:
    """Seconds the slowest device takes to write its block of a value in `layout` to memory."""
    return max(layout_bytes(layout, dtype)) / device.mem_bandwidth * device.oversubscription(devices)
