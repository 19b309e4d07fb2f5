"""Communication time of a Reshard step: alpha-beta per mesh axis.

A Reshard is classified (sharding.collectives.classify_reshard) and priced by
the textbook ring formula for its collective, on the devices it spans. Simplifications:

- The group is every mesh axis along which neighbouring devices hold different
  source or target blocks, or overlapping partial blocks that must be summed;
  p is the product of their sizes, and the whole collective runs as one flat ring on the slowest of their
  links (largest alpha, smallest beta). No hierarchical (per-axis) decomposition.
- n, the buffer of the collective, is the largest block on either side: the
  gathered block for all-gather, the pre-scatter block for reduce-scatter, the
  reduced block for all-reduce, the per-device buffer for all-to-all.
- General block moves (send_recv) use the exact volumes of sharding.comm: each
  device's time is its messages times alpha plus its received bytes over beta,
  and the step takes the slowest device's time.
- Values are float32 (4 bytes per element), as the kernels' byte formulas assume.
- A mesh with more devices than the profile's `cores` stretches every reshard by
  devices / cores, as it does compute (see DeviceProfile.oversubscription).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from tapestry.cost.profile import Link, Profile
from tapestry.kernels import Shape
from tapestry.plan.plan import Reshard, Step
from tapestry.sharding import Block, Layout, Mesh
from tapestry.sharding.collectives import classify_reshard
from tapestry.sharding.comm import received_counts

BYTES_PER_ELEMENT = 4

# collective: p -> (alpha terms, fraction of the n-byte buffer crossing each device's link)
RING: dict[str, Callable[[int], tuple[int, float]]] = {
    "all_gather": lambda p: (p - 1, (p - 1) / p),
    "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
    "all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    "all_to_all": lambda p: (p - 1, (p - 1) / p),
}


def collective_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    """Ring time of collective `kind` over p devices with an n-byte buffer; 0 for one device."""
    if kind not in RING:
        raise ValueError(f"no ring formula for {kind!r}; known: {', '.join(RING)}")
    if p <= 1:
        return 0.0
    steps, fraction = RING[kind](p)
    return steps * link.alpha + fraction * nbytes / link.beta


@dataclass(frozen=True)
class Moves:
    """What a layout change is and moves, per device, and which mesh axes it crosses."""

    kind: str  # a sharding.collectives.Collective name
    received: tuple[int, ...]  # elements
    messages: tuple[int, ...]
    axes: tuple[int, ...]


@lru_cache(maxsize=4096)
def moves(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Moves:
    """Cached: extraction prices the same layout pair for many e-nodes."""
    received, messages = received_counts(src, dst)
    kind = str(classify_reshard(src, dst, shape, mesh))
    return Moves(kind, received, messages, spanned_axes(src, dst, mesh))


def spanned_axes(src: Layout, dst: Layout, mesh: Mesh) -> tuple[int, ...]:
    """Mesh axes the layout change must communicate along, judged from the layouts alone
    (transfers picks sources by ring order, which may cross axes needlessly)."""

    def differ(j: int, k: int) -> bool:
        a, b = src.blocks[j], src.blocks[k]
        return a != b or dst.blocks[j] != dst.blocks[k] or (src.partial and _overlap(a, b))

    stride = [math.prod(mesh.shape[i + 1 :]) for i in range(mesh.ndim)]
    return tuple(
        axis for axis in range(mesh.ndim)
        if any(differ(d, d + stride[axis]) for d in mesh.devices if mesh.coords(d)[axis] + 1 < mesh.shape[axis])
    )


def _overlap(a: Block, b: Block) -> bool:
    inside = None if a is None or b is None else a.intersection(b)
    return inside is not None and not inside.is_empty


def _largest_block(layout: Layout) -> int:
    return max((b.size for b in layout.blocks if b is not None), default=0)


@dataclass(frozen=True)
class AlphaBeta:
    """Prices Reshard steps; every other step is free here (see Roofline for Compute)."""

    profile: Profile

    def group_link(self, axes: tuple[int, ...]) -> Link:
        links = [self.profile.link(a) for a in axes]
        return Link(max(k.alpha for k in links), min(k.beta for k in links))

    def reshard_time(self, step: Reshard, mesh: Mesh) -> float:
        moved = moves(step.src_layout, step.layout, step.shape, mesh)
        if moved.kind == "noop":
            return 0.0
        link = self.group_link(moved.axes)
        if moved.kind == "send_recv":
            return max(
                m * link.alpha + r * BYTES_PER_ELEMENT / link.beta for m, r in zip(moved.messages, moved.received)
            )
        p = math.prod(mesh.shape[a] for a in moved.axes)
        nbytes = BYTES_PER_ELEMENT * max(_largest_block(step.src_layout), _largest_block(step.layout))
        return collective_time(moved.kind, nbytes, p, link)

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        """The reshard's time, stretched like compute when the mesh outnumbers the host's cores: the ranks'
        halves of every message are copied, packed and polled by processes that share them."""
        if not isinstance(step, Reshard):
            return 0.0
        return self.reshard_time(step, mesh) * self.profile.device.oversubscription(mesh.size)
