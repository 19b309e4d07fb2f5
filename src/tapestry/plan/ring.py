"""Ring-attention steps (context parallelism): who meets whose keys, in which order.

A ring step (`Compute.ring`, a kernel with `Kernel.ring`: sdpa, sdpa_masked) splits queries and keys together over
mesh axes: member j of a group along those axes (`mesh.fibres`) holds query block j and key block j of the inputs
that travel (k, v; `sharding.partition.ring_keys`). In round t each member computes its queries against the key
block of member j - t (its own first), then passes the travelling blocks it has on to member j + 1 and receives
the next from member j - 1; the rounds' (out, lse) merge by log-sum-exp (kernels.ring). A mask follows the
queries, so it stays: each member holds its rows' mask for every key and reads a key block of it per round. p - 1
sends of a key block each, overlapping the next round's compute. Simulation (plan.simulate), validation and the
rank programs (lower.ring) follow `rounds`.
"""
from __future__ import annotations

from tapestry.kernels.ring import key_extent, key_region, travels
from tapestry.plan.plan import Compute
from tapestry.sharding import Mesh
from tapestry.sharding.partition import ring_keys
from tapestry.zspace import ZRange


def members(step: Compute, mesh: Mesh) -> list[tuple[int, ...]]:
    """The rings: the groups of devices along the step's ring axes, each in ring order."""
    return mesh.fibres(step.ring)


def keys(step: Compute, mesh: Mesh) -> tuple[tuple[int, int], ...]:
    """Each device's key block [start, end): the even split of the keys, or for a gradient ring (the backward,
    whose output rows pack query i's and key i's gradients) its query rows, even or cut for equal work."""
    sig = step.signature
    if not sig.kernel.ring.gradients:
        return ring_keys(key_extent(sig), mesh, step.ring)
    rows = sig.dims.index(sig.kernel.ring.rows)
    if any(b is None for b in step.blocks):
        raise ValueError(f"step {step.out} ({step.kernel}): a gradient ring's members all hold rows")
    return tuple((b.start[rows], b.end[rows]) for b in step.blocks)


def rounds(size: int, member: int) -> list[int]:
    """The ring members whose key blocks member `member` meets, round by round: its own, then j-1, j-2, ..."""
    return [(member - t) % size for t in range(size)]


def reads(step: Compute, device: int, key_block: tuple[int, int]) -> list[ZRange]:
    """What `device` reads of each input in the round that meets key block `key_block`: its index block's read,
    keyed inputs (travelling or not) narrowed to that key block (cells outside a tensor read as zeros)."""
    sig = step.signature
    block = step.blocks[device]
    return [key_region(sig, arg, p.apply(block), key_block) for arg, p in enumerate(sig.projections)]


def travelling(step: Compute) -> tuple[bool, ...]:
    """Per input: does it pass round the ring (`kernels.ring.travels`)."""
    return travels(step.signature)
