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
from tapestry.sharding.comm import CommError, filled_box, transfers, union_covers
from tapestry.sharding.grid import bounds, cells
from tapestry.sharding.layout import Layout, canonical, canonical_box
from tapestry.sharding.mesh import Mesh
from tapestry.zspace import ZRange


class Collective(enum.StrEnum):
    NOOP = "noop"  # every device already holds what it needs (possibly after slicing locally)
    ALL_GATHER = "all_gather"  # devices keep their blocks and collect the others'
    ALL_REDUCE = "all_reduce"  # partial -> replicated (or one region of it on every device)
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
    if src.partial or dst.partial:  # whether a group holds every partial of its cells depends on the others too
        for axes, ok in zip(subsets, _self_sufficient(src, dst, mesh, subsets, together)):
            if ok:
                stays = _stays(src, dst)
                return tuple(_group(mine, needed, mesh, axes, ranks,
                                    None if stays is None else tuple(stays[r] for r in ranks))
                             for ranks, mine, needed in zip(_fibres(mesh, axes), *_members(src, dst, mesh, axes)))
    else:  # plain: decided group by group, on the groups' blocks, which a tensor's many reshards share
        bounds(src, dst)  # raises on blocks of different ranks, whichever groups hold them
        for axes in subsets:
            if not axes and 0 in _plain_stays(src, dst):  # a device alone lacks cells: no need to ask each
                continue
            mine, needed = _members(src, dst, mesh, axes)
            if all(map(_holds_needs, mine, needed)):  # the first group lacking ends it
                return tuple(_group(*pair, mesh, axes, ranks, _plain_stays(*pair))
                             for ranks, *pair in zip(_fibres(mesh, axes), mine, needed))
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


@lru_cache(maxsize=1 << 17)  # asked per reshard priced (cost.comm.translated) and per group
def local_layouts(src: Layout, dst: Layout) -> tuple[Layout, Layout, Shape] | None:
    """A group's layouts relative to the box their blocks span, and that box's shape (None if it holds nothing):
    groups that are translations of one another are one collective, and one entry in transfers' cache. Made from
    each layout's span and shifted copy (`_span`, `_shifted`), which the many pairs a layout is in share."""
    spans = [span for span in (_span(src), _span(dst)) if span is not None]
    if not spans:
        return None
    if len(spans) == 1:
        origin, end = spans[0]
    else:
        (src_start, src_end), (dst_start, dst_end) = spans
        origin, end = tuple(map(min, src_start, dst_start)), tuple(map(max, src_end, dst_end))
    shape = tuple(map(operator.sub, end, origin))
    if not any(origin):  # already relative to the box
        return src, dst, shape
    return _shifted(src, origin), _shifted(dst, origin), shape


@lru_cache(maxsize=1 << 16)
def _span(layout: Layout) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The least start and the greatest end of `layout`'s blocks (None if it holds none)."""
    held = [b for b in layout.blocks if b is not None]
    if not held:
        return None
    if len(held) == 1:
        return held[0].start, held[0].end
    return tuple(map(min, *(b.start for b in held))), tuple(map(max, *(b.end for b in held)))


@lru_cache(maxsize=1 << 16)
def _shifted(layout: Layout, origin: tuple[int, ...]) -> Layout:
    """`layout` with `origin` moved to 0 (one object per layout and origin: `canonical`)."""
    def shifted(b: ZRange | None) -> ZRange | None:
        return None if b is None else canonical_box(tuple(map(operator.sub, b.start, origin)),
                                                    tuple(map(operator.sub, b.end, origin)))

    return canonical(Layout(tuple(map(shifted, layout.blocks)), layout.partial))


def _members(src: Layout, dst: Layout, mesh: Mesh, axes: tuple[int, ...]) -> tuple[tuple[Layout, ...], ...]:
    """The blocks of each group of devices along `axes` (`_fibres`): the source's partial flag kept, the
    destination's dropped."""
    return _restricted(src, mesh, axes, src.partial), _restricted(dst, mesh, axes, False)


@lru_cache(maxsize=1 << 16)
def _restricted(layout: Layout, mesh: Mesh, axes: tuple[int, ...], partial: bool) -> tuple[Layout, ...]:
    """Made once per layout and grouping: a tensor's many reshards share these few objects (and their hashes), so
    the checks below are cached by them."""
    return tuple(canonical(Layout(tuple(layout.blocks[r] for r in ranks), partial)) for ranks in _fibres(mesh, axes))


@lru_cache(maxsize=1 << 16)
def _holds_needs(src: Layout, dst: Layout) -> bool:
    """Whether a group's plain source blocks hold every cell its devices' destination blocks need: per group,
    what `_self_sufficient` decides for a whole grouping at once. Most needed blocks lie inside one held block or
    inside the box the held blocks fill (`filled_box`); only where they leave holes is the cell grid needed."""
    held = [b for b in src.blocks if b is not None]
    box = filled_box(src) if held else None

    def inside(need: ZRange | None) -> bool:
        return (need is None or _is_empty(need) or (box is not None and _contains(box, need))
                or any(map(_contains, held, itertools.repeat(need))))

    if all(map(inside, dst.blocks)):
        return True
    if box is not None or len(held) < 2:  # what they hold is one box, and a needed block leaves it
        return False
    found = [union_covers(held, need) for need in dst.blocks if need is not None]
    if None not in found:
        return all(found)
    has, needs = cells(src, dst)
    return bool((has.any(axis=0) | ~needs).all())


def _is_empty(box: ZRange) -> bool:
    return any(map(operator.ge, box.start, box.end))


def _contains(outer: ZRange, inner: ZRange) -> bool:
    return all(map(operator.le, outer.start, inner.start)) and all(map(operator.le, inner.end, outer.end))


@lru_cache(maxsize=1 << 16)
def _plain_stays(src: Layout, dst: Layout) -> tuple[int, ...]:
    """`_stays` of plain blocks, device by device: one block each, no arrays."""
    def stays(own: ZRange | None, need: ZRange | None) -> int:
        if need is None:
            return 1
        if own is None:
            return -1 if _is_empty(need) else 0
        return int(_is_empty(need) or _contains(own, need))

    return tuple(map(stays, src.blocks, dst.blocks))


def _group(src: Layout, dst: Layout, mesh: Mesh, axes: tuple[int, ...], ranks: tuple[int, ...],
           here: tuple[int, ...] | None) -> Group:
    """Named as a collective on its own (`_group_kind`): `src` and `dst` are the group's blocks (`_members`),
    `here` their `_stays`."""
    return Group(ranks, src, dst, axes, _group_kind(src, dst, _group_mesh(mesh, axes), here))


@lru_cache(maxsize=1 << 16)
def _group_kind(src: Layout, dst: Layout, mesh: Mesh, here: tuple[int, ...] | None) -> Collective:
    """A group's collective on its own mesh, from its blocks relative to the box they span. Block moves are planned
    only where `here` (`_stays`) cannot tell whether any are needed (a move transfers refuses), so naming a
    collective never plans them."""
    if here is not None and min(here) >= 0:
        moving = not all(here)  # a group holding nothing needs nothing
    else:
        local = local_layouts(src, dst)
        moving = local is not None and bool(transfers(*local[:2]))  # raises CommError
    if not moving:
        return Collective.NOOP
    return _classify(*local_layouts(src, dst), mesh)


@lru_cache(maxsize=256)
def _group_mesh(mesh: Mesh, axes: tuple[int, ...]) -> Mesh:
    """The mesh one group along `axes` forms on its own."""
    return Mesh(*(mesh.shape[a] for a in axes)) if axes else Mesh(1)


@lru_cache(maxsize=1 << 14)
def _classify(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    """The collective of a group whose devices move some cells (cached: groups of many reshards are one local
    pair, `local_layouts`' same objects). Partial sums that every device needs the same region of are an
    all-reduce of that region, whatever the partial blocks span: each device first slices its addend of the
    region (a chunk's half of a grouped mm's partial output; as point-to-point moves each device received p - 1
    addends of it, 511 on 8x8x8)."""
    if src.partial and one_region(dst) is not None:
        return Collective.ALL_REDUCE
    target = _family(dst, shape, mesh)
    if src.partial:
        return Collective.REDUCE_SCATTER if target == "S" else Collective.SEND_RECV
    if target == "R":
        return Collective.ALL_GATHER
    if target == "S" and _family(src, shape, mesh) == "S":
        return Collective.ALL_GATHER if _keeps_own_blocks(src, dst) else Collective.ALL_TO_ALL
    return Collective.SEND_RECV


def one_region(layout: Layout) -> ZRange | None:
    """The one block every device holds, if they all hold the same (None otherwise)."""
    first = layout.blocks[0]
    return first if first is not None and all(b == first for b in layout.blocks) else None


@lru_cache(maxsize=1 << 14)  # asked of the same local layouts by many groups' `_classify`
def _family(layout: Layout, shape: Shape, mesh: Mesh) -> str:
    """'R', 'S' or 'blocks' for the plain blocks of `layout`."""
    name = layout.plain_name(shape, mesh)
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
