"""Affine maps from index space to tensor space, and the boxes they select."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tapestry.zspace.zrange import Point, ZRange, as_point, check_ndim


@dataclass(frozen=True, init=False)
class ZAffineMap:
    """x -> matrix·x + offset; rows are output (tensor) dims, columns input (index) dims."""

    matrix: tuple[Point, ...]
    offset: Point
    in_dim: int

    def __init__(
        self,
        matrix: Sequence[Sequence[int]],
        offset: Sequence[int] | None = None,
        *,
        in_dim: int | None = None,
    ) -> None:
        """`in_dim` is needed only when the matrix has no rows to count columns from."""
        rows = tuple(as_point(row) for row in matrix)
        if rows:
            in_dim = len(rows[0]) if in_dim is None else in_dim
            for r, row in enumerate(rows):
                check_ndim(f"matrix row {r}", len(row), in_dim)
        offset = (0,) * len(rows) if offset is None else as_point(offset)
        check_ndim("offset", len(offset), len(rows))
        object.__setattr__(self, "matrix", rows)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "in_dim", 0 if in_dim is None else in_dim)

    @classmethod
    def identity(cls, n: int) -> ZAffineMap:
        return cls([[int(r == c) for c in range(n)] for r in range(n)], in_dim=n)

    @property
    def out_dim(self) -> int:
        return len(self.matrix)

    def apply(self, point: Sequence[int]) -> Point:
        x = as_point(point)
        check_ndim(f"point {x}", len(x), self.in_dim)
        return tuple(
            sum(a * v for a, v in zip(row, x)) + b for row, b in zip(self.matrix, self.offset)
        )

    def __str__(self) -> str:
        rows = ",".join("[" + ",".join(map(str, row)) + "]" for row in self.matrix)
        text = f"λx.[{rows}]⋅x"
        return text + f" + [{','.join(map(str, self.offset))}]" if any(self.offset) else text

    def to_json(self) -> dict[str, Any]:
        return {
            "matrix": [list(row) for row in self.matrix],
            "offset": list(self.offset),
            "in_dim": self.in_dim,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ZAffineMap:
        return cls(data["matrix"], data.get("offset"), in_dim=data.get("in_dim"))


@dataclass(frozen=True, init=False)
class IndexProjection:
    """Index point i selects the box [A·i + b, A·i + b + shape) of a tensor."""

    affine: ZAffineMap
    shape: Point

    def __init__(self, affine: ZAffineMap, shape: Sequence[int] | None = None) -> None:
        shape = (1,) * affine.out_dim if shape is None else as_point(shape)
        check_ndim("shape", len(shape), affine.out_dim)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative shape {list(shape)}")
        object.__setattr__(self, "affine", affine)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def identity(cls, n: int) -> IndexProjection:
        return cls(ZAffineMap.identity(n))

    @property
    def matrix(self) -> tuple[Point, ...]:
        return self.affine.matrix

    @property
    def offset(self) -> Point:
        return self.affine.offset

    @property
    def in_dim(self) -> int:
        return self.affine.in_dim

    @property
    def out_dim(self) -> int:
        return self.affine.out_dim

    def apply(self, x: ZRange | Sequence[int]) -> ZRange:
        """A point's box, or the exact bounding box of every box a range's points select.

        When a range selects nothing (it is empty, or `shape` has a zero) the result is the
        empty range of shape 0 at the projection of `x.start` (zr[] when out_dim is 0, since a
        0-dim range cannot be empty).
        """
        if not isinstance(x, ZRange):
            start = self.affine.apply(x)
            return ZRange(start, [s + n for s, n in zip(start, self.shape)])
        check_ndim(x, x.ndim, self.in_dim)
        if x.is_empty or 0 in self.shape:
            # Nothing is selected; keep a position so callers can still place the result.
            start = self.affine.apply(x.start)
            return ZRange(start, start)
        last = x.inclusive_end
        # Each row is separable per column, so min/max over all 2^n corners is a sum of
        # per-column extremes; the two extreme corners alone miss mixed-sign rows.
        lo = [
            b + sum(min(a * s, a * e) for a, s, e in zip(row, x.start, last))
            for row, b in zip(self.matrix, self.offset)
        ]
        hi = [
            b + sum(max(a * s, a * e) for a, s, e in zip(row, x.start, last)) + n
            for row, b, n in zip(self.matrix, self.offset, self.shape)
        ]
        return ZRange(lo, hi)

    def extent(self, x: ZRange) -> Point:
        """The shape of `x`'s image per tensor dim, as if `x` were not empty: zero only in the dims whose row
        reads an index dim of size zero (or whose box is empty). `apply` gives an all-zero box when `x` is empty,
        which is right for a block that computes nothing but wrong for a whole tensor's shape: relu of a (4, 0)
        tensor is (4, 0), and a sum over an empty axis of it is (4,)."""
        check_ndim(x, x.ndim, self.in_dim)
        return tuple(
            0 if n == 0 or any(a and size == 0 for a, size in zip(row, x.shape))
            else n + sum(abs(a) * (size - 1) for a, size in zip(row, x.shape))
            for row, n in zip(self.matrix, self.shape)
        )

    def __str__(self) -> str:
        return f"ipf({self.affine}, shape={list(self.shape)})"

    def to_json(self) -> dict[str, Any]:
        return {"affine": self.affine.to_json(), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexProjection:
        return cls(ZAffineMap.from_json(data["affine"]), data.get("shape"))
