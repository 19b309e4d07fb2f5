"""Kernels that read or write at positions held in an integer tensor: take, gather, scatter_add, scatter, one_hot.

Which cells an index names depends on its values, not on where a block lies, so the indexed axis of the
tensor read (or the whole index and source, for a scatter) is read whole by every block; every other dim
follows the index space and splits. Sharding along the indexed axis therefore costs what any other whole read
costs: the plan gathers that axis to the devices that need it.
"""
from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.reductions import _axis
from tapestry.kernels.registry import register

_INTS = ("int32", "int64")


def _along(axis: int, item) -> tuple:
    """An index applying `item` to `axis` (non-negative)."""
    return (*[slice(None)] * axis, item)


def _index_dtype(name: str, slot: str, value_slot: int):
    """The rule of a kernel whose input `slot` holds indices: they must be integers; the result is input
    `value_slot`'s dtype."""

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        index = in_dtypes[1]
        if index not in _INTS:
            raise KernelError(f"{name}: {slot} must be int32 or int64, got {index}")
        return in_dtypes[value_slot]

    return rule


# -- take: x[..., idx, ...] --------------------------------------------------------------------------------
def _index_into_x_along_axis(shapes: tuple[Shape, ...], slot: int, params: Mapping[str, ParamValue]) -> int | None:
    """The bound of the index argument's values (slot 1): the length of x (slot 0) along `axis`."""
    return shapes[0][params["axis"] % len(shapes[0])] if slot == 1 else None


def take_signature(x: Shape, idx: Shape, axis: int) -> SignatureSpec:
    ax = _axis(x, axis)
    pre, post = len(x[:ax]), len(x[ax + 1 :])
    n = pre + len(idx) + post
    rows = [*range(pre), None, *range(pre + len(idx), n)]
    return SignatureSpec(
        dims=(*(f"d{d}" for d in range(pre)), *(f"i{d}" for d in range(len(idx))),
              *(f"d{d}" for d in range(ax + 1, len(x)))),
        sizes=(*x[:ax], *idx, *x[ax + 1 :]),
        inputs=(follow(n, rows, shape=[x[ax] if r is None else 1 for r in rows]),
                follow(n, range(pre, pre + len(idx)))),
        output=follow(n, range(n)),
        flops_per_point=0,
    )


def _sample_take(draw):
    x = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    idx = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    axis = draw(st.integers(-len(x), len(x) - 1))
    return (x, idx), {"axis": axis}, (draw(st.sampled_from(("float", "int64", "bool"))), draw(st.sampled_from(_INTS)))


register(
    Kernel(
        name="take",
        inputs=("x", "idx"),
        signature=take_signature,
        numpy=lambda x, idx, axis: np.take(x, idx, axis=axis % x.ndim),
        torch=lambda x, idx, axis: x[_along(axis % x.dim(), idx.long())],
        sample=_sample_take,
        params={"axis": 0},
        dtype_rule=_index_dtype("take", "idx", 0),
        index_bound=_index_into_x_along_axis,
        takes_zero_size=False,
        doc="x[..., idx, ...]: idx (any shape, negatives count from the end) replaces x's `axis` (index_select, "
            "x[:, idx])",
    )
)


# -- gather: out[i, j] = x[i, index[i, j]] (axis 1) ------------------------------------------------------------
def gather_signature(x: Shape, index: Shape, axis: int) -> SignatureSpec:
    ax = _axis(x, axis)
    if len(index) != len(x) or any(i > s for d, (i, s) in enumerate(zip(index, x)) if d != ax):
        raise KernelError(f"gather along axis {axis} needs index no larger than x off that axis, with x's rank; "
                          f"got x{list(x)}, index{list(index)}")
    n = len(x)
    rows = [None if d == ax else d for d in range(n)]
    return SignatureSpec(
        dims=tuple(f"d{d}" for d in range(n)),
        sizes=index,
        inputs=(follow(n, rows, shape=[x[ax] if d == ax else 1 for d in range(n)]), follow(n, range(n))),
        output=follow(n, range(n)),
        flops_per_point=0,
    )


def _sample_gather(draw):
    x = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(x), len(x) - 1))
    index = tuple(draw(st.integers(1, 5)) if d == axis % len(x) else draw(st.integers(1, s)) for d, s in enumerate(x))
    return (x, index), {"axis": axis}, (draw(st.sampled_from(("float", "int64"))), draw(st.sampled_from(_INTS)))


register(
    Kernel(
        name="gather",
        inputs=("x", "index"),
        signature=gather_signature,
        numpy=lambda x, index, axis: np.take_along_axis(x, index, axis=axis),
        torch=lambda x, index, axis: torch.gather(x, axis, index.long()),
        sample=_sample_gather,
        params={"axis": 0},
        dtype_rule=_index_dtype("gather", "index", 0),
        index_bound=_index_into_x_along_axis,
        takes_zero_size=False,
        doc="out[..., i, ...] = x[..., index[..., i, ...], ...] along `axis` (torch.gather)",
    )
)


# -- scatter_add: out = x; out[..., index[..., i, ...], ...] += src[..., i, ...] ----------------------------------
def scatter_add_signature(x: Shape, index: Shape, src: Shape, axis: int, name: str = "scatter_add") -> SignatureSpec:
    ax = _axis(x, axis)
    if index != src or len(x) != len(index) or any(i > s for d, (i, s) in enumerate(zip(index, x)) if d != ax):
        raise KernelError(f"{name} along axis {axis} needs index and src of one shape, with x's rank and no "
                          f"larger than x off that axis; got x{list(x)}, index{list(index)}, src{list(src)}")
    n = len(x)
    rows = [None if d == ax else d for d in range(n)]
    whole = follow(n, rows, shape=[index[ax] if d == ax else 1 for d in range(n)])
    # one add per src cell: index[ax] of them per x[ax] output cells along the axis (a block split along it still
    # reads every src cell of its columns: its bytes, as index and src are read whole along the axis)
    return SignatureSpec(tuple(f"d{d}" for d in range(n)), x, (follow(n, range(n)), whole, whole),
                         follow(n, range(n)), Fraction(index[ax], max(1, x[ax])))


def _landing_numpy(x: np.ndarray, index: np.ndarray, ax: int,
                   block_start: tuple[int, ...]) -> tuple[list[np.ndarray], np.ndarray]:
    """index's cells as coordinates into this block of x (an index names a row of the whole x: the block's start
    along `ax` subtracted), and which of them land in the block (scatter and scatter_add)."""
    grid = list(np.indices(index.shape))
    grid[ax] = index - block_start[ax]
    return grid, (grid[ax] >= 0) & (grid[ax] < x.shape[ax])


def _landing_torch(x: torch.Tensor, index: torch.Tensor, ax: int,
                   block_start: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_landing_numpy`'s rows along `ax` and mask, in torch."""
    rows = index.long() - block_start[ax]
    return rows, (rows >= 0) & (rows < x.shape[ax])


def _scatter_add_numpy(x, index, src, axis: int, block_start: tuple[int, ...]) -> np.ndarray:
    """The block's rows of x plus the src cells whose index lands in them (reads past index's end are zeros, and
    so are their src cells)."""
    ax = axis % x.ndim
    out = x.copy()
    grid, keep = _landing_numpy(x, index, ax, block_start)
    np.add.at(out, tuple(g[keep] for g in grid), src[keep])
    return out


def _scatter_add_torch(x, index, src, axis: int, block_start: tuple[int, ...]):
    ax = axis % x.dim()
    rows, keep = _landing_torch(x, index, ax, block_start)
    return x.scatter_add(ax, torch.where(keep, rows, 0), torch.where(keep, src, torch.zeros_like(src)))


def _scatter_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    x, index, src = in_dtypes
    if index not in _INTS:
        raise KernelError(f"scatter_add: index must be int32 or int64, got {index}")
    if x != src or x == "bool":
        raise KernelError(f"scatter_add needs x and src of one numeric dtype (as torch does); got x: {x}, src: {src}")
    return x


def _sample_scatter_add(draw):
    x = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(x), len(x) - 1))
    index = tuple(draw(st.integers(1, 6)) if d == axis % len(x) else draw(st.integers(1, s)) for d, s in enumerate(x))
    value = draw(st.sampled_from(("float", "int64")))
    return (x, index, index), {"axis": axis}, (value, draw(st.sampled_from(_INTS)), value)


register(
    Kernel(
        name="scatter_add",
        inputs=("x", "index", "src"),
        signature=scatter_add_signature,
        numpy=_scatter_add_numpy,
        torch=_scatter_add_torch,
        sample=_sample_scatter_add,
        params={"axis": 0},
        needs_block_start=True,
        dtype_rule=_scatter_rule,
        index_bound=_index_into_x_along_axis,
        takes_zero_size=False,
        doc="x with src added at index along `axis` (torch.scatter_add; index_add and index_put(accumulate=True) "
            "import as it)",
    )
)


# -- scatter: out = x; out[..., index[..., i, ...], ...] = src[..., i, ...] ------------------------------------------
def _last_writes_numpy(index, ax: int):
    """Per position of `index`, whether it is the last along `ax` to name its cell: where positions repeat a cell
    the last one's value is written (torch's CPU kernel writes in order; torch leaves it unspecified), and every
    block decides it alike, as each reads index whole along `ax`."""
    order = np.argsort(index, axis=ax, kind="stable")
    ordered = np.take_along_axis(index, order, axis=ax)
    n = index.shape[ax]
    last = np.concatenate([np.take(ordered, range(n - 1), axis=ax) != np.take(ordered, range(1, n), axis=ax),
                           np.ones_like(np.take(ordered, [n - 1], axis=ax), dtype=bool)], axis=ax)
    found = np.empty_like(last)
    np.put_along_axis(found, order, last, axis=ax)
    return found


def _last_writes_torch(index, ax: int):
    ordered, order = torch.sort(index, dim=ax, stable=True)
    n = index.shape[ax]
    last = torch.cat([ordered.narrow(ax, 0, n - 1) != ordered.narrow(ax, 1, n - 1),
                      torch.ones_like(ordered.narrow(ax, 0, 1), dtype=torch.bool)], dim=ax)
    return torch.zeros_like(last).scatter(ax, order, last)


def _scatter_numpy(x, index, src, axis: int, block_start: tuple[int, ...]) -> np.ndarray:
    """The block's rows of x with the src cells whose index lands in them written over (reads past index's end
    are zeros, and so are their src cells)."""
    ax = axis % x.ndim
    out = x.copy()
    grid, lands = _landing_numpy(x, index, ax, block_start)
    keep = lands & _last_writes_numpy(index, ax)
    out[tuple(g[keep] for g in grid)] = src[keep]
    return out


def _scatter_torch(x, index, src, axis: int, block_start: tuple[int, ...]):
    """torch.scatter into x with one row more along the axis, where the writes other blocks make (and those a
    later position overwrites) land, cut off after."""
    ax = axis % x.dim()
    rows, lands = _landing_torch(x, index, ax, block_start)
    keep = lands & _last_writes_torch(index.long(), ax)
    spare = torch.cat([x, torch.zeros_like(x.narrow(ax, 0, 1))], dim=ax)
    return spare.scatter(ax, torch.where(keep, rows, x.shape[ax]), src).narrow(ax, 0, x.shape[ax])


def _scatter_value_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    x, index, src = in_dtypes
    if index not in _INTS:
        raise KernelError(f"scatter: index must be int32 or int64, got {index}")
    if x != src:
        raise KernelError(f"scatter needs x and src of one dtype (as torch does); got x: {x}, src: {src}")
    return x


def _sample_scatter(draw):
    shapes, params, (value, index, _) = _sample_scatter_add(draw)
    value = draw(st.sampled_from(("float", "int64", "bool")))
    return shapes, params, (value, index, value)


register(
    Kernel(
        name="scatter",
        inputs=("x", "index", "src"),
        signature=lambda x, index, src, axis: scatter_add_signature(x, index, src, axis, "scatter"),
        numpy=_scatter_numpy,
        torch=_scatter_torch,
        sample=_sample_scatter,
        params={"axis": 0},
        needs_block_start=True,
        dtype_rule=_scatter_value_rule,
        index_bound=_index_into_x_along_axis,
        takes_zero_size=False,
        doc="x with src written at index along `axis` (torch.scatter; a topk's backward); where positions repeat a "
            "cell the last one's value is written",
    )
)


# -- one_hot: out[..., c] = (idx[...] == c) --------------------------------------------------------------------------
def one_hot_signature(idx: Shape, classes: int) -> SignatureSpec:
    """idx's dims and a new class dim, which idx does not vary along: elementwise over idx, and the classes split
    too (a block of classes compares idx with its own)."""
    if classes < 1:
        raise KernelError(f"one_hot needs classes >= 1 (a count the data sets, torch's -1, is not taken); "
                          f"got classes={classes}")
    n = len(idx) + 1
    return SignatureSpec((*(f"d{d}" for d in range(n - 1)), "class"), (*idx, classes),
                         (follow(n, range(n - 1)),), follow(n, range(n)), 1)


def _one_hot_numpy(idx, classes: int, block_start: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    if idx.size and (idx.min() < 0 or idx.max() >= classes):
        raise ValueError(f"one_hot: class values must lie in [0, {classes}); got {idx.min()}..{idx.max()}")
    return (idx[..., None] == block_start[-1] + np.arange(out_shape[-1])).astype(np.int64)


def _one_hot_torch(idx, classes: int, block_start: tuple[int, ...], out_shape: tuple[int, ...]):
    """torch raises on values outside [0, classes) as one_hot does, without a host sync (a traced check)."""
    idx = idx.long()
    torch._assert_async(((idx >= 0) & (idx < classes)).all(), f"one_hot: class values must lie in [0, {classes})")
    found = block_start[-1] + torch.arange(out_shape[-1], device=idx.device)
    return (idx.unsqueeze(-1) == found).long()


def _one_hot_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if in_dtypes[0] not in _INTS:
        raise KernelError(f"one_hot: idx must be int32 or int64, got {in_dtypes[0]}")
    return "int64"


def _sample_one_hot(draw):
    idx = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    return (idx,), {"classes": draw(st.integers(1, 6))}, (draw(st.sampled_from(_INTS)),)


register(
    Kernel(
        name="one_hot",
        inputs=("idx",),
        signature=one_hot_signature,
        numpy=_one_hot_numpy,
        torch=_one_hot_torch,
        sample=_sample_one_hot,
        params={"classes": 1},
        needs_block_start=True,
        needs_out_shape=True,
        dtype_rule=_one_hot_rule,
        index_bound=lambda shapes, slot, params: params["classes"],
        takes_zero_size=False,
        doc="int64 one-hot rows of idx over `classes` classes, a new last dim (torch's one_hot with num_classes "
            "given); values outside [0, classes) raise, as in torch",
    )
)
