"""Communication time of a Reshard step: alpha-beta per mesh axis.

A Reshard is classified (sharding.collectives.classify_reshard) and priced by
the textbook ring formula for its collective, on the devices it spans. Simplifications:

- The devices are split into the groups of sharding.collectives.reshard_groups:
  along the fewest mesh axes in which each group holds all it needs. Every group
  runs its collective at once, on its own; p is the product of those axes' sizes.
- Each axis communicates over its link (`Profile.axis_links`: NVLink inside a node, InfiniBand across).
  A group over axes of one link runs one ring over all of them; over axes of different links, the
  hierarchical algorithm (`hierarchical_time`), one phase per link, fastest first: an all-reduce
  reduce-scatters inside the node, all-reduces the 1/p_node shard across nodes, and all-gathers inside
  again, NCCL's tree/ring two-level scheme. With equal links it moves what one flat ring moves, in fewer
  latency steps.
- n, the buffer of the collective, is the largest block on either side: the
  gathered block for all-gather, the pre-scatter block for reduce-scatter, the
  per-device buffer for all-to-all; for all-reduce, the reduced region (the
  destination's block: partial blocks that span more are sliced to it first).
- General block moves (send_recv) use the exact volumes of sharding.comm: each
  device's time is its messages times alpha plus its received bytes over beta,
  and the step takes the slowest device's time.
- Bytes are elements times the size of the value's dtype (`Reshard.dtype`).
- A mesh with more devices than the profile's `cores` stretches every reshard by
  devices / cores, as it does compute (see DeviceProfile.oversubscription).
- An expert-parallel Compute (`Compute.exchange`, plan.exchange) moves rows inside the step: all-to-alls along
  its exchange axes, each priced as the ring's p-1 latency steps (the counts, unless every member can count
  them itself; each of its rows' travelling inputs there; its output rows back, unless the rows are summed
  where the experts are, as grouped_mm_k's: `exchange_time`). The bytes are an even-routing estimate, the
  kernel's `Exchange.leaving` share of a device's rows: (p-1)/p for take_rows (each index names a row on a
  uniformly drawn device), none for grouped_mm and grouped_mm_k (their rows are sorted by expert, so a
  device's even row block is its experts' rows). The true counts are the data's, known only when it
  runs; routing imbalance moves a few rows the estimate leaves out.
- A ring-attention Compute (`Compute.ring`, plan.ring) passes key blocks round the ring inside the step: what its
  compute does not hide is priced by cost.ring.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from tapestry import dtypes
from tapestry.cost.profile import Link, Profile
from tapestry.cost.ring import ring_exposed_time
from tapestry.cost.roofline import Roofline
from tapestry.kernels import Shape
from tapestry.plan.exchange import out_rows, travels
from tapestry.plan.plan import Compute, Reshard, Step
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.collectives import Collective, Group, classify_reshard, local_layouts, reshard_groups
from tapestry.sharding.comm import clipped_pair, received_counts, received_floors
from tapestry.sharding.layout import split_dims
from tapestry.sharding.partition import exchange_imbalance
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


Phase = tuple[int, Link]  # devices and the link one phase of a hierarchical collective runs over


def phases(axes: Sequence[Phase]) -> list[Phase]:
    """The phases of a collective over mesh axes (size, link each): axes of one link merged into one ring, the
    fastest link first (it carries the largest buffer)."""
    merged: dict[Link, int] = {}
    for size, link in axes:
        merged[link] = merged.get(link, 1) * size
    return sorted(((p, link) for link, p in merged.items()), key=lambda pl: (-pl[1].beta, pl[1].alpha))


def hierarchical_time(kind: str, nbytes: float, levels: Sequence[Phase]) -> float:
    """Time of collective `kind` with an n-byte buffer run in phases (`phases`), fastest link first. All-gather
    and reduce-scatter shrink the buffer by each phase's devices (the fast phase moves all n bytes, the next
    n/p_fast); an all-reduce reduce-scatters down every phase but the last, all-reduces there and gathers back;
    an all-to-all sends the whole buffer's share once per phase. One phase is the ring formula itself."""
    if len(levels) == 1:
        return collective_time(kind, nbytes, *levels[0])
    if kind == "all_to_all":
        return sum(collective_time(kind, nbytes, p, link) for p, link in levels)
    if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"no hierarchical formula for {kind!r}")
    total, n = 0.0, float(nbytes)
    for p, link in levels[:-1]:
        if kind == "all_reduce":
            total += collective_time("reduce_scatter", n, p, link) + collective_time("all_gather", n, p, link)
        else:
            total += collective_time(kind, n, p, link)
        n /= p
    return total + collective_time(kind, n, *levels[-1])


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
        for group in self.groups:  # counted within the group's destination box: translations share one count
            for rank, cells, count in zip(group.ranks, *received_counts(group.src, group.dst)):
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


def moves(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Moves:
    """Not cached itself (`AlphaBeta.reshard_time` prices each pair once); found on the pair clipped to the box the
    destination's blocks span (`sharding.comm.clipped_pair`), where the moves from a fused value's many layouts into
    one of its footprints (a third, a half of it) are one pair: the groups, their axes and counts are the clipped
    pair's, and a group is a collective only where it was one before clipping (`_clipped_moves`)."""
    clipped = clipped_pair(src, dst)
    if clipped is None:
        groups = reshard_groups(src, dst, shape, mesh)
        return Moves(str(classify_reshard(src, dst, shape, mesh)), groups[0].axes, groups)
    return _clipped_moves(*clipped, mesh)


_KEPT = (Collective.NOOP, Collective.ALL_REDUCE)  # named the same on a clipped pair as on the pair itself


@lru_cache(maxsize=1 << 14)
def _clipped_moves(src: Layout, dst: Layout, shape: Shape, clipped: frozenset[int], mesh: Mesh) -> Moves:
    """The moves of a pair from the clipped pair (`src`, `dst`; `clipped`: the devices whose source block was
    clipped). Clipping keeps which cells each block holds inside the box, so which groups hold their needs, their
    axes, whether a group moves anything and what each device receives are the same. What it can change is the
    collective a group is named: one whose blocks, before clipping, spanned more than its destination blocks do
    has a destination that is no named layout of that span (neither R nor a split), so it moves as send_recv; a
    group none of whose source blocks was clipped is the same pair moved, named as before. An all-reduce is named
    by its destination alone (one region on every device, `collectives._classify`), so it stays one."""
    groups = tuple(Group(g.ranks, g.src, g.dst, g.axes, Collective.SEND_RECV)  # not `replace`: once per group
                   if g.kind not in _KEPT and not clipped.isdisjoint(g.ranks) else g
                   for g in reshard_groups(src, dst, shape, mesh))
    kinds = {g.kind for g in groups} - {Collective.NOOP}
    kind = kinds.pop() if len(kinds) == 1 else Collective.SEND_RECV if kinds else Collective.NOOP
    return Moves(str(kind), groups[0].axes, groups)


@dataclass(frozen=True)
class Least:
    """A pair of splits (`Layout.split`, either partial) as the same pair on its least shape: each dim that the
    two layouts' pieces along it (their least common multiple) divide shrunk to that multiple, the others kept.
    Along a shrunk dim every block boundary of the pair is the least pair's times the dim's factor, and along a
    kept one it is the least pair's, so which cells each device holds, needs and receives are the least pair's,
    scaled: the groups, their axes and collectives and each device's messages are the same, and the cells
    received `cells` times as many (the factors' product)."""

    src: Layout
    dst: Layout
    shape: Shape
    cells: int  # cells of the shape per cell of the least shape


def least_pair(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Least | None:
    """The pair on its least shape (`Least`), or None where either layout is no split or the shape is its own
    least."""
    dims = (split_dims(shape, mesh, src), split_dims(shape, mesh, dst))
    if dims[0] is None or dims[1] is None:
        return None
    least = [1] * len(shape)
    for split in dims:
        pieces = [1] * len(shape)
        for axis, d in enumerate(split):
            if d is not None:
                pieces[d] *= mesh.shape[axis]
        least = [math.lcm(a, b) for a, b in zip(least, pieces)]
    small = tuple(m if n % m == 0 else n for n, m in zip(shape, least))
    if small == tuple(shape):
        return None
    return Least(_split(small, mesh, dims[0], src.partial), _split(small, mesh, dims[1], dst.partial), small,
                 math.prod(shape) // math.prod(small))


@lru_cache(maxsize=1 << 12)
def _split(shape: Shape, mesh: Mesh, dims: tuple[int | None, ...], partial: bool) -> Layout:
    """`Layout.split` (replicated where no dim splits), made once."""
    layout = Layout.replicated(shape, mesh) if all(d is None for d in dims) else Layout.split(shape, mesh, dims)
    return Layout(layout.blocks, partial)


@lru_cache(maxsize=1 << 12)
def _least_moves(src: Layout, dst: Layout, shape: Shape, mesh: Mesh) -> Moves:
    """`moves` of a least pair (`Least`): the few least pairs stand for the many even pairs of a model's shapes."""
    return moves(src, dst, shape, mesh)


@lru_cache(maxsize=8)
def _orbit_prices(links: tuple[Link, ...], mesh: Mesh) -> tuple[Symmetries, dict[tuple, float]]:
    """The mesh's symmetries under `links` (axes swapped only where their links are equal) and the reshard
    prices found so far, one per orbit."""
    def alike(a: int, b: int) -> bool:  # a profile with too few links fails later, in Profile.link
        return len(links) == 1 or max(a, b) < len(links) and links[a] == links[b]

    return Symmetries(mesh, relabellings(mesh, alike)), {}


def translated(step: Reshard) -> Reshard:
    """The reshard moved to the box its blocks span (`collectives.local_layouts`), that box its shape. It costs
    what `step` costs: groups, collectives, transfers and block sizes depend only on where blocks lie relative
    to one another (tests/test_mesh_symmetry.py prices both); a pair holding nothing stays as it is."""
    local = local_layouts(step.src_layout, step.layout)
    if local is None or (local[0] is step.src_layout and local[2] == step.shape):
        return step
    src, dst, shape = local
    return Reshard(step.out, step.src, shape, src, dst, step.dtype)  # not `replace`: asked once per reshard priced


def _slowest(links: tuple[Link, ...], axes: tuple[int, ...]) -> Link:
    """The slowest of the links of `axes` (largest alpha, smallest beta)."""
    return Link(max(links[a].alpha for a in axes), min(links[a].beta for a in axes))


def _largest_block(layout: Layout) -> int:
    return max((b.size for b in layout.blocks if b is not None), default=0)


@dataclass(frozen=True)
class AlphaBeta:
    """Prices Reshard steps; every other step is free here (see Roofline for Compute)."""

    profile: Profile

    def group_link(self, axes: tuple[int, ...], mesh: Mesh) -> Link:
        """The slowest link among `axes` (largest alpha, smallest beta): what a general block move waits for."""
        return _slowest(self.profile.axis_links(mesh.shape), axes)

    def reshard_time(self, step: Reshard, mesh: Mesh) -> float:
        """Priced once per orbit of the layout pair under the mesh's symmetries (`sharding.symmetry`): pricing
        a 2x2x2 mesh's stack asks for ~92,000 distinct pairs, in fewer orbits. The pair is first moved to the box
        its blocks span (`translated`): a price reads only blocks relative to one another, so the pairs of
        layouts that hold only what a reader reads (the q, k and v thirds of a fused projection's output, a
        rotary half) are priced once, not once per place in the tensor."""
        step = translated(step)
        links = self.profile.axis_links(mesh.shape)
        symmetries, prices = _orbit_prices(links, mesh)
        for src, dst in symmetries.pair_images(step.src_layout, step.layout, step.shape):
            price = prices.get((step.shape, step.dtype, src, dst))
            if price is not None:
                return price
        # a pair of splits is priced from its least shape's pair, which the pairs of other shapes share
        least = least_pair(step.src_layout, step.layout, step.shape, mesh)
        price = prices[(step.shape, step.dtype, step.src_layout, step.layout)] = self._priced(step, mesh, links, least)
        return price

    def _priced(self, step: Reshard, mesh: Mesh, links: tuple[Link, ...] | None = None,
                least: Least | None = None) -> float:
        """The reshard's time, its mesh's axes over `links` (default: the profile's for `mesh`), its moves found
        on `least` (its pair on the least shape, `least_pair`) where given."""
        links = self.profile.axis_links(mesh.shape) if links is None else links
        moved = moves(step.src_layout, step.layout, step.shape, mesh) if least is None else \
            _least_moves(least.src, least.dst, least.shape, mesh)
        if moved.kind == "noop":
            return 0.0
        size = dtypes.itemsize(step.dtype)
        if moved.kind == "send_recv":
            link = _slowest(links, moved.axes)
            cells = 1 if least is None else least.cells
            return max(m * link.alpha + r * cells * size / link.beta for m, r in zip(moved.messages, moved.received))
        # an all-reduce sums the region its destination names, whatever the partial blocks span
        largest = _largest_block(step.layout) if moved.kind == "all_reduce" else \
            max(_largest_block(step.src_layout), _largest_block(step.layout))
        nbytes = size * largest
        return hierarchical_time(moved.kind, nbytes, phases([(mesh.shape[a], links[a]) for a in moved.axes]))

    def reshard_floors(self, steps: Sequence[Reshard], mesh: Mesh) -> np.ndarray:
        """A lower bound on `step_cost` of each reshard, all at once and with no move planned
        (`sharding.comm.received_floors`: the cells and messages each device receives at least; 0 where no floor
        is claimed). Each device's floor is its messages' latency on the fastest link plus half its cells over
        the fastest bandwidth; the step's, the largest. It holds for every way a move is priced: a send/recv is
        the slowest device's messages times alpha plus its cells over beta; a collective of p devices (an n-byte
        buffer, n at least the largest block) takes p - 1 latency steps, at least as many as any member has
        senders, and moves at least (p - 1)/p >= 1/2 of n across a link. Where the mesh's axes have different
        links a hierarchical collective takes fewer steps (a phase per link), so one message is counted then.
        tests/test_extractor_pricing.py checks it against prices."""
        if not steps:
            return np.zeros(0)
        cells, messages = received_floors([(step.src_layout, step.layout) for step in steps])
        links = self.profile.axis_links(mesh.shape)
        alpha, beta = min(link.alpha for link in links), max(link.beta for link in links)
        if len(set(links)) > 1:
            messages = np.minimum(messages, 1)
        sizes = np.array([dtypes.itemsize(step.dtype) for step in steps], np.float64)
        floors = (messages * alpha + 0.5 * cells * sizes[:, None] / beta).max(axis=1, initial=0.0)
        return floors * self.profile.device.oversubscription(mesh.size)

    def exchange_time(self, step: Compute, mesh: Mesh) -> float:
        """An expert-parallel step's all-to-alls (see the module doc) along its exchange axes: the counts, the
        largest block of each travelling input there and the largest output block back, of which the kernel's
        `Exchange.leaving` share crosses links (the slowest link of the axes), scaled by what the busiest device
        receives where the experts split unevenly (`exchange_imbalance`)."""
        sig = step.signature
        moving = [(layout, d) for layout, d, dim in zip(step.arg_layouts, sig.input_dtypes, travels(sig))
                  if dim is not None]
        there = sum(dtypes.itemsize(d) * _largest_block(layout) for layout, d in moving)
        returning = out_rows(sig) is not None  # grouped_mm_k's sums stay with the experts
        back = dtypes.itemsize(sig.dtype) * _largest_block(step.layout) if returning else 0
        p = step.exchange_group or math.prod(mesh.shape[a] for a in step.exchange)
        link = self.group_link(step.exchange, mesh)
        calls = (0 if sig.kernel.exchange.counted else 1) + len(moving) + returning
        busiest = exchange_imbalance(sig, step.blocks, step.exchange, mesh, step.exchange_group)
        return calls * (p - 1) * link.alpha + sig.kernel.exchange.leaving(p) * busiest * (there + back) / link.beta

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        """The reshard's (or an expert-parallel step's all-to-alls') time, stretched like compute when the mesh
        outnumbers the host's cores: the ranks' halves of every message are copied, packed and polled by
        processes that share them."""
        if isinstance(step, Compute) and step.exchange:
            return self.exchange_time(step, mesh) * self.profile.device.oversubscription(mesh.size)
        if isinstance(step, Compute) and step.ring:  # its sends, less what its compute hides (cost.ring)
            exposed = ring_exposed_time(step, mesh, self.group_link(step.ring, mesh), Roofline(self.profile.device))
            return exposed * self.profile.device.oversubscription(mesh.size)
        if not isinstance(step, Reshard):
            return 0.0
        return self.reshard_time(step, mesh) * self.profile.device.oversubscription(mesh.size)
