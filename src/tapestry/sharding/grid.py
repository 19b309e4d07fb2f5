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
    """Whether every cell a block of `dst` covers lies in a block of `src`: `cells` over each layout's distinct
    boxes only. On 4x8x8 a layout repeats each box on every device that replicates it, and the fused attention
    backward's per-row packing cuts its value's grid fine: pair by pair (`can_move`), `cells` took 41 of a 7B
    block training step's 68 CPU s of exploration (benchmarks/cluster.py --arch block --meshes 4x8x8)."""
    (src_start, src_end, src_held), (dst_start, dst_end, dst_held) = bounds(src, dst)
    src_boxes = np.unique(np.concatenate([src_start, src_end], axis=1)[src_held], axis=0)
    dst_boxes = np.unique(np.concatenate([dst_start, dst_end], axis=1)[dst_held], axis=0)
    if not len(dst_boxes):
        return True
    boxes = np.concatenate([src_boxes, dst_boxes])
    ndim = boxes.shape[1] // 2
    inside = _inside(boxes[:, :ndim], boxes[:, ndim:], np.ones(len(boxes), bool))
    n = len(src_boxes)
    return not (inside[n:].any(axis=0) & ~inside[:n].any(axis=0)).any()


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
