"""Derive each index dim's kind from the projections, asking islpy.

Projections are translation invariant, so comparing the boxes selected by the
origin and by its neighbour one step along a dim decides the dim everywhere.
"""
from __future__ import annotations

from tapestry.kernels.kernel import DimKind, KernelError, Signature
from tapestry.zspace import IndexProjection, ZRange
from tapestry.zspace.isl import footprint


def _neighbours_overlap(projection: IndexProjection, ndim: int, dim: int) -> tuple[bool, bool]:
    """(do the boxes of i and i+e_dim overlap, are they the same box)."""
    origin = ZRange.from_shape((1,) * ndim)
    step = origin.translate(tuple(1 if d == dim else 0 for d in range(ndim)))
    a, b = footprint(projection, origin), footprint(projection, step)
    return not a.intersect(b).is_empty(), a.is_equal(b)


def classify_dims(sig: Signature) -> tuple[DimKind, ...]:
    ndim = len(sig.dims)
    kinds = []
    for dim, name in enumerate(sig.dims):
        overlap, same = _neighbours_overlap(sig.output, ndim, dim)
        if same:
            kinds.append(DimKind.REDUCTION)
            continue
        if overlap:
            raise KernelError(f"{sig.kernel.name}: output blocks of index dim {name!r} overlap without being equal")
        windowed = any(
            o and not s for o, s in (_neighbours_overlap(p, ndim, dim) for p in sig.projections)
        )
        kinds.append(DimKind.WINDOWED if windowed else DimKind.PARALLEL)
    return tuple(kinds)
