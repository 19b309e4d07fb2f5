"""Candidate index partitions of one kernel over a mesh, and the layouts they imply.

A partition gives each device an index block (None: the device idles). Each
mesh axis either splits one index dim evenly or replicates the work. Splitting
a reduction dim makes the output Partial; doing that while another axis
replicates would count partials twice, so that combination is not generated.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from tapestry import zspace
from tapestry.kernels import DimKind, Signature
from tapestry.sharding.layout import Block, Layout
from tapestry.sharding.mesh import Mesh
from tapestry.zspace import IndexProjection, ZRange


@dataclass(frozen=True)
class Partition:
    """Index blocks per device, with the mesh-axis choices that made them (for names)."""

    blocks: tuple[Block, ...]
    axes: tuple[int | None, ...]  # per mesh axis: the index dim it splits, or None

    def name(self, sig: Signature) -> str:
        if all(a is None for a in self.axes):
            return "replicate"
        return "split(" + ",".join("·" if a is None else sig.dims[a] for a in self.axes) + ")"


def _non_empty(block: ZRange) -> Block:
    return None if block.is_empty else block


def make_partition(sig: Signature, mesh: Mesh, axes: tuple[int | None, ...]) -> Partition:
    """Split index dim `axes[i]` evenly over mesh axis i (None: not split over that axis)."""
    if len(axes) != mesh.ndim:
        raise ValueError(f"axes {axes} name {len(axes)} mesh axes; the mesh {mesh.shape} has {mesh.ndim}")
    rank = len(sig.index.shape)
    if any(dim is not None and not 0 <= dim < rank for dim in axes):
        raise ValueError(f"axes {axes}: the index space {list(sig.index.shape)} has dims 0..{rank - 1}")
    blocks = []
    for device in mesh.devices:
        block = sig.index
        for axis, dim in enumerate(axes):
            if dim is not None:
                block = block.split_even(dim, mesh.shape[axis])[mesh.coords(device)[axis]]
        blocks.append(_non_empty(block))
    return Partition(tuple(blocks), axes)


def candidate_partitions(sig: Signature, mesh: Mesh) -> list[Partition]:
    """Every even split of splittable dims over mesh axes, plus replicated computation."""
    reductions = set(sig.dims_of(DimKind.REDUCTION))
    found: dict[tuple[Block, ...], Partition] = {}
    for axes in itertools.product([None, *sig.splittable], repeat=mesh.ndim):
        splits_reduction = any(a in reductions for a in axes)
        if splits_reduction and any(a is None for a in axes):
            continue
        if any(a is not None and sig.index.shape[a] < mesh.shape[i] for i, a in enumerate(axes)):
            continue  # a device would idle: never better than a smaller split, and skews layouts
        part = make_partition(sig, mesh, axes)
        found.setdefault(part.blocks, part)
    return list(found.values())


def is_partial(sig: Signature, part: Partition) -> bool:
    reductions = set(sig.dims_of(DimKind.REDUCTION))
    return any(a in reductions for a in part.axes)


def _clipped(projection: IndexProjection, block: Block, shape: tuple[int, ...]) -> Block:
    if block is None:
        return None
    inside = ZRange.from_shape(shape).intersection(projection.apply(block))
    return None if inside is None else _non_empty(inside)


def output_layout(sig: Signature, part: Partition) -> Layout:
    return Layout(tuple(_clipped(sig.output, b, sig.output_shape) for b in part.blocks), is_partial(sig, part))


def needed_layout(sig: Signature, arg: int, part: Partition) -> Layout:
    """The layout giving each device exactly the cells of input `arg` its block reads."""
    return Layout(tuple(_clipped(sig.projections[arg], b, sig.input_shapes[arg]) for b in part.blocks))


def split_reductions(sig: Signature, blocks: Iterable[ZRange]) -> list[str]:
    """Reduction dims that some block does not cover whole: their outputs are partial sums."""
    blocks = [b for b in blocks if not b.is_empty]
    return [sig.dims[d] for d in sig.dims_of(DimKind.REDUCTION)
            if any(b.shape[d] != sig.index.shape[d] for b in blocks)]


def non_additive_issues(sig: Signature, split: list[str]) -> list[str]:
    return [f"splits reduction dim {name!r}, but {sig.kernel.name} is not additive in it"
            for name in split if name not in sig.kernel.additive]


def partition_issues(sig: Signature, blocks: tuple[Block, ...]) -> list[str]:
    """Problems with a per-device block assignment, checked with islpy: the distinct
    blocks must partition the index space; duplicates only where nothing is partial."""
    distinct = sorted({b for b in blocks if b is not None}, key=lambda b: (b.start, b.end))
    split = split_reductions(sig, distinct)
    issues = zspace.partition_problems(distinct, sig.index) + non_additive_issues(sig, split)
    duplicated = len(distinct) < sum(b is not None for b in blocks)
    if split and duplicated:
        issues.append("splits a reduction while also replicating blocks: partial sums would be counted twice")
    return issues
