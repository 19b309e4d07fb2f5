"""Blocks a plan leaves on the ranks, seen as torch sees sharded state: DTensors over a DeviceMesh.

A tapestry.Mesh numbers its devices row-major over its axes, as `init_device_mesh` does, so the mesh maps to a
DeviceMesh of the same shape and rank i is device i. A tensor's blocks (one ZRange per rank) are a DTensor where
each mesh axis either leaves the block alone (Replicate) or cuts one tensor dim in torch.chunk's pieces
(Shard(dim); axes that cut the same dim nest in mesh-axis order, as DTensor's do). Other layouts (uneven cuts,
ranks left out) have no DTensor form; `placements` says None and callers keep such tensors whole.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from tapestry.sharding import Mesh
from tapestry.zspace import ZRange


def device_mesh(mesh: Mesh, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh of `mesh` over the default process group (collective: every rank calls it, in one order)."""
    return init_device_mesh(device_type, mesh.shape)


def placements(shape: Sequence[int], blocks: Sequence[ZRange | None], mesh: Mesh) -> tuple[Placement, ...] | None:
    """The DTensor placements whose local shards are exactly `blocks` (by rank), or None if there are none."""
    if len(blocks) != mesh.size or any(b is None for b in blocks):
        return None
    found: list[Placement] = []
    for axis in range(mesh.ndim):
        if mesh.shape[axis] == 1:
            found.append(Replicate())
            continue
        neighbour = math.prod(mesh.shape[axis + 1:])  # the device one step along `axis` from device 0 (row-major)
        moved = [d for d, (a, b) in enumerate(zip(blocks[0].start, blocks[neighbour].start)) if a != b]
        if len(moved) > 1:
            return None
        found.append(Shard(moved[0]) if moved else Replicate())
    wanted = tuple(found)
    return wanted if all(blocks[rank] == local_block(shape, wanted, mesh, rank) for rank in mesh.devices) else None


def local_block(shape: Sequence[int], placed: Sequence[Placement], mesh: Mesh, rank: int) -> ZRange:
    """Rank `rank`'s block of a tensor of `shape` under DTensor `placed` (torch.chunk pieces, nested by axis)."""
    start, end = [0] * len(shape), list(shape)
    for axis, (placement, coord) in enumerate(zip(placed, mesh.coords(rank))):
        if isinstance(placement, Shard):
            dim, size = placement.dim, end[placement.dim] - start[placement.dim]
            piece = -(-size // mesh.shape[axis])
            lo = min(start[dim] + coord * piece, end[dim])
            start[dim], end[dim] = lo, min(lo + piece, end[dim])
    return ZRange(start, end)

