"""Candidate index partitions of one kernel over a mesh, and the layouts they imply.

A partition gives each device an index block (None: the device idles). Each
mesh axis either splits one index dim evenly, or several at once (a
factorization of its size: batch 4 x sequence 2 on 8 devices), or replicates
the work. Candidates factor an axis over two dims only where the parts divide
both dims, which keeps the e-graph's growth in check. Splitting
a reduction dim makes the output Partial; doing that while another axis
replicates would count partials twice, so that combination is not generated.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from tapestry import zspace
from tapestry.kernels import DimKind, Signature
from tapestry.sharding.layout import Block, Layout
from tapestry.sharding.mesh import Mesh
from tapestry.zspace import IndexProjection, ZRange


Split = tuple[tuple[int, int], ...]  # one mesh axis: (index dim, parts) pairs, first major; () replicates
AxisChoice = int | None | Split  # as callers write it: one dim over the whole axis, None, or a factorization


@dataclass(frozen=True)
class Partition:
    """Index blocks per device, with the mesh-axis choices that made them (for names)."""

    blocks: tuple[Block, ...]
    axes: tuple[Split, ...]  # per mesh axis: the index dims it splits, and into how many parts each

    def name(self, sig: Signature) -> str:
        if not any(self.axes):
            return "replicate"
        return "split(" + ",".join(_split_name(sig, split) for split in self.axes) + ")"

    def dims(self) -> set[int]:
        """The index dims split over some mesh axis."""
        return {dim for split in self.axes for dim, _ in split}


def _split_name(sig: Signature, split: Split) -> str:
    if not split:
        return "·"
    if len(split) == 1:
        return sig.dims[split[0][0]]
    return "×".join(f"{sig.dims[d]}/{parts}" for d, parts in split)


def _non_empty(block: ZRange) -> Block:
    return None if block.is_empty else block


def _normal(choice: AxisChoice, size: int) -> Split:
    if choice is None or choice == ():
        return ()
    if isinstance(choice, int):
        return ((choice, size),)
    split = tuple((int(d), int(p)) for d, p in choice)
    if math.prod(p for _, p in split) != size:
        raise ValueError(f"split {list(split)}: the parts multiply to {math.prod(p for _, p in split)}, "
                         f"not the mesh axis size {size}")
    return split


def make_partition(sig: Signature, mesh: Mesh, axes: tuple[AxisChoice, ...]) -> Partition:
    """Split index dim `axes[i]` evenly over mesh axis i (None: not split over it), or several dims at once:
    `axes[i]` = ((dim, parts), ...) with the parts multiplying to the axis size, the first dim major."""
    if len(axes) != mesh.ndim:
        raise ValueError(f"axes {axes} name {len(axes)} mesh axes; the mesh {mesh.shape} has {mesh.ndim}")
    splits = tuple(_normal(choice, size) for choice, size in zip(axes, mesh.shape))
    rank = len(sig.index.shape)
    if any(not 0 <= dim < rank for split in splits for dim, _ in split):
        raise ValueError(f"axes {axes}: the index space {list(sig.index.shape)} has dims 0..{rank - 1}")
    blocks = []
    for device in mesh.devices:
        block = sig.index
        for split, coord in zip(splits, mesh.coords(device)):
            for dim, parts in reversed(split):  # mixed radix: the last dim varies fastest
                coord, index = divmod(coord, parts)
                block = _pieces(block, dim, parts)[index]
        blocks.append(_non_empty(block))
    return Partition(tuple(blocks), splits)


@functools.lru_cache(maxsize=1 << 16)  # every partition of a signature cuts the same index space
def _pieces(block: ZRange, dim: int, parts: int) -> tuple[ZRange, ...]:
    return tuple(block.split_even(dim, parts))


def _axis_choices(sig: Signature, size: int) -> list[Split]:
    """One mesh axis of `size` devices: replicate, split one splittable dim at least that long, or split two
    non-reduction dims by a factorization of the size whose parts divide both dims (so no block is ragged or
    empty), where one of them cannot take the whole axis evenly alone (else that split is there already)."""
    dims = sig.splittable
    extent = sig.index.shape
    choices: list[Split] = [(), *(((d, size),) for d in dims if extent[d] >= size)]
    parallel = [d for d in dims if d not in sig.dims_of(DimKind.REDUCTION)]
    for first, second in itertools.combinations(parallel, 2):
        if extent[first] % size == 0 and extent[second] % size == 0:
            continue
        for parts in range(2, size // 2 + 1):
            rest = size // parts
            if size % parts == 0 and extent[first] % parts == 0 and extent[second] % rest == 0:
                choices.append(((first, parts), (second, rest)))
    return choices


def candidate_partitions(sig: Signature, mesh: Mesh) -> list[Partition]:
    """Every even split of splittable dims over mesh axes (several dims at once by factorizations of an
    axis), plus replicated computation."""
    reductions = set(sig.dims_of(DimKind.REDUCTION))
    found: dict[tuple[Block, ...], Partition] = {}
    for axes in itertools.product(*(_axis_choices(sig, size) for size in mesh.shape)):
        splits_reduction = any(d in reductions for split in axes for d, _ in split)
        if splits_reduction and any(not split for split in axes):
            continue
        part = make_partition(sig, mesh, axes)
        found.setdefault(part.blocks, part)
    return list(found.values())


def generation_order(parts: Iterable[Partition]) -> list[Partition]:
    """Most devices busy first, then fewest dims split: what a budget-stopped generation inserts first is then
    each node's fully parallel, mutually consistent splits (batch over every axis), not 2-way ones."""
    def key(part: Partition) -> tuple[int, int]:
        return -len({b for b in part.blocks if b is not None}), len(part.dims())
    return sorted(parts, key=key)


def is_partial(sig: Signature, part: Partition) -> bool:
    return bool(part.dims() & set(sig.dims_of(DimKind.REDUCTION)))


@functools.lru_cache(maxsize=1 << 16)  # blocks recur across a signature's partitions and devices
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
