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

import numpy as np

from tapestry.kernels import Shape
from tapestry.sharding.comm import CommError, transfers
from tapestry.sharding.grid import bounds, cells
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
    subsets, together = _axis_choices(mesh)
    for axes, ok in zip(subsets, _self_sufficient(src, dst, mesh, subsets, together)):
        if ok:
            stays = _stays(src, dst)
            return tuple(_group(src, dst, mesh, axes, ranks, stays) for ranks in _fibres(mesh, axes))
    transfers(src, dst)  # some needed cell is held by no device: this raises CommError saying which
    raise CommError(f"no group of devices holds what {dst} needs from {src}")


def classify_reshard(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    """The collective that turns `src` into `dst` (raises CommError when no moves can): its groups' collective,
    or send_recv if the groups differ."""
    kinds = {g.kind for g in reshard_groups(src, dst, shape, mesh)} - {Collective.NOOP}
    return kinds.pop() if len(kinds) == 1 else Collective.SEND_RECV if kinds else Collective.NOOP


@lru_cache(maxsize=256)
def _axis_choices(mesh: Mesh) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The subsets of the mesh's axes, fewest devices per group first (all of them last), and for each a
    (devices, devices) 0/1 matrix: whether two devices share a group along those axes."""
    every = tuple(range(mesh.ndim))
    subsets = [a for n in range(mesh.ndim) for a in itertools.combinations(every, n)] + [every]
    subsets.sort(key=lambda a: math.prod(mesh.shape[i] for i in a))
    together = np.zeros((len(subsets), mesh.size, mesh.size), dtype=np.int64)
    for s, axes in enumerate(subsets):
        for ranks in _fibres(mesh, axes):
            together[s][np.ix_(ranks, ranks)] = 1
    return subsets, together


def _self_sufficient(src: Layout, dst: Layout, mesh: Mesh, subsets: list[tuple[int, ...]],
                     together: np.ndarray) -> np.ndarray:
    """For each grouping (`_axis_choices`: a subset of axes and its matrix), whether every group holds all its
    devices need: each cell of a device's block is held by some device of its group, or, from partial sums, by
    none outside it (so the group's sum is the whole sum). An empty block needs no cell (transfers refuses one
    for a device that holds nothing, in any group).

    Decided for every grouping at once: from `_sharing` for partial sums, else on the grid of cells the blocks'
    bounds cut the tensor into, what a group holds being its devices' cells together (an `any` along the
    grouping's mesh axes: devices x cells work, where a product with the devices x devices matrix took most of
    pricing on 64 devices)."""
    if src.partial:
        return ~((together == 0) & _sharing(src, dst)).any(axis=(1, 2))
    has, needs = cells(src, dst)
    has, needs = has.astype(bool).reshape(*mesh.shape, -1), needs.reshape(*mesh.shape, -1)
    return np.array([(has.any(axis=axes, keepdims=True) | ~needs).all() for axes in subsets])


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
    origin = tuple(map(min, *(b.start for b in held))) if len(held) > 1 else held[0].start
    shape = tuple(map(operator.sub, map(max, *(b.end for b in held)) if len(held) > 1 else held[0].end, origin))
    if not any(origin):  # already relative to the box
        return src, dst, shape

    def shifted(b: ZRange | None) -> ZRange | None:
        return None if b is None else ZRange._checked(tuple(map(operator.sub, b.start, origin)),
                                                      tuple(map(operator.sub, b.end, origin)))

    src_local, dst_local = (Layout(tuple(map(shifted, layout.blocks)), layout.partial) for layout in (src, dst))
    return src_local, dst_local, shape


def _group(src: Layout, dst: Layout, mesh: Mesh, axes: tuple[int, ...], ranks: tuple[int, ...],
           stays: list[int] | None) -> Group:
    """Named as a collective on its own: blocks relative to the box the group's blocks span, on its own mesh.
    Block moves are planned only where `_stays` cannot tell whether any are needed (a move transfers refuses),
    so naming a collective never plans them."""
    mine = Layout(tuple(src.blocks[r] for r in ranks), src.partial), Layout(tuple(dst.blocks[r] for r in ranks))
    here = None if stays is None else [stays[r] for r in ranks]
    if here is not None and min(here) >= 0:
        moving = not all(here)  # a group holding nothing needs nothing
    else:
        local = local_layouts(*mine)
        moving = local is not None and bool(transfers(*local[:2]))  # raises CommError
    if not moving:
        return Group(ranks, *mine, axes, Collective.NOOP)
    return Group(ranks, *mine, axes, _classify(*local_layouts(*mine), _group_mesh(mesh, axes)))


@lru_cache(maxsize=256)
def _group_mesh(mesh: Mesh, axes: tuple[int, ...]) -> Mesh:
    """The mesh one group along `axes` forms on its own."""
    return Mesh(*(mesh.shape[a] for a in axes)) if axes else Mesh(1)


@lru_cache(maxsize=1 << 14)
def _classify(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    """The collective of a group whose devices move some cells (cached: groups of many reshards are one local
    pair, `local_layouts`' same objects)."""
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


def _sharing(src: Layout, dst: Layout) -> np.ndarray:
    """(devices, devices) bool: whether device k's needed block and device j's held block share a cell."""
    (src_start, src_end, src_held), (dst_start, dst_end, dst_held) = bounds(src, dst)
    sharing = (np.maximum(src_start[None], dst_start[:, None]) < np.minimum(src_end[None], dst_end[:, None]))
    return sharing.all(axis=2) & dst_held[:, None] & src_held[None]


def _stays(src: Layout, dst: Layout) -> list[int] | None:
    """Per device, 1 if it needs no cell from another device of a `reshard_groups` group (one in which every
    needed cell is held), 0 if it does, -1 where transfers refuses the move (a device holding nothing that needs
    an empty block); None for all of them when it refuses every move (into a partial layout)."""
    if dst.partial:
        return None
    if src.partial:  # every other device holding a cell of a needed block sends its partial sum
        sharing = _sharing(src, dst)
        return (sharing.sum(axis=1) == np.diagonal(sharing)).astype(np.int8).tolist()
    (src_start, src_end, src_held), (dst_start, dst_end, dst_held) = bounds(src, dst)
    empty = (dst_start == dst_end).any(axis=1)
    own = src_held & (empty | ((src_start <= dst_start).all(axis=1) & (dst_end <= src_end).all(axis=1)))
    stays = (~dst_held | own).astype(np.int8)
    stays[dst_held & ~src_held & empty] = -1
    return stays.tolist()
