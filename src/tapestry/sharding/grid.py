"""Two layouts' blocks as arrays on one grid of cells: the box arithmetic of pricing and of reshard checks,
done for all blocks at once (numpy) rather than box by box."""
from __future__ import annotations

import numpy as np

from tapestry.sharding.layout import Layout
from tapestry.zspace.zrange import check_ndim


def cells(src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(src's, dst's) (devices, cells) arrays, 0/1 and bool: which cells each block covers, on the grid that
    every block bound of either layout cuts the tensor into (no cell is empty; an empty block covers none)."""
    (src_start, src_end, src_held), (dst_start, dst_end, dst_held) = bounds(src, dst)
    starts, ends = np.concatenate([src_start, dst_start]), np.concatenate([src_end, dst_end])
    held = np.concatenate([src_held, dst_held])
    if not held.any():
        return np.zeros((len(src_held), 0), np.int64), np.zeros((len(dst_held), 0), bool)
    inside = _inside(starts, ends, held)
    n = len(src_held)
    return inside[:n].astype(np.int64), inside[n:]


def covers(src: Layout, dst: Layout) -> bool:
    """Whether every cell a block of `dst` covers lies in a block of `src`, decided per distinct box of `dst` on the
    grid that the `src` boxes clipped to it cut it into, not on one grid every bound of both layouts cuts the whole
    tensor into: on 4x8x8 the fused attention backward's value has layouts whose bounds made that grid so fine that
    `cells`, pair by pair (`can_move`), took 41 of a 7B block training step's 68 CPU s of exploration (issue 24)."""
    (src_start, src_end, src_held), (dst_start, dst_end, dst_held) = bounds(src, dst)
    ndim = src_start.shape[1]
    src_boxes = np.unique(np.concatenate([src_start, src_end], axis=1)[src_held], axis=0)
    dst_boxes = np.unique(np.concatenate([dst_start, dst_end], axis=1)[dst_held], axis=0)
    dst_boxes = dst_boxes[(dst_boxes[:, :ndim] < dst_boxes[:, ndim:]).all(axis=1)]  # an empty block needs nothing
    for box in dst_boxes:
        start, end = box[:ndim], box[ndim:]
        lo, hi = np.maximum(src_boxes[:, :ndim], start), np.minimum(src_boxes[:, ndim:], end)
        meets = (lo < hi).all(axis=1)
        lo, hi = lo[meets], hi[meets]
        if not len(lo):
            return False
        if ((lo == start) & (hi == end)).all(axis=1).any():
            continue
        inside = _inside(np.vstack([lo, start]), np.vstack([hi, end]), np.ones(len(lo) + 1, bool))
        if (inside[-1] & ~inside[:-1].any(axis=0)).any():
            return False
    return True


def _inside(starts: np.ndarray, ends: np.ndarray, held: np.ndarray) -> np.ndarray:
    """(blocks, cells) bool: which cells of the grid the held blocks' bounds cut each block covers."""
    ndim = starts.shape[1]
    inside = held.reshape(-1, *(1,) * ndim)
    held_start, held_end = starts[held], ends[held]
    # a dim along which every block spans the same cells is one interval every block holds: no cut needed
    uniform = ((held_start == held_start[0]).all(axis=0) & (held_end == held_end[0]).all(axis=0)
               & (held_start[0] < held_end[0])).tolist()
    for d in range(ndim):
        if uniform[d]:
            continue
        cuts = np.unique(np.concatenate([held_start[:, d], held_end[:, d]]))
        axis = (starts[:, d, None] <= cuts[:-1]) & (cuts[1:] <= ends[:, d, None])  # (blocks, cells along d)
        inside = inside & axis.reshape(len(starts), *(1,) * d, axis.shape[1], *(1,) * (ndim - d - 1))
    return inside.reshape(len(starts), -1)


def bounds(src: Layout, dst: Layout) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Both layouts' `Layout.bounds`, of one rank (a layout holding no block has rank 0: it takes the other's)."""
    src_rank, dst_rank = src.bounds[0].shape[1], dst.bounds[0].shape[1]
    if src_rank == dst_rank:
        return src.bounds, dst.bounds
    if src.bounds[2].any() and dst.bounds[2].any():
        check_ndim("destination blocks", dst_rank, src_rank)
    ndim = max(src_rank, dst_rank)
    return tuple((np.zeros((len(held), ndim), np.int64) if start.shape[1] < ndim else start,
                  np.zeros((len(held), ndim), np.int64) if start.shape[1] < ndim else end, held)
                 for start, end, held in (src.bounds, dst.bounds))
