"""Communication time of a Reshard step: alpha-beta per mesh axis.

A Reshard is classified (sharding.collectives.classify_reshard) and priced by
the textbook ring formula for its collective, on the devices it spans. Simplifications:

- The devices are split into the groups of sharding.collectives.reshard_groups:
  along the fewest mesh axes in which each group holds all it needs. Every group
  runs its collective at once, on its own; p is the product of those axes' sizes,
  and each group's collective runs as one flat ring on the slowest of their links
  (largest alpha, smallest beta). No hierarchical decomposition within a group.
- n, the buffer of the collective, is the largest block on either side: the
  gathered block for all-gather, the pre-scatter block for reduce-scatter, the
  reduced block for all-reduce, the per-device buffer for all-to-all.
- General block moves (send_recv) use the exact volumes of sharding.comm: each
  device's time is its messages times alpha plus its received bytes over beta,
  and the step takes the slowest device's time.
- Bytes are elements times the size of the value's dtype (`Reshard.dtype`).
- A mesh with more devices than the profile's `cores` stretches every reshard by
  devices / cores, as it does compute (see DeviceProfile.oversubscription).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

from tapestry import dtypes
from tapestry.cost.profile import Link, Profile
from tapestry.kernels import Shape
from tapestry.plan.plan import Reshard, Step
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.collectives import Group, classify_reshard, local_layouts, reshard_groups
from tapestry.sharding.comm import received_counts
from tapestry.sharding.symmetry import Symmetries, relabellings

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
    """What a layout change is and moves, per device, and which mesh axes it crosses. The per-device counts are
    counted on first use, group by group, as the runtime moves them: pricing a collective needs none."""

    kind: str  # a sharding.collectives.Collective name
    axes: tuple[int, ...]
    groups: tuple[Group, ...]

    @cached_property
    def _counts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        devices = sum(len(g.ranks) for g in self.groups)
        received, messages = [0] * devices, [0] * devices
        for group in self.groups:
            local = local_layouts(group.src, group.dst)  # translations of one group share one count
            if local is None:
                continue
            for rank, cells, count in zip(group.ranks, *received_counts(*local[:2])):
                received[rank], messages[rank] = cells, count
        return tuple(received), tuple(messages)

    @property
    def received(self) -> tuple[int, ...]:
        """Elements each device receives."""
        return self._counts[0]

    @property
    def messages(self) -> tuple[int, ...]:
        """Messages each device receives."""
        return self._counts[1]


@lru_cache(maxsize=4096)
def moves(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Moves:
    """Cached: extraction prices the same layout pair for many e-nodes."""
    groups = reshard_groups(src, dst, shape, mesh)
    return Moves(str(classify_reshard(src, dst, shape, mesh)), groups[0].axes, groups)


@lru_cache(maxsize=8)
def _orbit_prices(links: tuple[Link, ...], mesh: Mesh) -> tuple[Symmetries, dict[tuple, float]]:
    """The mesh's symmetries under `links` (axes swapped only where their links are equal) and the reshard
    prices found so far, one per orbit."""
    def alike(a: int, b: int) -> bool:  # a profile with too few links fails later, in Profile.link
        return len(links) == 1 or max(a, b) < len(links) and links[a] == links[b]

    return Symmetries(mesh, relabellings(mesh, alike)), {}


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
        """Priced once per orbit of the layout pair under the mesh's symmetries (`sharding.symmetry`): pricing
        a 2x2x2 mesh's stack asks for ~92,000 distinct pairs, in fewer orbits."""
        symmetries, prices = _orbit_prices(self.profile.links, mesh)
        for src, dst in symmetries.pair_images(step.src_layout, step.layout, step.shape):
            price = prices.get((step.shape, step.dtype, src, dst))
            if price is not None:
                return price
        price = prices[(step.shape, step.dtype, step.src_layout, step.layout)] = self._priced(step, mesh)
        return price

    def _priced(self, step: Reshard, mesh: Mesh) -> float:
        moved = moves(step.src_layout, step.layout, step.shape, mesh)
        if moved.kind == "noop":
            return 0.0
        link = self.group_link(moved.axes)
        size = dtypes.itemsize(step.dtype)
        if moved.kind == "send_recv":
            return max(m * link.alpha + r * size / link.beta for m, r in zip(moved.messages, moved.received))
        p = math.prod(mesh.shape[a] for a in moved.axes)
        nbytes = size * max(_largest_block(step.src_layout), _largest_block(step.layout))
        return collective_time(moved.kind, nbytes, p, link)

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        """The reshard's time, stretched like compute when the mesh outnumbers the host's cores: the ranks'
        halves of every message are copied, packed and polled by processes that share them."""
        if not isinstance(step, Reshard):
            return 0.0
        return self.reshard_time(step, mesh) * self.profile.device.oversubscription(mesh.size)
