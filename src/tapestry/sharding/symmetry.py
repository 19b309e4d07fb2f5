"""Mesh symmetries: relabellings of devices that swap mesh axes of equal size.

A permutation of axes that maps each axis to one of the same size maps every fibre (the device groups a
collective runs over) onto a fibre. So a reshard between two layouts and the reshard between their images move
the same bytes in groups of the same sizes over the permuted axes; where a cost model gives those axes the same
link, they cost the same. Pricing uses this to price one layout pair per orbit, under the relabellings that map
both layouts to splits of the same dims (`kept_splits`): on those the alpha-beta model is exactly blind to
relabelling (tests/test_mesh_symmetry.py); on others its tie-breaks by device order show. A 2x2x2 mesh has six
relabellings, a 2x2 mesh two, a 2x4 or 1-D mesh only the identity.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tapestry.kernels import Shape
from tapestry.sharding.layout import Layout
from tapestry.sharding.mesh import Mesh

Permutation = tuple[int, ...]  # device -> its image


@dataclass(frozen=True)
class Relabelling:
    """A permutation of mesh axes (axis a goes to `axes[a]`) and the device permutation it makes."""

    axes: tuple[int, ...]
    devices: Permutation


def relabellings(mesh: Mesh, alike: Callable[[int, int], bool]) -> tuple[Relabelling, ...]:
    """The permutations of axes onto axes of the same size that `alike` accepts (their links are equal), the
    identity first."""
    found: list[Relabelling] = []
    for order in itertools.permutations(range(mesh.ndim)):
        if any(mesh.shape[a] != mesh.shape[b] or (a != b and not alike(a, b)) for a, b in enumerate(order)):
            continue
        image = []
        for device in mesh.devices:
            moved = [0] * mesh.ndim
            for a, c in enumerate(mesh.coords(device)):
                moved[order[a]] = c
            image.append(_device(mesh, moved))
        found.append(Relabelling(order, tuple(image)))
    return tuple(found)


def _device(mesh: Mesh, coords: list[int]) -> int:
    device = 0
    for size, c in zip(mesh.shape, coords):
        device = device * size + c
    return device


def permuted(layout: Layout, permutation: Permutation) -> Layout:
    """`layout` with the block of each device moved to that device's image."""
    blocks = [None] * len(layout.blocks)
    for device, block in enumerate(layout.blocks):
        blocks[permutation[device]] = block
    return Layout(tuple(blocks), layout.partial)


@dataclass(frozen=True)
class Symmetries:
    """The relabellings of one mesh under one cost model, with each layout's images made once (pricing asks for
    the same few thousand layouts many times)."""

    mesh: Mesh
    relabellings: tuple[Relabelling, ...]
    _images: dict[tuple[Layout, Shape], dict[int, Layout]] = field(default_factory=dict, repr=False, compare=False)

    def pair_images(self, src: Layout, dst: Layout, shape: Shape) -> list[tuple[Layout, Layout]]:
        """The pair under each relabelling that keeps both layouts splits (`kept_splits`), itself first."""
        sources, targets = self.images(src, shape), self.images(dst, shape)
        return [(image, targets[i]) for i, image in sources.items() if i in targets]

    def images(self, layout: Layout, shape: Shape) -> dict[int, Layout]:
        """`layout` under each relabelling (by index) that keeps it a split, itself (0) first."""
        key = (layout, shape)
        found = self._images.get(key)
        if found is None:
            found = {i: permuted(layout, self.relabellings[i].devices)
                     for i in kept_splits(layout, shape, self.mesh, self.relabellings)}
            found[0] = layout
            self._images[key] = found
        return found


def kept_splits(layout: Layout, shape: Shape, mesh: Mesh, relabellings: tuple[Relabelling, ...]) -> list[int]:
    """The relabellings that map `layout`, an even split of dims over axes (`Layout.split`, partial or not), to
    the split of the same dims over the image axes: those that keep the order of the axes that split one dim (the
    lower axis is major). On other layouts (uneven, factored blocks) the alpha-beta model breaks ties by device
    order, so none but the identity."""
    name = layout.plain_name(shape, mesh)
    if name == "R":
        return list(range(len(relabellings)))
    if not name.startswith("S("):
        return [0]
    dims = name[2:-1].split(",")
    groups = [[a for a, d in enumerate(dims) if d == dim and mesh.shape[a] > 1] for dim in set(dims) - {"·"}]
    return [i for i, r in enumerate(relabellings)
            if all(r.axes[a] < r.axes[b] for axes in groups for a, b in zip(axes, axes[1:]))]
