"""A device mesh: devices numbered row-major over named axes."""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from tapestry.zspace.zrange import as_point


@dataclass(frozen=True)
class Mesh:
    """`Mesh(4)` is four devices in a line; `Mesh(2, 2)` a 2×2 grid."""

    shape: tuple[int, ...]

    def __init__(self, *shape: int | tuple[int, ...]) -> None:
        given = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        try:
            dims = as_point(given)  # 2.7 devices is refused, not truncated
        except TypeError:
            raise ValueError(f"a mesh's axes are whole numbers of devices, got {list(given)}") from None
        if not dims or any(d < 1 for d in dims):
            raise ValueError(f"a mesh needs one or more axes of size >= 1, got {list(dims)}")
        object.__setattr__(self, "shape", dims)

    def __hash__(self) -> int:
        """The dataclass's hash, computed once: pricing's caches are keyed by the mesh (~130,000 times pricing
        LLaMA's reshards on 2x2)."""
        try:
            return self._hash  # type: ignore[attr-defined]
        except AttributeError:
            cached = hash((self.shape,))
            object.__setattr__(self, "_hash", cached)
            return cached

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """'4' or '2x2'."""
        try:
            return cls(*(int(p) for p in text.lower().split("x")))
        except ValueError:
            raise ValueError(f"mesh {text!r} is not like '4' or '2x2'") from None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def coords(self, device: int) -> tuple[int, ...]:
        """Row-major: the last axis varies fastest."""
        return self._coords[device]

    @functools.cached_property
    def _coords(self) -> tuple[tuple[int, ...], ...]:
        """Every device's coordinates, made once: partitions and layouts of a 64-device mesh ask ~100,000 times."""
        return tuple(itertools.product(*(range(size) for size in self.shape)))

    @property
    def devices(self) -> range:
        return range(self.size)

    def fibres(self, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The groups of devices that differ only along `axes`: one per setting of the other axes' coordinates,
        each in device order. `fibres(())` is every device alone; all axes, the whole mesh."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for device in self.devices:
            coords = self.coords(device)
            groups.setdefault(tuple(c for a, c in enumerate(coords) if a not in axes), []).append(device)
        return [tuple(g) for g in groups.values()]

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))

    def to_json(self) -> list[int]:
        return list(self.shape)
