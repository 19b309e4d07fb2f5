"""Memory per device: the second objective next to time, and what a memory budget bounds.

The model is the runtime's (tapestry.runtime.execute): every rank places its
blocks of the program inputs before the first step and keeps them for the
whole program (weights stay resident; so do the results of prepared steps,
`Plan.prepared`, which it runs once after placing), then runs its lowered steps, dropping
each buffer after its last reader (`RankProgram.dead_after`). A buffer holds
its block at its value's dtype size. A `Local` move whose block lies inside
the source block, and an always-a-view kernel (expand, slice, select, transpose:
`lower.program.viewed`), are views of their source, as the runtime makes them:
they add no bytes and keep their source alive. Not counted: kernel scratch space, collective
staging buffers and allocator slack; nor the gather of the outputs to rank 0
that `run_plan` adds after the plan (the plan's outputs stay live to its end).
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tapestry import dtypes
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Block, Layout
from tapestry.sharding.layout import ValueNumbers

if TYPE_CHECKING:
    from tapestry.lower.program import RankStep


def block_bytes(block: Block, dtype: str) -> int:
    return 0 if block is None else block.size * dtypes.itemsize(dtype)


def layout_bytes(layout: Layout, dtype: str) -> tuple[int, ...]:
    """Bytes each device holds of a value in `layout`."""
    return tuple(block_bytes(b, dtype) for b in layout.blocks)


def most_elements(layout: Layout) -> int:
    """The most elements a device holds of a value in `layout` (0 where none holds any): `layout_bytes`' largest,
    by the layout's box arrays (`Layout.bounds`, made once per layout object: pricing has made a decoder's)."""
    starts, ends, held = layout.bounds
    return int(np.where(held, (ends - starts).prod(axis=1), 0).max(initial=0))


def resident_bytes(plan: Plan) -> list[int]:
    """Per device, the bytes of program inputs it holds for the whole program."""
    total = [0] * plan.mesh.size
    for step in plan.steps:
        if isinstance(step, Place):
            total = [t + n for t, n in zip(total, layout_bytes(step.layout, plan.dtypes[step.out]))]
    return total


@dataclass(frozen=True)
class RankPeak:
    """One rank's most bytes at once, and what holds them then: bytes per plan step whose buffers are live at
    that moment (its placed blocks included), so a memory budget can say which choices overshot together."""

    bytes: int
    live: Mapping[int, int]  # plan step index -> its bytes live at the peak on this rank


@dataclass(frozen=True)
class _Part:
    """One rank's part in one plan step as its memory sees it, without names, so that steps alike but for their
    names share it and ranks that differ only by which shards they hold have equal parts: the elements of the
    buffer it makes (0: none, or a view), whether that is a view (`lower.program.viewed`: it shares the source's
    storage) or a placed input block, and which of the step's inputs it reads (positions in a
    Compute's arguments; 0: a reshard's source)."""

    elements: int
    view: bool
    placed: bool
    reads: tuple[int, ...]


def _part(rank_step: RankStep) -> _Part:
    from tapestry.lower.program import Comm, PlaceBlock, viewed  # imports torch: only when asked

    if isinstance(rank_step, PlaceBlock):
        return _Part(rank_step.block.size, False, True, ())
    view = viewed(rank_step) is not None
    if isinstance(rank_step, Comm):
        made = rank_step.out_block
        return _Part(0 if view or made is None else made.size, view, False, (0,))
    return _Part(0 if view else rank_step.out_block.size, view, False,
                 tuple(i for i, read in enumerate(rank_step.reads) if read.box is not None))


def _lowering_key(step: Step, layouts: Mapping[str, Layout], lowerings: Lowerings) -> tuple:
    """What lowering a step reads but its names: steps with equal keys lower to the same parts. A Compute's blocks
    by identity (an expanded plan's copies share them; hashing every device's block per step is not free), its
    layouts as numbers (`ValueNumbers`: equal layouts, one number; one layout comparison per step was most of an
    expanded 80-layer 70B plan's peak walk on 8x8x8)."""
    layout = lowerings.layout
    if isinstance(step, Compute):
        return (step.numbered_binding(layout), id(step.blocks),
                tuple(None if (held := layouts.get(a)) is None else layout(held) for a in step.args))
    if isinstance(step, Reshard):
        return step.shape, layout(step.src_layout), layout(step.layout), step.src in layouts
    return (layout(step.layout),)


@dataclass(eq=False)
class Lowerings:
    """Each distinct step's parts (`_lowering_key`), lowered once across the plans walked with it (`rank_peaks`):
    the plans one decoder makes share their Compute steps' blocks, so an extraction's later selections are mostly
    lowered already (LLaMA 13B's step on 8x8: lowering was 117 of the 128 profiled CPU s of four fits' peaks).
    The blocks a key names by identity (and the layouts and rows numbered) are kept, so their ids are not reused."""

    parts: dict[tuple, tuple[_Part | None, ...]] = field(default_factory=dict)
    interned: dict[_Part, _Part] = field(default_factory=dict)
    held: list[object] = field(default_factory=list)
    layout: ValueNumbers = field(default_factory=ValueNumbers)  # the keys' layouts, numbered by value
    _codes: dict[int, np.ndarray] = field(default_factory=dict)  # id(a row of parts) -> each rank's part's number

    def codes(self, row: tuple[_Part | None, ...]) -> np.ndarray:
        """Each rank's part in `row` as a number, equal where the part is the same (interned) object: `_alike_ranks`
        compares ranks by these, made once per row object for all plans walked."""
        found = self._codes.get(id(row))
        if found is None:
            numbers: dict[int, int] = {}
            found = self._codes[id(row)] = np.array([numbers.setdefault(id(p), len(numbers)) for p in row],
                                                    dtype=np.int64)
            self.held.append(row)
        return found


def _parts(plan: Plan, lowerings: Lowerings | None = None) -> list[tuple[_Part | None, ...]]:
    """Per plan step, each rank's part (None: it takes none), lowered once per distinct step (`_lowering_key`, in
    `lowerings` where given) and without the pieces cost.memory does not read (`lower`'s `pieces`); equal parts are
    one object."""
    from tapestry.lower.program import lower_step

    lowerings = Lowerings() if lowerings is None else lowerings
    layouts: dict[str, Layout] = {}
    lowered, interned = lowerings.parts, lowerings.interned
    parts = []
    for index, step in enumerate(plan.steps):
        key = _lowering_key(step, layouts, lowerings)
        row = lowered.get(key)
        if row is None:
            row = lowered[key] = tuple(None if s is None else interned.setdefault(p := _part(s), p)
                                       for s in lower_step(index, step, plan, layouts, pieces=False))
            if isinstance(step, Compute):
                lowerings.held.append(step.blocks)
        parts.append(row)
        layouts[step.out] = step.layout
    return parts


def _alike_ranks(parts: list[tuple[_Part | None, ...]], size: int, lowerings: Lowerings | None = None
                 ) -> list[list[int]]:
    """The ranks grouped by their parts in every step: a group's ranks run alike but for their shards' places, so
    they hold the same bytes at every moment. Groups in the order of their first rank. Each distinct row of parts
    is numbered once (`Lowerings.codes`, kept across plans) and the ranks compared as columns of those numbers."""
    lowerings = Lowerings() if lowerings is None else lowerings
    rows = {id(row): row for row in parts}.values()  # steps sharing their parts refine nothing again
    if not rows:
        return [list(range(size))]
    _, group = np.unique(np.stack([lowerings.codes(row) for row in rows]), axis=1, return_inverse=True)
    ranks: dict[int, list[int]] = {}
    for rank, g in enumerate(group.reshape(-1).tolist()):
        ranks.setdefault(g, []).append(rank)
    return list(ranks.values())


def _rank_peak(plan: Plan, parts: list[tuple[_Part | None, ...]], rank: int) -> RankPeak:
    """One rank's placed blocks and prepared buffers (`Plan.prepared`, which the runtime runs once and keeps)
    throughout, plus the live buffers at the step where they are most. Each buffer is dropped after its last
    reader on the rank (`RankProgram.dead_after`)."""
    steps = [(k, part) for k, row in enumerate(parts) if (part := row[rank]) is not None]
    inputs = [_inputs(plan.steps[k]) for k, _ in steps]
    last: dict[str, int] = {}
    for at, ((k, part), names) in enumerate(zip(steps, inputs)):
        last[plan.steps[k].out] = at
        for i in part.reads:
            last[names[i]] = at
    dead: list[list[str]] = [[] for _ in steps]
    for name, at in last.items():
        dead[at].append(name)
    owner: dict[str, int | None] = {}  # buffer -> the storage it is (a view's source's); None: resident
    users: dict[int, int] = {}  # storage -> how many live buffers share it
    storages: list[tuple[int, int, int]] = []  # (bytes, plan step that made it, position made) in making order
    freed: dict[int, int] = {}  # storage -> the position after whose peak check it was freed
    placed: dict[int, int] = {}  # Place step -> its bytes on this rank
    prepared = {k for k, s in enumerate(plan.steps) if s.out in plan.prepared}  # kept like placed inputs
    live, peak, peak_at = 0, 0, -1
    for at, ((k, part), names, gone) in enumerate(zip(steps, inputs, dead)):
        out = plan.steps[k].out
        made = part.elements * dtypes.itemsize(plan.dtypes[out])
        if part.placed or k in prepared:
            placed[k] = placed.get(k, 0) + made
            owner[out] = None
            continue
        if part.view:
            owner[out] = owner[names[0]]
        else:
            owner[out] = len(storages)
            storages.append((made, k, at))
            live += made
        base = owner[out]
        if base is not None:
            users[base] = users.get(base, 0) + 1
        if live > peak:  # the first position where the most is live: its buffers are found below
            peak, peak_at = live, at
        for name in gone:
            base = owner.pop(name, None)
            if base is None:
                continue  # resident, or never made on this rank
            users[base] -= 1
            if users[base] == 0:
                live -= storages[base][0]
                freed[base] = at
    held = dict(placed)
    for k, (n, made_by, made_at) in enumerate(storages):  # live at the peak: made by then, freed no earlier
        if made_at <= peak_at <= freed.get(k, peak_at):
            held[made_by] = held.get(made_by, 0) + n
    return RankPeak(sum(placed.values()) + peak, held)


def _inputs(step: Step) -> tuple[str, ...]:
    return step.args if isinstance(step, Compute) else (step.src,) if isinstance(step, Reshard) else ()


def rank_peaks(plan: Plan, lowerings: Lowerings | None = None) -> list[RankPeak]:
    """Per device, its peak when the plan runs as lowered, and the plan steps whose buffers make it up: found once
    per group of ranks alike in every step (`_alike_ranks`: on a plan whose splits are even, often one group).
    With `lowerings`, steps lowered for earlier plans are not lowered again."""
    lowerings = Lowerings() if lowerings is None else lowerings
    parts = _parts(plan, lowerings)
    peaks: list[RankPeak | None] = [None] * plan.mesh.size
    for ranks in _alike_ranks(parts, plan.mesh.size, lowerings):
        peak = _rank_peak(plan, parts, ranks[0])
        for rank in ranks:
            peaks[rank] = peak
    return peaks  # type: ignore[return-value]


def peak_memory(plan: Plan) -> list[int]:
    """Per device, the most bytes it holds at once when the plan runs as lowered."""
    return [peak.bytes for peak in rank_peaks(plan)]


def lean_order(plan: Plan) -> tuple[int, ...]:
    """A children-first order of the plan's steps (step indices) that tends to a lower peak: each time, of the
    steps whose arguments are made, the one that adds fewest bytes net of the arguments it is the last reader
    of (earliest first on ties). Greedy, so not always leaner than the plan's own order: compare peaks."""
    arguments = [tuple(dict.fromkeys(s.args if isinstance(s, Compute) else (s.src,) if isinstance(s, Reshard)
                                     else ())) for s in plan.steps]
    index = {s.out: i for i, s in enumerate(plan.steps)}
    largest: dict[tuple[int, str], int] = {}  # by layout object: an expanded plan's copies share their layouts

    def most_bytes(step: Step) -> int:
        key = (id(step.layout), plan.dtypes[step.out])
        if key not in largest:
            largest[key] = most_elements(step.layout) * dtypes.itemsize(key[1])
        return largest[key]

    size = [0 if isinstance(s, Place) else most_bytes(s) for s in plan.steps]
    kept = {index[v] for v in plan.outputs.values()}
    readers = [0] * len(plan.steps)
    users: list[list[int]] = [[] for _ in plan.steps]
    for i, args in enumerate(arguments):
        for a in args:
            readers[index[a]] += 1
            users[index[a]].append(i)

    def gain(i: int) -> tuple[int, int]:  # bytes added net of the arguments freed, then the earliest
        freed = sum(size[index[a]] for a in arguments[i] if readers[index[a]] == 1 and index[a] not in kept)
        return size[i] - freed, i

    # A ready step's key only falls (when another reader of one of its arguments runs): each fall pushes the new
    # key, and a popped key that is no longer the step's own is stale. A heap, where the least over the ready
    # steps each time was quadratic (an 80-layer 70B step's order: CPU minutes).
    waiting = [len(args) for args in arguments]
    ready = [gain(i) for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    done = [False] * len(plan.steps)
    order: list[int] = []
    while ready:
        key = heapq.heappop(ready)
        step = key[1]
        if done[step] or key != gain(step):
            continue
        done[step] = True
        order.append(step)
        for a in arguments[step]:
            readers[index[a]] -= 1
            if readers[index[a]] == 1:
                last = next(u for u in users[index[a]] if not done[u])
                if waiting[last] == 0:
                    heapq.heappush(ready, gain(last))
        for user in users[step]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, gain(user))
    return tuple(order)
