"""Layouts: which block of a tensor each device holds, and whether blocks are partial sums.

A layout is its block list, so equal layouts are equal values however they were
made; the family names (R, S(d), P, ...) are derived for display only.
Semantics: for a plain layout every device holding a cell holds its value; for a
partial layout the value of a cell is the sum over the devices holding it.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tapestry.sharding.mesh import Mesh
from tapestry.zspace import ZRange

Block = ZRange | None


@dataclass(frozen=True)
class Layout:
    blocks: tuple[Block, ...]
    partial: bool = False

    def __hash__(self) -> int:
        """Computed once: pricing keys its caches by layout pairs, and hashing every block each time was half of
        it."""
        try:
            return self._hash  # type: ignore[attr-defined]
        except AttributeError:
            cached = hash((self.blocks, self.partial))
            object.__setattr__(self, "_hash", cached)
            return cached

    @functools.cached_property
    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, held): the blocks as (devices, ndim) int arrays (zeros where a device holds None) and
        which devices hold one. Made once per layout: pricing does box arithmetic on all blocks at once."""
        ndim = next((b.ndim for b in self.blocks if b is not None), 0)
        starts = np.array([b.start if b is not None else (0,) * ndim for b in self.blocks], dtype=np.int64)
        ends = np.array([b.end if b is not None else (0,) * ndim for b in self.blocks], dtype=np.int64)
        held = np.array([b is not None for b in self.blocks], dtype=bool)
        return starts.reshape(len(self.blocks), ndim), ends.reshape(len(self.blocks), ndim), held

    @classmethod
    def replicated(cls, shape: tuple[int, ...], mesh: Mesh) -> Layout:
        """The whole tensor on every device (one object per shape and mesh, `_replicated`)."""
        return _replicated(tuple(shape), mesh)

    @classmethod
    def split(cls, shape: tuple[int, ...], mesh: Mesh, dims: tuple[int | None, ...]) -> Layout:
        """Tensor dim dims[a] split evenly over mesh axis a (None: replicated over that axis); one object per
        shape, mesh and dims (`_split`)."""
        return _split(tuple(shape), mesh, tuple(dims))

    def holds(self, device: int) -> Block:
        return self.blocks[device]

    def name(self, shape: tuple[int, ...], mesh: Mesh) -> str:
        """A short family name when the layout is one: R, S(0), S(0,·), P, P·S(1); else 'blocks'."""
        family = self.plain_name(shape, mesh)
        if not self.partial:
            return family
        return "P" if family == "R" else f"P·{family}"

    def plain_name(self, shape: tuple[int, ...], mesh: Mesh) -> str:
        """The family name of the blocks, the partial flag aside: R, S(0), S(0,·) or 'blocks'. Asked of the layout
        itself where it is plain (`_family_name`'s cache finds it by identity, where a copy of it was compared
        block by block), of one plain copy per partial layout (`_plain`)."""
        return _family_name(tuple(shape), mesh, _plain(self) if self.partial else self)

    def to_json(self) -> dict[str, Any]:
        return {"blocks": [None if b is None else str(b) for b in self.blocks], "partial": self.partial}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        return cls(tuple(None if b is None else ZRange.parse(b) for b in data["blocks"]), bool(data["partial"]))

    def __str__(self) -> str:
        return ("partial " if self.partial else "") + "[" + ", ".join(str(b) for b in self.blocks) + "]"


@functools.lru_cache(maxsize=1 << 16)
def canonical(layout: Layout) -> Layout:
    """The first of the equal layouts asked for. Pricing makes the same translated and clipped layouts over and
    over as new objects; made canonical, the caches keyed by them find them by identity instead of comparing
    their blocks (Layout.__eq__, then ZRange.__eq__ per block: ~400,000 calls pricing Phi's reshards on 2x2)."""
    return layout


# The same for boxes made by box arithmetic (start, end: ordered int tuples of one rank, as ZRange._checked).
canonical_box = functools.lru_cache(maxsize=1 << 16)(ZRange._checked)


@functools.lru_cache(maxsize=1 << 12)
def _replicated(shape: tuple[int, ...], mesh: Mesh) -> Layout:
    return Layout((ZRange.from_shape(shape),) * mesh.size)


@functools.lru_cache(maxsize=1 << 14)  # pricing names layouts by comparing them with the split of their dims
def _split(shape: tuple[int, ...], mesh: Mesh, dims: tuple[int | None, ...]) -> Layout:
    blocks = []
    for device in mesh.devices:
        block = ZRange.from_shape(shape)
        for axis, (dim, coord) in enumerate(zip(dims, mesh.coords(device))):
            if dim is not None:
                block = _even(block, dim, mesh.shape[axis])[coord]
        blocks.append(block)
    return Layout(tuple(blocks))


@functools.lru_cache(maxsize=1 << 14)
def _plain(layout: Layout) -> Layout:
    """A partial layout's blocks as a plain layout, made once."""
    return Layout(layout.blocks)


@functools.lru_cache(maxsize=1 << 14)  # a 64-device split cuts the same few blocks 64 times over
def _even(block: ZRange, dim: int, parts: int) -> tuple[ZRange, ...]:
    return tuple(block.split_even(dim, parts))


@functools.lru_cache(maxsize=1 << 14)  # pricing asks for names of the same few layouts many thousand times
def _family_name(shape: tuple[int, ...], mesh: Mesh, layout: Layout) -> str:
    """`layout`'s family name: the split (`Layout.split`) whose dims the devices next to device 0 along each axis
    show, checked whole (enumerating every split was 1.3 s a shape on 8x8x8). A split along an axis moves
    device 0's neighbour in its dim alone (piece 0 of a non-empty range is never empty); an axis of one device
    splits nothing, so the first of the splits that make the layout names it, as `_family_names` does."""
    if 0 in shape:  # a split of an empty dim may leave the neighbours alike: the enumeration decides
        return _family_names(shape, mesh).get(layout, "blocks")
    dims = split_dims(shape, mesh, layout)
    if dims is None:
        return "blocks"
    if all(d is None for d in dims):
        return "R"
    return "S(" + ",".join("·" if d is None else str(d) for d in dims) + ")"


@functools.lru_cache(maxsize=1 << 14)
def split_dims(shape: tuple[int, ...], mesh: Mesh, layout: Layout) -> tuple[int | None, ...] | None:
    """The dims (one per mesh axis, None: not split along it) of the `Layout.split` whose blocks `layout` has
    (its partial flag aside; all None: replicated), or None where it is no split. Read off the devices next to
    device 0 along each axis (see `_family_name`); a shape with an empty dim is never read as a split here."""
    if 0 in shape:
        return None
    if layout.blocks == Layout.replicated(shape, mesh).blocks:
        return (None,) * mesh.ndim
    if len(layout.blocks) != mesh.size or any(b is None or b.ndim != len(shape) for b in layout.blocks):
        return None
    first, dims, stride = layout.blocks[0], [], mesh.size
    for size in mesh.shape:
        stride //= size
        if size == 1:
            dims.append(None)
            continue
        other = layout.blocks[stride]
        moved = [d for d in range(len(shape)) if (first.start[d], first.end[d]) != (other.start[d], other.end[d])]
        if len(moved) > 1:
            return None
        dims.append(moved[0] if moved else None)
    if all(d is None for d in dims) or Layout.split(shape, mesh, tuple(dims)).blocks != layout.blocks:
        return None
    return tuple(dims)


@functools.lru_cache(maxsize=64)
def _family_names(shape: tuple[int, ...], mesh: Mesh) -> dict[Layout, str]:
    """Every named plain layout of `shape` on `mesh`, by layout: what `_family_name` answers, by enumeration."""
    names = {}
    for dims in reversed(_split_choices(len(shape), mesh)):  # the first choice wins where two give one layout
        names[Layout.split(shape, mesh, dims)] = "S(" + ",".join("·" if d is None else str(d) for d in dims) + ")"
    names[Layout.replicated(shape, mesh)] = "R"
    return names


def _split_choices(ndim: int, mesh: Mesh) -> list[tuple[int | None, ...]]:
    options = [None, *range(ndim)]
    return [dims for dims in itertools.product(options, repeat=mesh.ndim) if any(d is not None for d in dims)]


@dataclass(eq=False)
class ValueNumbers:
    """A number per value, equal for equal values (layouts, or a Compute's blocks): found by the object's identity,
    and compared by value (every block) once per object. A deep plan names a few hundred layout and blocks objects
    over tens of thousands of steps (an expanded 80-layer 70B plan on 8x8x8), and comparing or hashing one compares
    or hashes its 512 blocks, a Python call each. The objects numbered are kept, so their ids are not reused."""

    _by_id: dict[int, int] = field(default_factory=dict)
    _by_value: dict[Hashable, int] = field(default_factory=dict)
    _held: list[Hashable] = field(default_factory=list)

    def __call__(self, value: Hashable) -> int:
        number = self._by_id.get(id(value))
        if number is None:
            number = self._by_id[id(value)] = self._by_value.setdefault(value, len(self._by_value))
            self._held.append(value)
        return number
