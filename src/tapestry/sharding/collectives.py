"""Which collective a layout change is, and among which devices, so explanations, lowering and cost models agree.

A reshard is always executable as the block moves of `sharding.comm.transfers`;
the collective names the cheaper library call that does the same thing when
the layouts are the regular families (R, S(...), P). On a mesh of more than one
axis, a reshard often needs only some axes (gathering the columns of each row):
it then runs as one collective per group of devices along those axes, each group
on its own, as DTensor does, and as the cost model prices it.
"""
from __future__ import annotations

import enum
import itertools
import math
import operator
from dataclasses import dataclass
from functools import lru_cache

from tapestry.kernels import Shape
from tapestry.sharding.comm import box_difference, overlap, transfers
from tapestry.sharding.layout import Layout
from tapestry.sharding.mesh import Mesh
from tapestry.zspace import ZRange


class Collective(enum.StrEnum):
    NOOP = "noop"  # every device already holds what it needs (possibly after slicing locally)
    ALL_GATHER = "all_gather"  # devices keep their blocks and collect the others'
    ALL_REDUCE = "all_reduce"  # partial -> replicated
    REDUCE_SCATTER = "reduce_scatter"  # partial -> split
    ALL_TO_ALL = "all_to_all"  # split one way -> split another way
    SEND_RECV = "send_recv"  # anything else: point-to-point block moves


@dataclass(frozen=True)
class Group:
    """Devices that reshard among themselves: their ranks (ascending), their source and destination blocks
    (in that order), the mesh axes they span, and the collective that moves their blocks."""

    ranks: tuple[int, ...]
    src: Layout
    dst: Layout
    axes: tuple[int, ...]
    kind: Collective


@lru_cache(maxsize=4096)
def reshard_groups(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> tuple[Group, ...]:
    """The reshard as independent collectives: the groups of devices along the fewest mesh axes (fewest devices per
    group) in which every device finds the cells it needs, and for partial sums every partial of its cells, within
    its own group. A 1-D mesh, or a change that needs every axis, is one group: the whole mesh."""
    every = tuple(range(mesh.ndim))
    subsets = [a for n in range(mesh.ndim) for a in itertools.combinations(every, n)]
    for axes in sorted(subsets, key=lambda a: math.prod(mesh.shape[i] for i in a)):
        fibres = _fibres(mesh, axes)
        if all(_self_sufficient(src, dst, ranks) for ranks in fibres):
            return tuple(_group(src, dst, mesh, axes, ranks) for ranks in fibres)
    return (_group(src, dst, mesh, every, tuple(mesh.devices)),)


def classify_reshard(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    """The collective that turns `src` into `dst` (raises CommError when no moves can): its groups' collective,
    or send_recv if the groups differ."""
    kinds = {g.kind for g in reshard_groups(src, dst, shape, mesh)} - {Collective.NOOP}
    return kinds.pop() if len(kinds) == 1 else Collective.SEND_RECV if kinds else Collective.NOOP


def _self_sufficient(src: Layout, dst: Layout, ranks: tuple[int, ...]) -> bool:
    members = set(ranks)
    for rank in ranks:
        need = dst.blocks[rank]
        if need is None:
            continue
        if src.partial:
            if any(k not in members and overlap(held, need) is not None for k, held in enumerate(src.blocks)):
                return False
            continue
        held = [b for b in (src.blocks[k] for k in ranks) if b is not None]
        if any(h.contains(need) for h in held):
            continue
        missing = [need]
        for h in held:
            missing = [piece for m in missing for piece in box_difference(m, h)]
        if missing:
            return False
    return True


@lru_cache(maxsize=256)
def _fibres(mesh: Mesh, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    return mesh.fibres(axes)


@lru_cache(maxsize=1 << 14)
def local_layouts(src: Layout, dst: Layout) -> tuple[Layout, Layout, Shape] | None:
    """A group's layouts relative to the box their blocks span, and that box's shape (None if it holds nothing):
    groups that are translations of one another are one collective, and one entry in transfers' cache."""
    held = [b for layout in (src, dst) for b in layout.blocks if b is not None]
    if not held:
        return None
    box = ZRange.bounding(held)
    origin = box.start

    def shifted(b: ZRange | None) -> ZRange | None:
        return None if b is None else ZRange._checked(tuple(map(operator.sub, b.start, origin)),
                                                      tuple(map(operator.sub, b.end, origin)))

    src_local, dst_local = (Layout(tuple(map(shifted, layout.blocks)), layout.partial) for layout in (src, dst))
    return src_local, dst_local, box.shape


def _group(src: Layout, dst: Layout, mesh: Mesh, axes: tuple[int, ...], ranks: tuple[int, ...]) -> Group:
    """Named as a collective on its own: blocks relative to the box the group's blocks span, on its own mesh."""
    mine = Layout(tuple(src.blocks[r] for r in ranks), src.partial), Layout(tuple(dst.blocks[r] for r in ranks))
    local = local_layouts(*mine)
    if local is None:
        return Group(ranks, *mine, axes, Collective.NOOP)
    kind = _classify(*local, Mesh(*(mesh.shape[a] for a in axes)) if axes else Mesh(1))
    return Group(ranks, *mine, axes, kind)


def _classify(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    if not transfers(src, dst):
        return Collective.NOOP
    target = _family(dst, shape, mesh)
    if src.partial:
        return {"R": Collective.ALL_REDUCE, "S": Collective.REDUCE_SCATTER}.get(target, Collective.SEND_RECV)
    if target == "R":
        return Collective.ALL_GATHER
    if target == "S" and _family(src, shape, mesh) == "S":
        return Collective.ALL_GATHER if _keeps_own_blocks(src, dst) else Collective.ALL_TO_ALL
    return Collective.SEND_RECV


def _family(layout: Layout, shape: Shape, mesh: Mesh) -> str:
    """'R', 'S' or 'blocks' for the plain blocks of `layout`."""
    name = Layout(layout.blocks).name(shape, mesh)
    return "S" if name.startswith("S(") else name


def _keeps_own_blocks(src: Layout, dst: Layout) -> bool:
    return all(s is None or (d is not None and d.contains(s)) for s, d in zip(src.blocks, dst.blocks))
