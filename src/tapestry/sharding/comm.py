"""Communication sets: which cells move between devices to turn one layout into another."""
from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapestry.sharding.grid import cells, covers
from tapestry.sharding.layout import Layout, canonical, canonical_box
from tapestry.zspace import ZRange


def box_difference(a: ZRange, b: ZRange) -> list[ZRange]:
    """a minus b as disjoint boxes (peeling slabs off one dim at a time). On plain tuples: pricing runs this
    hundreds of thousands of times."""
    if len(a.start) != len(b.start):
        a.intersection(b)  # raises the ndim mismatch
    lows, highs = tuple(map(max, a.start, b.start)), tuple(map(min, a.end, b.end))
    if any(map(operator.ge, lows, highs)):  # they share no cell
        return [] if a.is_empty else [a]
    pieces = []
    start, end = list(a.start), list(a.end)
    for d, (lo, hi) in enumerate(zip(lows, highs)):
        if start[d] < lo:
            pieces.append(ZRange._checked(tuple(start), (*end[:d], lo, *end[d + 1 :])))
        if hi < end[d]:
            pieces.append(ZRange._checked((*start[:d], hi, *start[d + 1 :]), tuple(end)))
        start[d], end[d] = lo, hi
    return pieces


def overlap(a: ZRange | None, b: ZRange | None) -> ZRange | None:
    """The cells two blocks share, or None (an idle device's None block shares nothing)."""
    inside = None if a is None or b is None else a.intersection(b)
    return None if inside is None or inside.is_empty else inside


@dataclass(frozen=True)
class Transfer:
    """Device `src` sends its cells of `region` to device `dst` (partial cells are summed on arrival)."""

    src: int
    dst: int
    region: ZRange


class CommError(ValueError):
    """A layout change that cannot be made: some needed cell is held by no device."""


@functools.lru_cache(maxsize=1 << 16)
def transfers(src: Layout, dst: Layout) -> tuple[Transfer, ...]:
    """The block moves that take `src` to `dst` (cached: pricing asks for the same pairs across the e-graph).

    Plain source: every needed cell not held locally is fetched once, from the
    nearest device (in ring order) holding it. Partial source: every device
    holding part of a needed cell sends it, and the receiver adds them up.
    """
    if dst.partial:
        raise CommError("cannot reshard into a partial layout")
    moves: list[Transfer] = []
    for k, need in enumerate(dst.blocks):
        if need is None:
            continue
        own = src.blocks[k]
        if src.partial:
            for j in sorted(_meeting(src, need, k)):
                moves.append(Transfer(j, k, src.blocks[j].intersection(need)))
            continue
        missing = box_difference(need, own) if own is not None else [need]
        if not missing:  # its own block holds what it needs: no sender to look for
            continue
        for j in _meeting(src, need, k):  # in ring order from k + 1: the only devices that can send
            have = src.blocks[j]
            if not missing:
                break
            still = []
            for piece in missing:
                inter = piece.intersection(have)
                if inter is not None and not inter.is_empty:
                    moves.append(Transfer(j, k, inter))
                    still.extend(box_difference(piece, inter))
                else:
                    still.append(piece)
            missing = still
        if missing:
            raise CommError(f"device {k} needs {missing[0]} but no device holds it")
    return tuple(moves)


# Devices up to which `_meeting` tries each block in turn: on a few devices numpy's per-call set-up costs more
# than the test (pricing a 2-layer Mixtral on Mesh(2, 2) asks 14,000 times, on 4 devices).
LOOPED_DEVICES = 8


def _meeting(layout: Layout, box: ZRange, k: int) -> list[int]:
    """The devices but `k` whose blocks of `layout` share a cell with `box`, in ring order from k + 1: on a large
    mesh one vectorized test, where trying each of 64 devices' blocks in turn was most of pricing a 64-device move;
    on a small one (up to LOOPED_DEVICES) block by block, where the vectorized test was a third of `transfers`."""
    starts, ends, held = layout.bounds
    if starts.shape[1] != box.ndim:
        return [(k + step) % len(held) for step in range(1, len(held)) if held[(k + step) % len(held)]]
    if len(held) <= LOOPED_DEVICES:
        return [j for j in ((k + step) % len(held) for step in range(1, len(held)))
                if (block := layout.blocks[j]) is not None
                and all(map(operator.lt, map(max, block.start, box.start), map(min, block.end, box.end)))]
    meets = held & (np.maximum(starts, box.start) < np.minimum(ends, box.end)).all(axis=1)
    meets[k] = False
    found = np.flatnonzero(meets)
    return np.concatenate([found[found > k], found[found < k]]).tolist()


@functools.lru_cache(maxsize=1 << 16)
def can_move(src: Layout, dst: Layout) -> bool:
    """Whether some reshard turns `src` into `dst` (`transfers` would not raise), without planning it: every cell
    a device needs is held by some device, or the source is partial. Asked of every pair of a value's layouts
    (146,000 pairs for one layer on a 2x2x2 mesh): most sources fill a box that holds every needed block, the
    rest on the cell grid (`grid.covers`). A filled box decides alone: `covers` was asked of every pair the box
    refused (the 7B training step's exploration on 8x8 asked `can_move` of 28,456 pairs one by one,
    benchmarks/explore_phases.py)."""
    if dst.partial:
        return False
    if src.partial:
        return True
    if all(b is None for b in src.blocks):  # as `transfers` has it: a needed block, even empty, needs a holder
        return all(b is None for b in dst.blocks)
    box = filled_box(src)
    if box is not None:  # the source holds exactly this box: a block outside it has cells no device holds
        return _within(dst, box)
    return covers(src, dst)


def _within(layout: Layout, box: ZRange) -> bool:
    """Whether every non-empty block of `layout` lies in `box`: on a large mesh one array test over its blocks
    (`Layout.bounds`: 33 us for 64 devices against 141 us block by block, where `ZRange.contains` was most of
    `can_move`'s time on 8x8), on a small one (up to LOOPED_DEVICES) block by block."""
    if len(layout.blocks) <= LOOPED_DEVICES or layout.bounds[0].shape[1] != box.ndim:
        return all(b is None or b.is_empty or box.contains(b) for b in layout.blocks)
    starts, ends, held = layout.bounds
    needed = held & (starts < ends).all(axis=1)
    return bool(((starts[needed] >= box.start) & (ends[needed] <= box.end)).all())


MOVABLE_CELLS = 1 << 22  # blocks x grid cells above which `movable` asks `can_move` pair by pair instead


def movable(layouts: Sequence[Layout]) -> np.ndarray:
    """`can_move` of every ordered pair of one value's layouts at once: a (k, k) bool array, [i, j] for i -> j
    (the diagonal included). A plain move is possible when the cells the destination's blocks cover are all
    covered by the source's: where every source fills a box, by the destinations' hulls (`_boxed_moves`); else
    each layout's covered cells are found once, on the grid that every block bound of every layout cuts the
    tensor into, and the pairs are one matrix product (`_grid_moves`). `reshard_pairs` asks this of each value:
    pair by pair it was 12 of a 2-layer GPT-NeoX's 17 s of saturation on a 2x2 mesh."""
    k = len(layouts)
    partial = np.array([layout.partial for layout in layouts], bool)
    holds = np.array([any(b is not None for b in layout.blocks) for layout in layouts], bool)
    blocks = [(i, b) for i, layout in enumerate(layouts) for b in layout.blocks if b is not None]
    ndim = blocks[0][1].ndim if blocks else 0
    if any(b.ndim != ndim for _, b in blocks):
        return np.array([[can_move(a, b) for b in layouts] for a in layouts], bool).reshape(k, k)
    ok = _boxed_moves(layouts, partial, holds, ndim)
    if ok is None:
        ok = _grid_moves(layouts, blocks, ndim)
    ok[~holds] = ~holds  # a source holding nothing moves only to a layout holding nothing (as in can_move)
    ok[partial, :] = True
    ok[:, partial] = False
    return ok


def _boxed_moves(layouts: Sequence[Layout], partial: np.ndarray, holds: np.ndarray, ndim: int) -> np.ndarray | None:
    """`movable`'s plain moves where every plain source that holds a block fills a box (`filled_box`): i -> j
    when the hull of j's non-empty blocks lies in i's box, as `can_move` decides such a pair; None where a source
    fills no box. Generation's sources are boxes, and the grids of the 7B training step's largest values on 8x8
    were too fine to build, so their pairs were asked one by one: `reshard_pairs` 9.65 -> 0.53 CPU s
    (benchmarks/explore_phases.py, docs/benchmarks.md "Exploration of the folded step")."""
    boxes = [filled_box(layout) if held and not part else None for layout, held, part in zip(layouts, holds, partial)]
    if any(box is None and held and not part for box, held, part in zip(boxes, holds, partial)):
        return None
    box_start = np.array([box.start if box is not None else (0,) * ndim for box in boxes], np.int64)
    box_end = np.array([box.end if box is not None else (0,) * ndim for box in boxes], np.int64)
    needs = np.zeros(len(layouts), bool)
    low = np.zeros((len(layouts), ndim), np.int64)
    high = np.zeros((len(layouts), ndim), np.int64)
    for j, layout in enumerate(layouts):
        starts, ends, held = layout.bounds
        if starts.shape[1] != ndim:  # holds no block
            continue
        needed = held & (starts < ends).all(axis=1)
        if needed.any():
            needs[j], low[j], high[j] = True, starts[needed].min(axis=0), ends[needed].max(axis=0)
    inside = ((box_start[:, None, :] <= low[None, :, :]) & (high[None, :, :] <= box_end[:, None, :])).all(axis=2)
    return inside | ~needs[None, :]


def _grid_moves(layouts: Sequence[Layout], blocks: Sequence[tuple[int, ZRange]], ndim: int) -> np.ndarray:
    """`movable`'s plain moves on the cell grid every block bound cuts the tensor into (pair by pair past
    MOVABLE_CELLS)."""
    k = len(layouts)
    starts = np.array([b.start for _, b in blocks], np.int64).reshape(len(blocks), ndim)
    ends = np.array([b.end for _, b in blocks], np.int64).reshape(len(blocks), ndim)
    along = []
    for d in range(ndim):
        cuts = np.unique(np.concatenate([starts[:, d], ends[:, d]]))
        along.append((starts[:, d, None] <= cuts[:-1]) & (cuts[1:] <= ends[:, d, None]))  # (blocks, cells along d)
    if len(blocks) * math.prod(a.shape[1] for a in along) > MOVABLE_CELLS:
        return np.array([[can_move(a, b) for b in layouts] for a in layouts], bool).reshape(k, k)
    inside = np.ones((len(blocks), 1), bool)
    for a in along:
        inside = (inside[:, :, None] & a[:, None, :]).reshape(len(blocks), -1)
    covered = np.zeros((k, inside.shape[1]), bool)
    np.logical_or.at(covered, np.array([i for i, _ in blocks], np.int64), inside)
    lacking = (~covered).astype(np.float64) @ covered.T.astype(np.float64)  # [i, j]: cells j covers, i does not
    return lacking == 0


@functools.lru_cache(maxsize=1 << 14)
def filled_box(layout: Layout) -> ZRange | None:
    """The bounding box of the blocks of `layout` if they leave no cell of it unheld, else None."""
    held = [b for b in layout.blocks if b is not None]
    if held:
        box = ZRange.bounding(held)
        found = union_covers(held, box)
        if found is not None:
            return box if found else None
    has, _ = cells(layout, layout)
    if not has.any(axis=0).all():
        return None
    return ZRange.bounding(held)


# Distinct boxes up to which `union_covers` counts their union by inclusion-exclusion (at most 2^n - 1 intersections)
UNION_BOXES = 4


def union_covers(held: Sequence[ZRange], box: ZRange) -> bool | None:
    """Whether the boxes `held` together hold every cell of `box`: their parts inside it, told apart, hold as many
    cells together as `box` has (`_union_size`). None where more than UNION_BOXES distinct parts meet it, or a
    rank differs: the cell grid (`grid.cells`) decides. On a few devices numpy's set-up for that grid was most of
    the test (2,405 grids pricing Phi's reshards on 2x2)."""
    lo, hi = box.start, box.end
    if any(map(operator.ge, lo, hi)):  # no cell to hold
        return True
    if any(len(b.start) != len(lo) for b in held):
        return None
    parts = set()
    for b in held:
        start, end = tuple(map(max, b.start, lo)), tuple(map(min, b.end, hi))
        if all(map(operator.lt, start, end)):
            if start == lo and end == hi:
                return True
            parts.add((start, end))
    if len(parts) > UNION_BOXES:
        return None
    return _union_size(sorted(parts)) == box.size


def _union_size(boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Cells in the union of non-empty boxes (start, end): |A u R| = |A| + |R| - |(A n r for r in R), united|."""
    if not boxes:
        return 0
    (start, end), rest = boxes[0], boxes[1:]
    meets = []
    for other_start, other_end in rest:
        lo, hi = tuple(map(max, start, other_start)), tuple(map(min, end, other_end))
        if all(map(operator.lt, lo, hi)):
            meets.append((lo, hi))
    return math.prod(map(operator.sub, end, start)) + _union_size(rest) - _union_size(meets)


@functools.lru_cache(maxsize=1 << 14)  # asked per group of each send/recv priced: groups of many pairs are one
def received_counts(src: Layout, dst: Layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per device, the cells and the messages it receives: what a reshard costs each device. Counted on the pair
    seen from the destination's box (`within`), so the moves from a fused value's many layouts into each of its
    footprints share one count: 3,905 pairs where there were 11,860 (2-layer GPT-NeoX, 2x2). A grid is counted
    without planning the moves (`_grid_counts`; box by box on up to LOOPED_DEVICES devices, `_looped_grid_counts`,
    where numpy's set-up made pricing Phi's reshards on 2x2 2.5 times slower than planning them); other pairs by
    their planned moves (`transfers`)."""
    src, dst = within(src, dst)
    counted = (_grid_counts if len(dst.blocks) > LOOPED_DEVICES else _looped_grid_counts)(src, dst)
    if counted is not None:
        return counted
    cells, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    for t in transfers(src, dst):
        cells[t.dst] += t.region.size
        messages[t.dst] += 1
    return tuple(cells), tuple(messages)


GRID_CELLS = 1 << 20  # (needed box, own block) pairs x source boxes that `_grid_counts` tests at once


def _grid_counts(src: Layout, dst: Layout) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`received_counts` without planning the moves, where the source's non-empty boxes form a grid: along each dim
    any two of their ranges are equal or disjoint (an even split, some axes replicated, is one), so distinct boxes
    are disjoint. Then each piece `transfers` has left to fetch is a union of the grid's cells, the cell a sender
    holds of the needed box lies in one piece whatever came before it in ring order, and a copy of a box already
    sent sends nothing: a device receives one message per distinct box (not its own) that shares cells with its
    needed box, and its needed box less its own block's cells. On 512 devices `transfers` planned 250,000 block
    moves for one such pair (seconds each; most of pricing the 7B-wide blocks' step on 8x8x8). None where this
    does not apply (a partial layout, ranks that differ, a needed cell no device holds: `transfers` says which)."""
    if src.partial or dst.partial:
        return None
    boxes = list(dict.fromkeys(b for b in src.blocks if b is not None and not b.is_empty))
    needs = {}  # (needed box, own block) -> the devices with that pair
    for k, need in enumerate(dst.blocks):
        if need is not None:
            if src.blocks[k] is None and need.is_empty:  # transfers refuses: no device holds the empty box
                return None
            needs.setdefault((need, src.blocks[k]), []).append(k)
    if not boxes or not needs or any(b.ndim != boxes[0].ndim for b in (*boxes, *(n for n, _ in needs))):
        return None
    ndim = boxes[0].ndim
    starts = np.array([b.start for b in boxes], np.int64).reshape(len(boxes), ndim)
    ends = np.array([b.end for b in boxes], np.int64).reshape(len(boxes), ndim)
    for d in range(ndim):  # sorted by start, then end: a range crossing another crosses the next one
        ranges = np.unique(np.stack([starts[:, d], ends[:, d]], axis=1), axis=0)
        if (ranges[1:, 0] < ranges[:-1, 1]).any():
            return None
    index = {b: i for i, b in enumerate(boxes)}
    pairs = list(needs)
    cells, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    step = max(1, GRID_CELLS // len(boxes))
    for first in range(0, len(pairs), step):
        chunk = pairs[first:first + step]
        lo = np.array([n.start for n, _ in chunk], np.int64).reshape(len(chunk), 1, ndim)
        hi = np.array([n.end for n, _ in chunk], np.int64).reshape(len(chunk), 1, ndim)
        shared = np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).prod(axis=2)  # (pairs, boxes)
        own = [(p, index[o]) for p, (_, o) in enumerate(chunk) if o in index]
        if own:
            shared[tuple(zip(*own))] = 0
        missing = [need.size - (0 if (kept := overlap(need, o)) is None else kept.size) for need, o in chunk]
        if shared.sum(axis=1).tolist() != missing:  # a needed cell no box holds
            return None
        for (pair, received), sent in zip(zip(chunk, missing), np.count_nonzero(shared, axis=1).tolist()):
            for k in needs[pair]:
                cells[k], messages[k] = received, sent
    return tuple(cells), tuple(messages)


def _looped_grid_counts(src: Layout, dst: Layout) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`_grid_counts` box by box, for a few devices: planning a Phi reshard's moves on 2x2 (`transfers`' box
    differences) was a fifth of pricing it. The same answer and the same None (tests/test_reshard_pricing.py).
    Decided once per source (`_grid_boxes`: 761 distinct sources in Phi's 8,521 counts) and device need
    (`_need_counts`), which the pairs into layouts that agree on a device share."""
    boxes = None if src.partial or dst.partial else _grid_boxes(src)
    if boxes is None or all(need is None for need in dst.blocks):
        return None
    ndim = len(boxes[0].start)
    cells, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    for k, need in enumerate(dst.blocks):
        if need is not None:
            counted = None if len(need.start) != ndim else _need_counts(src, k, need)
            if counted is None:
                return None
            cells[k], messages[k] = counted
    return tuple(cells), tuple(messages)


@functools.lru_cache(maxsize=1 << 14)
def _grid_boxes(src: Layout) -> tuple[ZRange, ...] | None:
    """The distinct non-empty blocks of a plain `src` if they form a grid (along each dim any two of their ranges
    are equal or disjoint), else None (none held, ranks that differ, ranges that cross)."""
    boxes = tuple(dict.fromkeys(b for b in src.blocks if b is not None and not b.is_empty))
    if not boxes or any(len(b.start) != len(boxes[0].start) for b in boxes):
        return None
    for d in range(len(boxes[0].start)):  # sorted by start, then end: a range crossing another crosses the next one
        ranges = sorted({(b.start[d], b.end[d]) for b in boxes})
        if any(later[0] < earlier[1] for earlier, later in zip(ranges, ranges[1:])):
            return None
    return boxes


@functools.lru_cache(maxsize=1 << 16)
def _need_counts(src: Layout, k: int, need: ZRange) -> tuple[int, int] | None:
    """The cells and messages device `k` receives to hold `need`, from the grid of `src`'s blocks (`_grid_boxes`):
    its need less its own block, one message per other distinct box meeting it. None where `transfers` refuses."""
    own = src.blocks[k]
    if own is None and need.is_empty:  # no device holds the empty box
        return None
    sent = held = 0
    for box in _grid_boxes(src) or ():  # a grid: `_looped_grid_counts` asks only then
        if box != own:
            shared = math.prod(max(0, min(e, h) - max(s, lo))
                               for s, e, lo, h in zip(box.start, box.end, need.start, need.end))
            if shared:
                sent, held = sent + 1, held + shared
    kept = overlap(need, own)
    missing = need.size - (0 if kept is None else kept.size)
    return None if held != missing else (missing, sent)  # not equal: a needed cell no box holds


def within(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """The pair clipped to the box B that the destination's blocks span and moved to its origin: the same
    `transfers`, but for the moved regions' place. Every needed box lies in B, so a source block clipped to B
    (each dim's bounds clamped into B's; one that shares no cell with B becomes an empty box, not None, as an empty
    own block is not a missing one) meets each needed box in the same cells and cuts it the same way in
    `box_difference`. Returned as it is where it cannot be clipped (no block needed, a partial destination, or
    blocks of another rank)."""
    clipped = clipped_pair(src, dst)
    return (src, dst) if clipped is None else clipped[:2]


def clipped_pair(src: Layout, dst: Layout) -> tuple[Layout, Layout, tuple[int, ...], frozenset[int]] | None:
    """`within`'s pair, the shape of the box B, and the devices whose source block clipping changed (those not
    inside B); None where `within` leaves the pair as it is."""
    placed = _at_origin(dst)
    clipped = None if placed is None else _clipped(src, placed[1])
    return None if clipped is None else (clipped[0], placed[0], placed[1].shape, clipped[1])


@functools.lru_cache(maxsize=1 << 14)
def _at_origin(dst: Layout) -> tuple[Layout, ZRange] | None:
    """`dst` moved to the origin of the box its blocks span, and that box (cached: made once per layout, so
    `transfers`' cache finds the moved layout by the hash it keeps)."""
    needed = [b for b in dst.blocks if b is not None]
    if not needed or dst.partial:
        return None
    box = ZRange.bounding(needed)
    back = tuple(-x for x in box.start)
    return canonical(Layout(tuple(None if b is None else b.translate(back) for b in dst.blocks), False)), box


@functools.lru_cache(maxsize=1 << 16)
def _clipped(src: Layout, box: ZRange) -> tuple[Layout, frozenset[int]] | None:
    """`src`'s blocks clamped into `box` and moved to its origin, and the devices whose block that changed (None if
    a block's rank is not the box's)."""
    lo, hi = box.start, box.end
    if any(b is not None and len(b.start) != len(lo) for b in src.blocks):
        return None

    def clipped(b: ZRange | None) -> ZRange | None:
        if b is None:
            return None
        return canonical_box(tuple(min(max(x, l), h) - l for x, l, h in zip(b.start, lo, hi)),
                             tuple(min(max(x, l), h) - l for x, l, h in zip(b.end, lo, hi)))

    changed = frozenset(k for k, b in enumerate(src.blocks) if b is not None and not box.contains(b))
    return canonical(Layout(tuple(map(clipped, src.blocks)), src.partial)), changed


def received_elements(src: Layout, dst: Layout) -> tuple[int, ...]:
    """Cells each device receives: the communication volume per device."""
    return received_counts(src, dst)[0]


FLOOR_ENTRIES = 1 << 22  # pairs x devices x devices x dims that `received_floors` compares at once


def received_floors(pairs: Sequence[tuple[Layout, Layout]]) -> tuple[np.ndarray, np.ndarray]:
    """Per (from, to) pair of layouts of one tensor and per device: at least how many cells and how many messages
    it receives, however the move is made (a lower bound on `received_counts` that plans no move), as two
    (pairs, devices) int arrays, all at once (each distinct layout's bounds stacked once).

    Cells: those of its destination block that its own source block lacks (each arrives); from a partial source
    also those any one other device holds an addend of (each needs at least one value from elsewhere).
    Neither more than the other devices' source blocks hold of it together (less where the source does not cover
    the tensor). Messages: those cells over the most that any one other device's source block holds of its
    destination block (a sender sends only what it holds). Zero for a pair into a partial layout or with a layout
    holding no block (no floor is claimed)."""
    devices = len(pairs[0][0].blocks) if pairs else 0
    cells = np.zeros((len(pairs), devices), np.int64)
    messages = np.zeros((len(pairs), devices), np.int64)
    by_rank: dict[int, list[int]] = {}
    for p, (src, dst) in enumerate(pairs):
        ndim = src.bounds[0].shape[1]
        if not dst.partial and ndim and ndim == dst.bounds[0].shape[1]:
            by_rank.setdefault(ndim, []).append(p)
    step = max(1, FLOOR_ENTRIES // max(1, devices * devices * max(by_rank, default=1)))
    for chosen in by_rank.values():
        index: dict[Layout, int] = {}
        rows = np.array([[index.setdefault(layout, len(index)) for layout in pairs[p]] for p in chosen], np.int64)
        starts, ends, held = (np.stack([layout.bounds[i] for layout in index]) for i in range(3))
        partial = np.array([layout.partial for layout in index])
        for first in range(0, len(chosen), step):
            part = chosen[first:first + step]
            src, dst = rows[first:first + step, 0], rows[first:first + step, 1]
            need = np.where(held[dst], np.prod(ends[dst] - starts[dst], axis=2), 0)
            # [pair, j, i]: cells of device j's source block inside device i's destination block
            low = np.maximum(starts[src][:, :, None], starts[dst][:, None])
            high = np.minimum(ends[src][:, :, None], ends[dst][:, None])
            shared = np.where(held[src][:, :, None] & held[dst][:, None, :],
                              np.prod(np.clip(high - low, 0, None), axis=3), 0)
            missing = need - np.diagonal(shared, axis1=1, axis2=2)
            others = shared.copy()
            others[:, np.arange(devices), np.arange(devices)] = 0
            most = others.max(axis=1)
            # no more than the others hold of the block can arrive (a source that does not cover the tensor: no
            # such move is made, and none is claimed)
            arriving = np.minimum(np.where(partial[src][:, None], np.maximum(missing, most), missing),
                                  others.sum(axis=1))
            cells[part] = arriving
            messages[part] = -(-arriving // np.maximum(most, 1))
    return cells, messages
