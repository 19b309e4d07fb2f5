"""Which collective a layout change is, so explanations, lowering and cost models agree on it.

A reshard is always executable as the block moves of `sharding.comm.transfers`;
the collective names the cheaper library call that does the same thing when
the layouts are the regular families (R, S(...), P).
"""
from __future__ import annotations

import enum

from tapestry.kernels import Shape
from tapestry.sharding.comm import transfers
from tapestry.sharding.layout import Layout
from tapestry.sharding.mesh import Mesh


class Collective(enum.StrEnum):
    NOOP = "noop"  # every device already holds what it needs (possibly after slicing locally)
    ALL_GATHER = "all_gather"  # devices keep their blocks and collect the others'
    ALL_REDUCE = "all_reduce"  # partial -> replicated
    REDUCE_SCATTER = "reduce_scatter"  # partial -> split
    ALL_TO_ALL = "all_to_all"  # split one way -> split another way
    SEND_RECV = "send_recv"  # anything else: point-to-point block moves


def _family(layout: Layout, shape: Shape, mesh: Mesh) -> str:
    """'R', 'S' or 'blocks' for the plain blocks of `layout`."""
    name = Layout(layout.blocks).name(shape, mesh)
    return "S" if name.startswith("S(") else name


def _keeps_own_blocks(src: Layout, dst: Layout) -> bool:
    return all(s is None or (d is not None and d.contains(s)) for s, d in zip(src.blocks, dst.blocks))


def classify_reshard(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Collective:
    """The collective that turns `src` into `dst` (raises CommError when no moves can)."""
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
