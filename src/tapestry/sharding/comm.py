"""Communication sets: which cells move between devices to turn one layout into another."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from tapestry.sharding.layout import Layout
from tapestry.zspace import ZRange


def box_difference(a: ZRange, b: ZRange) -> list[ZRange]:
    """a minus b as disjoint boxes (peeling slabs off one dim at a time)."""
    inside = a.intersection(b)
    if inside is None or inside.is_empty:
        return [] if a.is_empty else [a]
    pieces, rest = [], a
    for d in range(a.ndim):
        lo, hi = inside.start[d], inside.end[d]
        if rest.start[d] < lo:
            pieces.append(_with_dim(rest, d, rest.start[d], lo))
        if hi < rest.end[d]:
            pieces.append(_with_dim(rest, d, hi, rest.end[d]))
        rest = _with_dim(rest, d, lo, hi)
    return pieces


def overlap(a: ZRange | None, b: ZRange | None) -> ZRange | None:
    """The cells two blocks share, or None (an idle device's None block shares nothing)."""
    inside = None if a is None or b is None else a.intersection(b)
    return None if inside is None or inside.is_empty else inside


def _with_dim(r: ZRange, d: int, lo: int, hi: int) -> ZRange:
    return ZRange(r.start[:d] + (lo,) + r.start[d + 1 :], r.end[:d] + (hi,) + r.end[d + 1 :])


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
    n = len(dst.blocks)
    for k, need in enumerate(dst.blocks):
        if need is None:
            continue
        own = src.blocks[k]
        if src.partial:
            for j in range(n):
                have = src.blocks[j]
                inter = None if have is None or j == k else have.intersection(need)
                if inter is not None and not inter.is_empty:
                    moves.append(Transfer(j, k, inter))
            continue
        missing = box_difference(need, own) if own is not None else [need]
        for step in range(1, n):
            j = (k + step) % n
            have = src.blocks[j]
            if have is None or not missing:
                continue
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


def received_counts(src: Layout, dst: Layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per device, the cells and the messages it receives: what a reshard costs each device."""
    cells, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    for t in transfers(src, dst):
        cells[t.dst] += t.region.size
        messages[t.dst] += 1
    return tuple(cells), tuple(messages)


def received_elements(src: Layout, dst: Layout) -> tuple[int, ...]:
    """Cells each device receives: the communication volume per device."""
    return received_counts(src, dst)[0]
