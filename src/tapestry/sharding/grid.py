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
    ndim = starts.shape[1]
    inside = held.reshape(-1, *(1,) * ndim)
    held_start, held_end = starts[held], ends[held]
    if not len(held_start):
        return np.zeros((len(src_held), 0), np.int64), np.zeros((len(dst_held), 0), bool)
    # a dim along which every block spans the same cells is one interval every block holds: no cut needed
    uniform = ((held_start == held_start[0]).all(axis=0) & (held_end == held_end[0]).all(axis=0)
               & (held_start[0] < held_end[0])).tolist()
    for d in range(ndim):
        if uniform[d]:
            continue
        cuts = np.unique(np.concatenate([held_start[:, d], held_end[:, d]]))
        axis = (starts[:, d, None] <= cuts[:-1]) & (cuts[1:] <= ends[:, d, None])  # (blocks, cells along d)
        inside = inside & axis.reshape(len(held), *(1,) * d, axis.shape[1], *(1,) * (ndim - d - 1))
    inside = inside.reshape(len(held), -1)
    n = len(src_held)
    return inside[:n].astype(np.int64), inside[n:]


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
