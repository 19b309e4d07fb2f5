"""Half-open integer boxes: the unit of sharding."""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Point = tuple[int, ...]

_RANGE_RE = re.compile(r"\s*zr\[(.*)\]\s*")
_DIM_RE = re.compile(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*")


def as_point(values: Iterable[int]) -> Point:
    """Normalise any int sequence (lists, numpy rows) to a hashable tuple; rejects floats."""
    return tuple(operator.index(v) for v in values)


def check_ndim(what: object, got: int, expected: int) -> None:
    """One wording for every dimension check, so messages are greppable; `what` is formatted only for the error
    (box arithmetic checks millions of times)."""
    if got != expected:
        raise ValueError(f"ndim mismatch: {what} has {got} dims, expected {expected}")


@dataclass(frozen=True, order=True, init=False)
class ZRange:
    """The box [start, end). A 0-dim range is a single point: size 1, not empty."""

    start: Point
    end: Point

    def __init__(self, start: Sequence[int], end: Sequence[int]) -> None:
        start, end = as_point(start), as_point(end)
        check_ndim("end", len(end), len(start))
        for d, (s, e) in enumerate(zip(start, end)):
            if s > e:
                raise ValueError(f"start {list(start)} must be <= end {list(end)} (dim {d})")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    @classmethod
    def _checked(cls, start: Point, end: Point) -> ZRange:
        """A box from int tuples already known to be ordered and of one rank: box arithmetic makes millions of
        these while pricing reshards, and __init__'s checks would be half its time."""
        box = object.__new__(cls)
        object.__setattr__(box, "start", start)
        object.__setattr__(box, "end", end)
        return box

    def __hash__(self) -> int:
        """Computed once, as Layout's: validating a 512-device plan hashed its blocks 5.7 million times."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.start, self.end))
            object.__setattr__(self, "_hash", cached)
        return cached

    @classmethod
    def from_shape(cls, shape: Sequence[int]) -> ZRange:
        return cls((0,) * len(shape), shape)

    @classmethod
    def bounding(cls, ranges: Iterable[ZRange]) -> ZRange:
        """Smallest box holding every range; empty ranges still pin their corners."""
        ranges = list(ranges)
        if not ranges:
            raise ValueError("bounding box of no ranges")
        ndim = len(ranges[0].start)
        for r in ranges:
            check_ndim(r, r.ndim, ndim)
        return cls._checked(tuple(map(min, *(r.start for r in ranges))) if len(ranges) > 1 else ranges[0].start,
                            tuple(map(max, *(r.end for r in ranges))) if len(ranges) > 1 else ranges[0].end)

    @property
    def ndim(self) -> int:
        return len(self.start)

    @property
    def shape(self) -> Point:
        return tuple(map(operator.sub, self.end, self.start))

    @property
    def size(self) -> int:
        return math.prod(map(operator.sub, self.end, self.start))

    @property
    def is_empty(self) -> bool:
        return any(map(operator.eq, self.start, self.end))

    @property
    def inclusive_end(self) -> Point:
        """The last cell; an empty range has none, so this raises IndexError."""
        if self.is_empty:
            raise IndexError(f"empty range {self} has no inclusive end")
        return tuple(e - 1 for e in self.end)

    def contains(self, x: ZRange | Sequence[int]) -> bool:
        """Per-coordinate containment (not the original's dominance order)."""
        if isinstance(x, ZRange):
            check_ndim(x, x.ndim, self.ndim)
            return all(map(operator.le, self.start, x.start)) and all(map(operator.le, x.end, self.end))
        p = as_point(x)
        check_ndim(f"point {p}", len(p), self.ndim)
        return all(s <= c < e for s, c, e in zip(self.start, p, self.end))

    def intersection(self, other: ZRange) -> ZRange | None:
        """None only when disjoint; touching boxes meet in an empty range."""
        check_ndim(other, other.ndim, self.ndim)
        start = tuple(map(max, self.start, other.start))
        end = tuple(map(min, self.end, other.end))
        if any(map(operator.gt, start, end)):
            return None
        return ZRange._checked(start, end)

    def translate(self, delta: Sequence[int]) -> ZRange:
        delta = as_point(delta)
        if len(delta) != self.ndim:
            check_ndim(f"delta {delta}", len(delta), self.ndim)
        return ZRange._checked(tuple(map(operator.add, self.start, delta)), tuple(map(operator.add, self.end, delta)))

    def split(self, dim: int, chunk_size: int) -> list[ZRange]:
        """ceil(n / chunk_size) pieces along dim, the last one smaller."""
        d = self._resolve_dim(dim)
        if chunk_size <= 0:
            raise ValueError(f"non-positive chunk size {chunk_size}")
        n = self.shape[d]
        if chunk_size >= n:
            return [self]
        return self._cut(d, [min(chunk_size, n - k) for k in range(0, n, chunk_size)])

    def split_even(self, dim: int, parts: int) -> list[ZRange]:
        """Exactly `parts` pieces (for a mesh axis), sizes within one, larger first."""
        d = self._resolve_dim(dim)
        if parts <= 0:
            raise ValueError(f"non-positive number of parts {parts}")
        q, rem = divmod(self.shape[d], parts)
        return self._cut(d, [q + 1] * rem + [q] * (parts - rem))

    def points(self) -> Iterator[Point]:
        """Row-major order: the last dim varies fastest."""
        return itertools.product(*(range(s, e) for s, e in zip(self.start, self.end)))

    def slices(self) -> tuple[slice, ...]:
        """Slices for an array whose origin is the zero point."""
        if any(s < 0 for s in self.start):
            raise ValueError(f"{self} has a negative start; use relative_to")
        return self._slices_from((0,) * self.ndim)

    def relative_to(self, outer: ZRange) -> tuple[slice, ...]:
        """Slices of self inside a block array that holds `outer`."""
        if not outer.contains(self):
            raise ValueError(f"{self} is not inside {outer}")
        return self._slices_from(outer.start)

    def __str__(self) -> str:
        return "zr[" + ", ".join(f"{s}:{e}" for s, e in zip(self.start, self.end)) + "]"

    @classmethod
    def parse(cls, text: str) -> ZRange:
        """Inverse of str(); also accepts the form without spaces."""
        whole = _RANGE_RE.fullmatch(text)
        body = whole.group(1).strip() if whole else None
        dims = [] if body == "" else [_DIM_RE.fullmatch(p) for p in (body or "").split(",")]
        if whole is None or not all(dims):
            raise ValueError(f"malformed ZRange string {text!r}")
        try:
            return cls([int(m.group(1)) for m in dims], [int(m.group(2)) for m in dims])
        except ValueError as err:
            raise ValueError(f"invalid ZRange string {text!r}: {err}") from err

    def to_json(self) -> dict[str, list[int]]:
        return {"start": list(self.start), "end": list(self.end)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ZRange:
        return cls(data["start"], data["end"])

    def _resolve_dim(self, dim: int) -> int:
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"dim {dim} out of range for {self.ndim}-dim range {self}")
        return dim % self.ndim

    def _cut(self, d: int, sizes: Sequence[int]) -> list[ZRange]:
        bounds = list(itertools.accumulate(sizes, initial=self.start[d]))
        return [
            ZRange._checked(_replace(self.start, d, lo), _replace(self.end, d, hi))
            for lo, hi in itertools.pairwise(bounds)
        ]

    def _slices_from(self, origin: Point) -> tuple[slice, ...]:
        return tuple(slice(s - o, e - o) for s, e, o in zip(self.start, self.end, origin))


# Boxes up to which `tiles` tests each pair in turn: a 4-device split's 6 pairs take less than numpy's grid
# set-up, which generation asks for thousands of times on Mesh(2, 2).
PAIRED_BOXES = 8


def tiles(parts: Sequence[ZRange], whole: ZRange) -> bool:
    """Whether the non-empty `parts` partition `whole` (inside it, pairwise disjoint, volumes adding up): the
    closed form of islpy's partition check for boxes, which a 64-device split would pay ~2,000 set intersections
    for. Empty parts are nothing, as in islpy."""
    boxes = [p for p in parts if not p.is_empty]
    for p in parts:
        check_ndim(p, p.ndim, whole.ndim)
    if any(not whole.contains(p) for p in boxes) or sum(p.size for p in boxes) != whole.size:
        return False
    if len(boxes) <= PAIRED_BOXES:
        return not any(all(map(operator.lt, map(max, a.start, b.start), map(min, a.end, b.end)))
                       for a, b in itertools.combinations(boxes, 2))
    starts = np.array([p.start for p in boxes], dtype=np.int64).reshape(len(boxes), whole.ndim)
    ends = np.array([p.end for p in boxes], dtype=np.int64).reshape(len(boxes), whole.ndim)
    counts = _grid_counts(starts, ends)
    if counts is not None:
        return bool((counts <= 1).all())
    meet = (np.maximum(starts[:, None], starts[None]) < np.minimum(ends[:, None], ends[None])).all(axis=2)
    np.fill_diagonal(meet, False)
    return not meet.any()


GRID_CELLS_PER_BOX = 16  # `_grid_counts` gives up past this many cells a box (a grid of n boxes has n)


def covered(parts: Sequence[ZRange], whole: ZRange) -> bool | None:
    """Whether `parts` together hold every cell of `whole`, by the grid their faces and whole's cut (the closed
    form of islpy's union and subset); None when that grid is too fine to count (`_grid_counts`)."""
    boxes = [b for b in (p.intersection(whole) for p in parts) if b is not None and not b.is_empty]
    if sum(b.size for b in boxes) < whole.size:
        return False
    starts = np.array([whole.start] + [b.start for b in boxes], dtype=np.int64).reshape(len(boxes) + 1, whole.ndim)
    ends = np.array([whole.end] + [b.end for b in boxes], dtype=np.int64).reshape(len(boxes) + 1, whole.ndim)
    counts = _grid_counts(starts, ends)
    return None if counts is None else bool((counts >= 2).all())  # whole itself is one of the boxes counted


def _grid_counts(starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """How many of the boxes (rows of `starts`, `ends`) cover each cell of the grid their faces cut, or None
    when that grid has more than GRID_CELLS_PER_BOX cells a box. Each box is a union of cells, so two boxes
    meet exactly where they share a cell: 512 devices' blocks are checked in 512 slice additions, not 512^2
    box pairs (20 ms a plan step on 8x8x8)."""
    cuts = [np.unique(np.concatenate([starts[:, d], ends[:, d]])) for d in range(starts.shape[1])]
    if math.prod(len(c) - 1 for c in cuts) > GRID_CELLS_PER_BOX * max(len(starts), 1):
        return None
    counts = np.zeros([max(len(c) - 1, 0) for c in cuts], np.int32)
    lows = np.stack([np.searchsorted(c, starts[:, d]) for d, c in enumerate(cuts)], axis=1) if cuts else starts
    highs = np.stack([np.searchsorted(c, ends[:, d]) for d, c in enumerate(cuts)], axis=1) if cuts else ends
    for low, high in zip(lows.tolist(), highs.tolist()):
        counts[tuple(map(slice, low, high))] += 1
    return counts


def _replace(p: Point, d: int, value: int) -> Point:
    return p[:d] + (value,) + p[d + 1 :]
