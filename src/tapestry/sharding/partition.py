"""Candidate index partitions of one kernel over a mesh, and the layouts they imply.

A partition gives each device an index block (None: the device idles). Each
mesh axis either splits one index dim evenly, or several at once (a
factorization of its size: batch 4 x sequence 2 on 8 devices), or replicates
the work. Candidates factor an axis over two dims only where the parts divide
both dims, which keeps the e-graph's growth in check. Splitting
a reduction dim makes the output Partial; doing that while another axis
replicates would count partials twice, so that combination is not generated.

A kernel with an exchange (`Kernel.exchange`: MoE's grouped_mm, rows and experts) also gets expert-parallel
candidates: one mesh axis splits its rows and its experts together, device j of the axis taking row block j and
expert block j, and the kernel moves each row to the device of its expert and back (an all-to-all inside the
step). Its output is then whole, not partial: every row meets all the experts of the axis (grouped_mm_k, the
weight gradient: every expert's sum meets all its rows, and nothing moves back). Where the experts do not divide an
axis but a group of it does (Qwen2-MoE's 60 experts on a node of 8: groups of 4), the axis is viewed as
(axis // group) x group: the exchange trades within each run of `group` devices (`Partition.exchange_group`), and
the outer part splits other dims (data parallel between the groups) or replicates.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from tapestry import zspace
from tapestry.kernels import DimKind, Signature
from tapestry.kernels.ring import key_extent, key_region, travels
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
    exchange: tuple[int, ...] = ()  # mesh axes splitting the kernel's exchange dims together (expert parallel)
    ring: tuple[int, ...] = ()  # mesh axes splitting queries and keys together (ring attention, `Kernel.ring`)
    keys: tuple[tuple[int, int], ...] = ()  # under a ring: each device's key block [start, end)
    balanced: bool = False  # a ring whose query blocks are cut for equal work, not equal size (causal attention)
    # devices an exchange trades among along its one axis, where fewer than the axis: runs of as many consecutive
    # devices, the axis's split the outer part's dims then the exchange's pair (`exchange_groups`); 0: whole axes
    exchange_group: int = 0

    def name(self, sig: Signature) -> str:
        if not any(self.axes):
            return "replicate"
        return "split(" + ",".join(_exchange_name(sig, split, self.exchange_group) if axis in self.exchange
                                   else "ring:" + _split_name(sig, split) + ("~work" if self.balanced else "")
                                   if axis in self.ring
                                   else _split_name(sig, split) for axis, split in enumerate(self.axes)) + ")"

    def dims(self) -> set[int]:
        """The index dims split over some mesh axis."""
        return {dim for split in self.axes for dim, _ in split}

    def summed_dims(self) -> set[int]:
        """The split dims whose blocks leave partial sums: all but an exchange's, whose rows meet every expert
        (grouped_mm's experts, grouped_mm_k's rows: the exchange makes each sum whole on one member); an exchange
        axis's outer part (between its groups) sums as any other axis."""
        return {dim for axis, split in enumerate(self.axes)
                for dim, _ in (split[:-2] if axis in self.exchange else split)}


def _exchange_name(sig: Signature, split: Split, group: int) -> str:
    outer = _split_name(sig, split[:-2]) + "×" if split[:-2] else ""
    return outer + "ep" + (f"/{group}" if group else "") + ":" + "=".join(sig.dims[d] for d, _ in split[-2:])


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


# distinct blocks `make_partition` keeps (`_kept_blocks`): one set is a tuple of a block per device, 4 KB on 512
BLOCKS_KEPT = 4096


def make_partition(sig: Signature, mesh: Mesh, axes: tuple[AxisChoice, ...], exchange: tuple[int, ...] = (),
                   ring: tuple[int, ...] = (), exchange_group: int = 0) -> Partition:
    """Split index dim `axes[i]` evenly over mesh axis i (None: not split over it), or several dims at once:
    `axes[i]` = ((dim, parts), ...) with the parts multiplying to the axis size, the first dim major. A mesh axis in
    `exchange` splits the kernel's exchange dims (rows, experts) together, whatever `axes` says for it; with an
    `exchange_group` (one exchange axis, the group dividing it) only within runs of that many devices, `axes` saying
    what the axis's outer part (axis size // group) splits. The mesh axes in `ring` must split the kernel's queries
    alone: they split its keys too (another axis splitting the queries leaves the keys whole along it)."""
    if len(axes) != mesh.ndim:
        raise ValueError(f"axes {axes} name {len(axes)} mesh axes; the mesh {mesh.shape} has {mesh.ndim}")
    if exchange and sig.kernel.exchange is None:
        raise ValueError(f"{sig.kernel.name} has no exchange: its experts cannot split with its rows")
    splits = _splits(sig, mesh, axes, tuple(exchange), exchange_group)
    rank = len(sig.index.shape)
    if any(not 0 <= dim < rank for split in splits for dim, _ in split):
        raise ValueError(f"axes {axes}: the index space {list(sig.index.shape)} has dims 0..{rank - 1}")
    ring = tuple(sorted(ring))
    keys = _ring_check(sig, mesh, splits, ring) if ring else ()
    return Partition(_kept_blocks(sig.index, mesh, splits, tuple(exchange)), splits, tuple(sorted(exchange)), ring,
                     keys, exchange_group=exchange_group)


def _splits(sig: Signature, mesh: Mesh, axes: tuple[AxisChoice, ...], exchange: tuple[int, ...], group: int
            ) -> tuple[Split, ...]:
    """Each mesh axis's split: an exchange axis's ends with the pair (rows, experts), each in as many parts as its
    group has devices (the whole axis, or `group`), after what its outer part splits (`axes`' choice there)."""
    if group and (len(exchange) != 1 or not 1 < group < mesh.shape[exchange[0]]
                  or mesh.shape[exchange[0]] % group):
        raise ValueError(f"an exchange in groups of {group} devices needs one exchange axis the group divides "
                         f"(and is smaller than): exchange axes {list(exchange)} of mesh {mesh.shape}")
    ex = sig.kernel.exchange
    together = (sig.dims.index(ex.rows), sig.dims.index(ex.experts)) if ex is not None else ()
    found = []
    for axis, (choice, size) in enumerate(zip(axes, mesh.shape)):
        if axis not in exchange:
            found.append(_normal(choice, size))
        else:
            members = group or size
            outer = _normal(choice, size // members) if group else ()
            found.append(outer + tuple((d, members) for d in together))
    return tuple(found)


def device_blocks(index: ZRange, mesh: Mesh, splits: tuple[Split, ...], exchange: Iterable[int] = ()
                  ) -> tuple[Block, ...]:
    """Each device's block of `index` (None where empty): each mesh axis cuts the dims of its split evenly
    (`ZRange.split_even`), the axes in order, within an axis by mixed radix (the last dim varies fastest); an
    `exchange` axis's device j takes piece j of each of its dims. Each distinct block is made once."""
    if not any(splits):
        return (_non_empty(index),) * mesh.size
    starts, ends = _device_bounds(index, mesh, splits, tuple(exchange))
    # distinct blocks by their bounds in a dict: np.unique(axis=0) sorted the rows first, in 2.6 times the CPU
    # (device_blocks of 3-d index spaces split over Mesh(2, 2), (4), (2, 2, 2) and (8, 8))
    made: dict[tuple[tuple[int, ...], tuple[int, ...]], Block] = {}
    blocks = []
    for bounds in zip(map(tuple, starts.tolist()), map(tuple, ends.tolist())):
        if bounds not in made:
            made[bounds] = None if any(map(operator.eq, *bounds)) else ZRange._checked(*bounds)
        blocks.append(made[bounds])
    return tuple(blocks)


@functools.lru_cache(maxsize=BLOCKS_KEPT)
def _kept_blocks(index: ZRange, mesh: Mesh, splits: tuple[Split, ...], exchange: tuple[int, ...]
                 ) -> tuple[Block, ...]:
    """`device_blocks`, made once per distinct arguments among the last BLOCKS_KEPT (blocks are immutable): a
    model's layers repeat a few index spaces and splits, so a hand plan (training.plans.baselines) asks for the same
    512 blocks op after op on 8x8x8."""
    return device_blocks(index, mesh, splits, exchange)


def _device_bounds(index: ZRange, mesh: Mesh, splits: tuple[Split, ...], exchange: tuple[int, ...]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends), (devices, dims) arrays: `device_blocks` worked out for all devices at once, dim by dim
    (device by device, 512 devices' blocks of 7,000 candidates were all of generation's budget)."""
    coords = _coordinates(mesh.shape)
    starts = np.tile(np.array(index.start, np.int64), (mesh.size, 1))
    ends = np.tile(np.array(index.end, np.int64), (mesh.size, 1))
    for axis, split in enumerate(splits):
        coord = coords[:, axis]
        if axis in exchange:  # device j of a group: row block j and expert block j, within the outer part's block
            coord, member = np.divmod(coord, split[-1][1])
            cuts = _digits(split[:-2], coord)
            cuts += [(dim, parts, member) for dim, parts in split[-2:]]
        else:
            cuts = _digits(split, coord)
        for dim, parts, piece in cuts:
            q, rem = np.divmod(ends[:, dim] - starts[:, dim], parts)  # sizes q + 1 (the first rem pieces), q
            starts[:, dim] += piece * q + np.minimum(piece, rem)
            ends[:, dim] = starts[:, dim] + q + (piece < rem)
    return starts, ends


def _digits(split: Split, coord: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(dim, parts, each device's piece) of an axis's split by mixed radix (the last dim fastest), in the order
    `_device_bounds` cuts them."""
    found = []
    for dim, parts in reversed(split):
        coord, piece = np.divmod(coord, parts)
        found.append((dim, parts, piece))
    return found


@functools.lru_cache(maxsize=64)
def _coordinates(shape: tuple[int, ...]) -> np.ndarray:
    """(devices, axes): every device's mesh coordinates, row-major as `Mesh.coords`."""
    return np.indices(shape).reshape(len(shape), -1).T.copy()


def ring_keys(extent: int, mesh: Mesh, axes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Each device's key block [start, end) when mesh `axes` split `extent` keys, in axis order as they split the
    queries: device j of a ring holds key block j, beside query block j."""
    found = []
    for device in mesh.devices:
        block = ZRange((0,), (extent,))
        for axis in axes:
            block = _pieces(block, 0, mesh.shape[axis])[mesh.coords(device)[axis]]
        found.append((block.start[0], block.end[0]))
    return tuple(found)


def _ring_check(sig: Signature, mesh: Mesh, splits: tuple[Split, ...], ring: tuple[int, ...]
                ) -> tuple[tuple[int, int], ...]:
    if sig.kernel.ring is None:
        raise ValueError(f"{sig.kernel.name} has no ring: its keys cannot split")
    if sig.kernel.ring.rows not in sig.dims:
        raise ValueError(f"{sig.kernel.name} on {[list(s) for s in sig.input_shapes]} has no {sig.kernel.ring.rows!r} "
                         f"index dim (its queries and keys differ in number): its keys cannot split")
    rows = sig.dims.index(sig.kernel.ring.rows)
    for axis, split in enumerate(splits):
        if axis in ring and split != ((rows, mesh.shape[axis]),):
            raise ValueError(f"ring axis {axis} must split {sig.kernel.ring.rows!r} alone, not {list(split)}")
    return ring_keys(key_extent(sig), mesh, ring)


def exchange_groups(mesh: Mesh, exchange: tuple[int, ...], group: int = 0) -> list[tuple[int, ...]]:
    """The groups of devices an exchange trades among, each in member order: the fibres along its axes, or with a
    `group` (one axis) each such fibre cut into runs of `group` consecutive devices (an axis of 8, groups of 4:
    its first four devices and its last four)."""
    fibres = mesh.fibres(exchange)
    if not group:
        return fibres
    return [fibre[i:i + group] for fibre in fibres for i in range(0, len(fibre), group)]


def exchanged_blocks(sig: Signature, blocks: tuple[Block, ...], exchange: tuple[int, ...], mesh: Mesh,
                     group: int = 0) -> tuple[Block, ...]:
    """The index blocks an exchange step covers, a partition of the index space as a plain step's blocks are:
    each device's rows with every expert of its group along the exchange axes (its own computed here, the
    others' on their devices) where the output follows the rows (grouped_mm, take_rows); each device's experts
    with every row of its group (sent to it) where the rows are summed (grouped_mm_k, whose rows another axis
    may split: data parallel, the sums partial over it). `group`: as `exchange_groups`."""
    if not exchange:
        return blocks
    widened = sig.kernel.exchange.experts if returns(sig) else sig.kernel.exchange.rows
    return _widened(blocks, sig.dims.index(widened), exchange_groups(mesh, exchange, group))


def exchange_work(sig: Signature, blocks: tuple[Block, ...], exchange: tuple[int, ...], mesh: Mesh,
                  group: int = 0) -> tuple[Block, ...]:
    """The index block whose FLOPs each device of an exchange step does under even routing: its experts with
    every row of its group, whichever way the results go. Where the experts split unevenly (60 over 8 devices:
    8 on some, 7 on others) the busiest device meets more rows than its own with every expert (what
    `exchanged_blocks` covers for grouped_mm), and the step waits for it. `group`: as `exchange_groups`."""
    if not exchange:
        return blocks
    return _widened(blocks, sig.dims.index(sig.kernel.exchange.rows), exchange_groups(mesh, exchange, group))


def exchange_imbalance(sig: Signature, blocks: tuple[Block, ...], exchange: tuple[int, ...], mesh: Mesh,
                       group: int = 0) -> float:
    """How many times its even share of its group's rows the busiest device of an exchange step receives (and,
    where the results return, sends back) under even routing: its experts' share of its group's, times the
    group's size; 1 where the experts split evenly (60 experts over 8 devices: 8 / 7.5)."""
    experts = sig.dims.index(sig.kernel.exchange.experts)
    most = 1.0
    for group_devices in exchange_groups(mesh, exchange, group):
        members = [blocks[k] for k in group_devices if blocks[k] is not None and not blocks[k].is_empty]
        held = max(b.end[experts] for b in members) - min(b.start[experts] for b in members) if members else 0
        if held:
            most = max(most, max(b.shape[experts] for b in members) * len(group_devices) / held)
    return most


def _widened(blocks: tuple[Block, ...], dim: int, groups: list[tuple[int, ...]]) -> tuple[Block, ...]:
    """Each device's block with `dim` widened to the span of its group's blocks there."""
    found = list(blocks)
    for group_devices in groups:
        members = [blocks[k] for k in group_devices if blocks[k] is not None]
        if not members:
            continue
        lo, hi = min(b.start[dim] for b in members), max(b.end[dim] for b in members)
        for k in group_devices:
            b = blocks[k]
            if b is not None:
                found[k] = ZRange(b.start[:dim] + (lo,) + b.start[dim + 1:], b.end[:dim] + (hi,) + b.end[dim + 1:])
    return tuple(found)


def returns(sig: Signature) -> bool:
    """Whether an exchange kernel's output follows its rows, so results go back to the rows' devices (grouped_mm,
    take_rows); else the rows are summed where their experts are, and nothing returns (grouped_mm_k)."""
    rows = sig.dims.index(sig.kernel.exchange.rows)
    return any(row[rows] for row in sig.output.matrix)


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


@dataclass(frozen=True)
class Candidate:
    """A candidate partition whose blocks are made only when asked for (`partition`): on 512 devices making
    every candidate's blocks took all of generation's budget, where a budget-stopped generation inserts few."""

    axes: tuple[Split, ...]
    busy: int  # distinct non-empty blocks: devices doing different work (`generation_order`)
    idles: bool  # some device's block is empty
    exchange: tuple[int, ...] = ()
    ring: tuple[int, ...] = ()
    made: Partition | None = None  # a ring balanced for work comes made (`balance_ring`)
    exchange_group: int = 0

    def dims(self) -> set[int]:
        """The index dims split over some mesh axis."""
        return {dim for split in self.axes for dim, _ in split}

    def partition(self, sig: Signature, mesh: Mesh) -> Partition:
        if self.made is not None:
            return self.made
        if self.exchange_group:  # `axes` holds the exchange axis's whole split: its outer part is the choice
            outer = tuple(split[:-2] if axis in self.exchange else split for axis, split in enumerate(self.axes))
            return make_partition(sig, mesh, outer, self.exchange, self.ring, self.exchange_group)
        return make_partition(sig, mesh, self.axes, self.exchange, self.ring)


def _candidate(sig: Signature, mesh: Mesh, axes: tuple[AxisChoice, ...], exchange: tuple[int, ...] = (),
               group: int = 0) -> tuple[bytes, Candidate]:
    """(what tells its blocks apart: equal exactly when the blocks are, the candidate), from the bounds alone."""
    splits = _splits(sig, mesh, axes, exchange, group)
    starts, ends = _device_bounds(sig.index, mesh, splits, exchange)
    empty = (starts == ends).any(axis=1)
    starts[empty], ends[empty] = -1, -1  # every empty block is None
    code = np.zeros(mesh.size, np.int64)
    for dim in range(starts.shape[1]):  # each device's block as one number: its pieces' ranks, mixed radix
        pieces, rank = np.unique(starts[:, dim] * (sig.index.end[dim] + 2) + ends[:, dim], return_inverse=True)
        code = code * len(pieces) + rank.reshape(-1)
    busy = len(np.unique(code[~empty])) if starts.shape[1] else 1
    return starts.tobytes() + ends.tobytes(), Candidate(splits, busy, bool(empty.any()), exchange,
                                                        exchange_group=group)


def candidates(sig: Signature, mesh: Mesh) -> list[Candidate]:
    """Every even split of splittable dims over mesh axes (several dims at once by factorizations of an
    axis), plus replicated computation; each distinct block assignment once, its blocks not yet made."""
    reductions = set(sig.dims_of(DimKind.REDUCTION))
    found: dict[bytes, Candidate] = {}
    for axes in itertools.product(*(_axis_choices(sig, size) for size in mesh.shape)):
        splits_reduction = any(d in reductions for split in axes for d, _ in split)
        if splits_reduction and any(not split for split in axes):
            continue
        key, candidate = _candidate(sig, mesh, axes)
        found.setdefault(key, candidate)
    return list(found.values()) + _exchange_partitions(sig, mesh) + _ring_partitions(sig, mesh, found.values())


def replicated_candidate(sig: Signature, mesh: Mesh) -> Candidate:
    """Every device computing the whole index space."""
    return _candidate(sig, mesh, (None,) * mesh.ndim)[1]


def candidate_partitions(sig: Signature, mesh: Mesh) -> list[Partition]:
    """`candidates`, made."""
    return [candidate.partition(sig, mesh) for candidate in candidates(sig, mesh)]


def _gradient_ring_bases(sig: Signature, mesh: Mesh) -> list[Candidate]:
    """A gradient ring's rows are not splittable (`Signature.splittable`): the partitions its rings start from are
    the splittable ones with some mesh axes splitting the rows instead."""
    rows = sig.dims.index(sig.kernel.ring.rows)
    options = [[*_axis_choices(sig, size), *([((rows, size),)] if sig.index.shape[rows] >= size > 1 else [])]
               for size in mesh.shape]
    return [_candidate(sig, mesh, axes)[1] for axes in itertools.product(*options)
            if any(split == ((rows, size),) for split, size in zip(axes, mesh.shape))]


def _ring_partitions(sig: Signature, mesh: Mesh, parts: Iterable[Candidate]) -> list[Candidate]:
    """Context parallel: each partition whose queries only some mesh axes split, each alone, and where no device
    idles, again with a ring over every non-empty set of those axes, when there are at least as many keys as ring
    members (so no member's key block is empty). A gradient ring (the fused backward) rings every axis splitting
    its rows: its query block j must be its key block j."""
    if sig.kernel.ring is None or sig.kernel.ring.rows not in sig.dims:  # a backward with L != S has no rows dim
        return []
    rows = sig.dims.index(sig.kernel.ring.rows)
    found = []
    gradients = sig.kernel.ring.gradients  # its rows split only in a ring, over every axis splitting them
    for part in _gradient_ring_bases(sig, mesh) if gradients else parts:
        alone = [a for a, split in enumerate(part.axes) if split == ((rows, mesh.shape[a]),) and mesh.shape[a] > 1]
        if not alone or any(d == rows for a, split in enumerate(part.axes) if a not in alone for d, _ in split):
            continue
        if part.idles:  # every ring member holds and passes a key block
            continue
        for n in range(len(alone) if gradients else 1, len(alone) + 1):
            for ring in itertools.combinations(alone, n):
                if key_extent(sig) >= math.prod(mesh.shape[a] for a in ring):
                    found.append(replace(part, ring=ring))
        if len(alone) == 1 and key_extent(sig) >= mesh.shape[alone[0]] and sig.kernel.work is not None:
            even = make_partition(sig, mesh, part.axes, ring=(alone[0],))
            balanced = balance_ring(sig, mesh, even)
            if balanced.blocks != even.blocks:
                found.append(replace(part, ring=(alone[0],), made=balanced))
    return found


def balance_ring(sig: Signature, mesh: Mesh, part: Partition) -> Partition:
    """`part` (a ring over one mesh axis, the only one splitting the queries) with its query blocks cut for equal work
    rather than equal size: under a causal mask query i meets i + 1 keys, so even blocks leave the last member most of
    the work (real context parallelism balances it; this is the contiguous way, blocks of decreasing length). The keys
    stay evenly split (a gradient ring's are cut as its queries). Cuts are where the kernel's work over queries [0, cut)
    reaches j/p of the whole (`Signature.cost`, which counts only the work a block does); every block keeps a query."""
    if len(part.ring) != 1 or any(b is None for b in part.blocks):
        raise ValueError(f"balance_ring needs a ring over one mesh axis with every device busy; got ring axes "
                         f"{list(part.ring)} and blocks {part.blocks}")
    (axis,) = part.ring
    rows, parts = sig.dims.index(sig.kernel.ring.rows), mesh.shape[axis]
    extent = sig.index.shape[rows]

    def done(end: int) -> float:
        start, stop = list(sig.index.start), list(sig.index.end)
        stop[rows] = end
        return sig.cost(ZRange(tuple(start), tuple(stop)))[0]

    total, cuts = done(extent), [0]
    for j in range(1, parts):
        lo, hi = cuts[-1] + 1, extent - (parts - j)
        while lo < hi:  # the first cut whose work reaches j/p of the whole
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if done(mid) < total * j / parts else (lo, mid)
        cuts.append(lo)
    cuts.append(extent)
    blocks = []
    for device, block in enumerate(part.blocks):
        c = mesh.coords(device)[axis]
        start, end = list(block.start), list(block.end)
        start[rows], end[rows] = cuts[c], cuts[c + 1]
        blocks.append(ZRange(tuple(start), tuple(end)))
    keys = part.keys
    if sig.kernel.ring.gradients:  # the backward's key block j is its query block j (its output rows pack both)
        keys = tuple((cuts[mesh.coords(d)[axis]], cuts[mesh.coords(d)[axis] + 1]) for d in mesh.devices)
    return replace(part, blocks=tuple(blocks), keys=keys, balanced=True)


def _exchange_partitions(sig: Signature, mesh: Mesh) -> list[Candidate]:
    """Expert parallel: one mesh axis (at least as long as the rows and the experts) splits rows and experts together,
    or all of them as one (`training.plans.expert_parallel` on a grid); every other axis replicates or splits a dim that
    is neither the experts nor a reduction (rows: data times expert parallel, each group of the axis trading its own
    rows; output features: tensor times expert parallel). Rows that are a reduction (grouped_mm_k's) split on an axis
    before the exchange axis too, so a group's rows are one run (`exchanged_blocks`), its sums partial over that axis
    (data parallel); so does, on any other axis, a reduction every input reads (grouped_mm_blocks_k's blocks: a group
    sums its own blocks' rows, the routing `ends` split with them).

    The innermost axis comes first: it is a node's (NVLink, `Profile.axis_links`), and `generation_order` keeps
    the order of candidates that tie, so the rounds a budget lets in, and the moves pricing prices first, hold the
    exchange over the fast link. Outer axis first, Mixtral's training step on 8x8 exchanged its experts over
    InfiniBand (docs/benchmarks.md, "MoE backward scatters over InfiniBand").

    Where the experts do not divide an axis, that axis also exchanges in groups of the largest size that divides
    both (`exchange_group`: Qwen2-MoE's 60 experts on a node of 8, groups of 4), its outer part splitting what an
    axis before the exchange's may (the rows between the groups: data parallel) or replicating; as Megatron's and
    DeepSpeed's EP degree divides the experts. Every axis but such one keeps its whole-axis candidates only (a
    group size per divisor of every axis would multiply an exchange kernel's candidates). The groups come before
    the axis's whole-axis candidates, whose expert blocks are then ragged (8 of 60 experts on some devices of 8,
    7 on others) and whose all-to-alls span the whole axis: a budget that cuts generation keeps the groups."""
    if sig.kernel.exchange is None:
        return []
    rows, experts = sig.dims.index(sig.kernel.exchange.rows), sig.dims.index(sig.kernel.exchange.experts)
    together = {rows, experts}
    read_by_all = {d for d in range(len(sig.dims)) if all(any(row[d] for row in p.matrix) for p in sig.projections)}
    reductions = (set(sig.dims_of(DimKind.REDUCTION)) | {experts}) - (read_by_all - together)
    found = []
    for axis, size in reversed(list(enumerate(mesh.shape))):
        refused = [reductions - {rows} if a < axis else reductions for a in range(mesh.ndim)]
        options = [[None] if a == axis else
                   [c for c in _axis_choices(sig, n) if not {d for d, _ in c} & refused[a]]
                   for a, n in enumerate(mesh.shape)]
        group = math.gcd(sig.index.shape[experts], size)
        if 1 < group < size and sig.index.shape[rows] >= group:  # the outer part splits what an axis before may
            outer = [c for c in _axis_choices(sig, size // group) if not {d for d, _ in c} & (reductions - {rows})]
            found.extend(_candidate(sig, mesh, axes, (axis,), group)[1]
                         for axes in itertools.product(*options[:axis], outer, *options[axis + 1:]))
        if size >= 2 and all(sig.index.shape[d] >= size for d in together):
            found.extend(_candidate(sig, mesh, axes, exchange=(axis,))[1] for axes in itertools.product(*options))
    if mesh.ndim > 1 and all(sig.index.shape[d] >= mesh.size for d in together):  # every axis as one (a flat EP)
        found.append(_candidate(sig, mesh, (None,) * mesh.ndim, exchange=tuple(range(mesh.ndim)))[1])
    return found


# Past this many devices candidates come in the order of clusters' recipe (`generation_order`): there the layout
# pairs cap (egraph.driver.PAIRS_DEVICES, the same 64) stops generation after a few rounds.
NODES_FIRST_DEVICES = 64
# Past this many devices an op's candidates that split only its batch's dims over the outer axes come first
# (`generation_order`'s data): there the cap leaves about two rounds. On 4x8x8 (four rounds) busiest first found
# transformers' 7B training step a plan of weights split over all 256 devices in place, 19.9 ms, where this order
# gave 22.6 (docs/benchmarks.md, "Where it loses, and why").
DATA_FIRST_DEVICES = 256


def generation_order(parts: Iterable[Candidate], mesh: Mesh | None = None, data: frozenset[int] | None = None
                     ) -> list[Candidate]:
    """Most devices busy first, then fewest dims split: what a budget-stopped generation inserts first is then
    each node's fully parallel, mutually consistent splits (batch over every axis), not 2-way ones.

    On a mesh of more than NODES_FIRST_DEVICES devices, among the busiest: fewest dims split over the outer axes
    (all but the last, which is a node's: `Profile.axis_links`), then those whose last axis splits a dim of its
    own, before fewest dims: DP over the nodes and TP inside them, the hand recipe of such clusters, before one
    dim split over every axis. On 8x8x8 the 512-way splits of rows, features and reductions came first, the cap
    stopped generation in the fourth round, and the 7B-wide blocks' training step came out 42.7 ms, 56%
    replicated, every weight whole; in this order 25.6 ms, every weight split (DP x TP: 34.3; 4x8x8: 22.2 against
    17.0 ms, DP x TP 31.8; docs/benchmarks.md, "Cluster").

    `data` (given past DATA_FIRST_DEVICES devices): the index dims that come from the step's token ids
    (egraph.generate, `data_dims`); the candidates whose outer axes split only those come first, however few
    devices they busy. DP over the nodes splits nothing else: an op of a weight's update (Adam on its summed
    gradient and moments) runs whole across the nodes and split inside one, so its weight lives there between
    steps. Busiest first, those ops' first rounds split the weights over all 512 devices of 8x8x8 and every use
    gathered them across the nodes (transformers' 7B training step: 68.0 ms against DP x TP's 48.0; 34.6 now)."""
    if mesh is None or mesh.size <= NODES_FIRST_DEVICES:
        return sorted(parts, key=lambda part: (-part.busy, len(part.dims())))
    return sorted(parts, key=lambda part: (_outside(part, data), -part.busy, *_nodes_first(part), len(part.dims())))


def _outside(part: Candidate, data: frozenset[int] | None) -> bool:
    """Whether the outer axes split some dim not in `data` (None: every dim is)."""
    return data is not None and any(d not in data for split in part.axes[:-1] for d, _ in split)


def _nodes_first(part: Candidate) -> tuple[int, bool]:
    """(dims split over the outer axes, whether the last axis splits none but those): fewer first."""
    outer = {d for split in part.axes[:-1] for d, _ in split}
    inner = {d for d, _ in part.axes[-1]} if part.axes else set()
    return len(outer), inner <= outer


def is_partial(sig: Signature, part: Partition) -> bool:
    return bool(part.summed_dims() & set(sig.dims_of(DimKind.REDUCTION)))


@functools.lru_cache(maxsize=1 << 16)  # blocks recur across a signature's partitions and devices
def _clipped(projection: IndexProjection, block: Block, shape: tuple[int, ...]) -> Block:
    if block is None:
        return None
    inside = ZRange.from_shape(shape).intersection(projection.apply(block))
    return None if inside is None else _non_empty(inside)


def _clipped_all(projection: IndexProjection, blocks: tuple[Block, ...], shape: tuple[int, ...]
                 ) -> tuple[Block, ...]:
    """`_clipped` of each block, the distinct non-empty ones' boxes worked out together (numpy: per tensor dim
    the per-column extremes `IndexProjection.apply` sums), each distinct result made once: 512 devices' blocks
    one at a time were a third of generation's time on 8x8x8."""
    distinct = set(blocks)
    boxes = [b for b in distinct if b is not None and not b.is_empty]
    found = {b: _clipped(projection, b, shape) for b in distinct if b is None or b.is_empty}
    if boxes and 0 in projection.shape:  # nothing selected
        found.update(dict.fromkeys(boxes))
    elif boxes:
        matrix = np.array(projection.matrix, np.int64).reshape(projection.out_dim, projection.in_dim)
        starts = np.array([b.start for b in boxes], np.int64).reshape(len(boxes), 1, projection.in_dim)
        lasts = np.array([b.end for b in boxes], np.int64).reshape(len(boxes), 1, projection.in_dim) - 1
        low, high = starts * matrix, lasts * matrix  # (boxes, tensor dims, index dims)
        offset = np.array(projection.offset, np.int64)
        lo = np.maximum(np.minimum(low, high).sum(axis=2) + offset, 0)
        hi = np.minimum(np.maximum(low, high).sum(axis=2) + offset + np.array(projection.shape, np.int64),
                        np.array(shape, np.int64))
        made: dict[tuple[tuple[int, ...], tuple[int, ...]], Block] = {}
        for box, start, end in zip(boxes, map(tuple, lo.tolist()), map(tuple, hi.tolist())):
            if (start, end) not in made:
                made[start, end] = None if any(map(operator.ge, start, end)) else ZRange._checked(start, end)
            found[box] = made[start, end]
    return tuple(found[b] for b in blocks)


def output_layout(sig: Signature, part: Partition) -> Layout:
    return Layout(_clipped_all(sig.output, part.blocks, sig.output_shape), is_partial(sig, part))


def needed_layout(sig: Signature, arg: int, part: Partition) -> Layout:
    """The layout giving each device exactly the cells of input `arg` its block reads (under a ring, its own key
    block of an input that travels: the others come round the ring)."""
    blocks = _clipped_all(sig.projections[arg], part.blocks, sig.input_shapes[arg])
    if part.ring and travels(sig)[arg]:
        blocks = tuple(None if b is None else key_region(sig, arg, b, keys) for b, keys in zip(blocks, part.keys))
    return Layout(blocks)


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
