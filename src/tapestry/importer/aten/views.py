"""Views and shapes: reshapes, transposes, expands, slices, selects, splits, repeats, concatenation and stacking."""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.aten.common import _axis
from tapestry.importer.translate import Builder, Unsupported, converts


VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints",
         "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
         "aten.unsqueeze.default", "aten.view_as.default", "aten.reshape_as.default")


@converts(*VIEWS)
def _view(b: Builder, x: Any, *rest: Any) -> Value:
    value = b.tensor(x)
    return value if value.shape == b.shape else b.op("reshape", value, shape=b.shape)


@converts("aten.permute.default")
def _permute(b: Builder, x: Any, dims: list[int]) -> Value:
    value = b.tensor(x)
    perm = tuple(_axis(d, value.ndim) for d in dims)
    return value if perm == tuple(range(value.ndim)) else b.op("transpose", value, perm=perm)


@converts("aten.transpose.int", "aten.t.default", "aten.numpy_T.default")
def _transpose(b: Builder, x: Any, d0: int = 0, d1: int = 1) -> Value:
    value = b.tensor(x)
    if value.ndim < 2:
        return value
    perm = list(range(value.ndim))
    a, c = _axis(d0, value.ndim), _axis(d1, value.ndim)
    perm[a], perm[c] = perm[c], perm[a]
    return value if a == c else b.op("transpose", value, perm=tuple(perm))


@converts("aten.expand.default", "aten.expand_as.default", "aten.broadcast_to.default")
def _expand(b: Builder, x: Any, *rest: Any) -> Value:
    value = b.tensor(x)
    return value if value.shape == b.shape else b.op("expand", value, shape=b.shape)


@converts("aten.slice.Tensor")
def _slice(b: Builder, x: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Value:
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    lo, hi, stride = slice(start, end, step).indices(value.shape[axis])
    if (lo, stride) == (0, 1) and hi >= value.shape[axis]:
        return value
    return b.op("slice", value, axis=axis, start=lo, stop=max(hi, lo), step=stride)


@converts("aten.narrow.default")
def _narrow(b: Builder, x: Any, dim: int, start: int, length: int) -> Value:
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    start = start % value.shape[axis] if start < 0 else start
    return b.op("slice", value, axis=axis, start=start, stop=start + length, step=1)


@converts("aten.select.int")
def _select(b: Builder, x: Any, dim: int, index: int) -> Value:
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    return b.op("select", value, axis=axis, index=index % value.shape[axis])


def _pieces(b: Builder, x: Any, sizes: list[int], dim: int) -> tuple[Value, ...]:
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    bounds = [0, *itertools.accumulate(sizes)]
    return tuple(value if (lo, hi) == (0, value.shape[axis]) else
                 b.op("slice", value, axis=axis, start=lo, stop=hi, step=1) for lo, hi in zip(bounds, bounds[1:]))


@converts("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unsafe_split.Tensor")
def _split(b: Builder, x: Any, size: Any, dim: int = 0) -> tuple[Value, ...]:
    value = b.tensor(x)
    n = value.shape[_axis(dim, value.ndim)]
    if isinstance(size, (list, tuple)):
        sizes = list(size)
    elif str(b.node.target) == "aten.chunk.default":
        step = math.ceil(n / size)
        sizes = [min(step, n - i) for i in range(0, n, step)]
    else:
        sizes = [min(size, n - i) for i in range(0, n, size)]
    return _pieces(b, value, sizes, dim)


@converts("aten.unbind.int")
def _unbind(b: Builder, x: Any, dim: int = 0) -> tuple[Value, ...]:
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    return tuple(b.op("select", value, axis=axis, index=i) for i in range(value.shape[axis]))


@converts("aten.cat.default", "aten.concat.default")
def _cat(b: Builder, tensors: list[Any], dim: int = 0) -> Value:
    values = [b.tensor(t) for t in tensors if not (isinstance(t, torch.Tensor) and t.numel() == 0)]
    axis = _axis(dim, max(v.ndim for v in values))
    out = values[0]
    for v in values[1:]:  # binary concat: a chain is what the kernel shards
        out = b.op("concat", out, v, axis=axis)
    return out


@converts("aten.slice_scatter.default")
def _slice_scatter(b: Builder, x: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None,
                   step: int = 1) -> Value:
    """x with src written over x[start:end] along dim: torch's functional form of `x[:, 1:] = y` (BART's
    shift_tokens_right)."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    lo, hi, stride = slice(start, end, step).indices(value.shape[axis])
    if stride != 1:
        raise Unsupported(f"a slice_scatter with step {stride} (step 1 is taken: one contiguous run)")
    if hi <= lo:  # no rows: x as it is, src (empty) never made a constant (the backward of Phi-3's `h[..., d:]`)
        return value
    return _overwrite(b, value, b.tensor(src), axis, lo, hi)


@converts("aten.select_scatter.default")
def _select_scatter(b: Builder, x: Any, src: Any, dim: int, index: int) -> Value:
    """x with src written over x.select(dim, index): `x[:, 0] = y`."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    row = b.op("reshape", b.tensor(src), shape=(*value.shape[:axis], 1, *value.shape[axis + 1 :]))
    at = index % value.shape[axis]
    return _overwrite(b, value, row, axis, at, at + 1)


def _overwrite(b: Builder, x: Value, src: Value, axis: int, lo: int, hi: int) -> Value:
    """x with rows [lo, hi) of `axis` replaced by src: x's rows before, src, x's rows after, `concat`ed."""
    src = src if src.dtype == x.dtype else b.op("cast", src, dtype=x.dtype)
    size = x.shape[axis]
    before = [b.op("slice", x, axis=axis, start=0, stop=lo, step=1)] if lo > 0 else []
    after = [b.op("slice", x, axis=axis, start=hi, stop=size, step=1)] if hi < size else []
    out, *rest = [*before, src, *after]
    for piece in rest:
        out = b.op("concat", out, piece, axis=axis)
    return out


@converts("aten.fill.Scalar", "aten.fill.Tensor")
def _fill(b: Builder, x: Any, value: Any) -> Value:
    """A tensor of x's shape and dtype holding one value: a number is a one-cell constant, a 0-dim tensor a
    `cast` if needed; either `expand`ed (a view)."""
    if not isinstance(value, (torch.Tensor, Value)):
        return b.filled(value, b.shape, b.dtype)
    cell = b.tensor(value)
    cell = cell if cell.dtype == b.dtype else b.op("cast", cell, dtype=b.dtype)
    return b.op("expand", cell, shape=b.shape)


@converts("aten.stack.default")
def _stack(b: Builder, tensors: list[Any], dim: int = 0) -> Value:
    values = [b.tensor(t) for t in tensors]
    axis = dim % (values[0].ndim + 1)
    lifted = [b.op("reshape", v, shape=(*v.shape[:axis], 1, *v.shape[axis:])) for v in values]
    out = lifted[0]
    for v in lifted[1:]:
        out = b.op("concat", out, v, axis=axis)
    return out


@converts("aten.repeat.default")
def _repeat(b: Builder, x: Any, repeats: list[int]) -> Value:
    """x tiled `repeats` times per dim (DeBERTa's relative positions): each dim s as [1, s] expanded to [r, s],
    then merged to r·s; views only."""
    value = b.tensor(x)
    shape = (*(1,) * (len(repeats) - value.ndim), *value.shape)
    spread = tuple(n for s in shape for n in (1, s))
    tiled = b.op("expand", b.op("reshape", value, shape=spread),
                 shape=tuple(n for r, s in zip(repeats, shape) for n in (int(r), s)))
    return b.op("reshape", tiled, shape=b.shape)


@converts("aten.repeat_interleave.self_int")
def _repeat_interleave(b: Builder, x: Any, repeats: int, dim: int | None = None, output_size: int | None = None
                       ) -> Value:
    """Each element along `dim` `repeats` times in a row (GPT-J's rotary sin/cos): dim s as [s, 1] expanded
    to [s, r], then merged; over the flattened tensor when `dim` is None."""
    value = b.tensor(x)
    if dim is None:
        value, axis = b.op("reshape", value, shape=(math.prod(value.shape),)), 0
    else:
        axis = _axis(dim, value.ndim)
    split = (*value.shape[: axis + 1], 1, *value.shape[axis + 1 :])
    spread = (*value.shape[: axis + 1], int(repeats), *value.shape[axis + 1 :])
    return b.op("reshape", b.op("expand", b.op("reshape", value, shape=split), shape=spread), shape=b.shape)


@converts("aten.roll.default")
def _roll(b: Builder, x: Any, shifts: list[int], dims: list[int] = ()) -> Value:
    """Swin's shifted windows: per dim, the last `shift` cells moved to the front, a concat of two slices (over
    the flattened tensor when no dim is given)."""
    value = b.tensor(x)
    if not dims:
        flat = b.op("reshape", value, shape=(math.prod(value.shape),))
        return b.op("reshape", _roll(b, flat, shifts, [0]), shape=value.shape)
    for shift, dim in zip(shifts, dims, strict=True):
        axis = _axis(dim, value.ndim)
        size = value.shape[axis]
        cut = size - int(shift) % size
        if cut != size:
            head, tail = _pieces(b, value, [cut, size - cut], axis)
            value = b.op("concat", tail, head, axis=axis)
    return value


@converts("aten.as_strided.default", "aten.as_strided_copy.default")
def _as_strided(b: Builder, x: Any, size: list[int], stride: list[int], storage_offset: int | None = None) -> Value:
    """Overlapping chunks of one dim (Longformer's `_chunk`, of its mask and its value): x's row-major strides, in
    some order of the dims, but for one adjacent pair (chunk, position) whose chunk stride is `step` positions,
    fewer than a chunk holds. That is x reshaped with the pair merged into the cells it covers, cut into
    `windows` and permuted, so the chunks split with halos. With no such pair, x's row-major strides in some order
    (the backward of those chunks reads its summed buffer back in the chunked tensor's transposed layout) are x
    reshaped and permuted. x arrives in memory order (translate's `_in_memory_order`); any other as_strided has
    no such value-level form and stays opaque."""
    value = b.tensor(x)
    if storage_offset:
        raise Unsupported(f"a storage offset ({storage_offset})")
    kept = [(int(n), int(s)) for n, s in zip(size, stride) if n != 1]
    pairs = [a for a, ((_, chunk), (width, cell)) in enumerate(zip(kept, kept[1:]))
             if cell > 0 and chunk % cell == 0 and 0 < chunk // cell < width]
    if len(pairs) > 1:
        raise Unsupported(f"size {list(size)}, stride {list(stride)}: more than one dim cut into overlapping windows")
    windowed = pairs[0] if pairs else None
    merged = kept
    if windowed is not None:
        (chunks, chunk_stride), (width, cell) = kept[windowed], kept[windowed + 1]
        step = chunk_stride // cell
        merged = [*kept[:windowed], ((chunks - 1) * step + width, cell), *kept[windowed + 2 :]]
    order = sorted(range(len(merged)), key=lambda d: -merged[d][1])  # memory order of the merged dims
    sizes = [merged[d][0] for d in order]
    if math.prod(sizes) != math.prod(value.shape) or [merged[d][1] for d in order] != [
            math.prod(sizes[k + 1 :]) for k in range(len(sizes))]:
        raise Unsupported(f"size {list(size)}, stride {list(stride)}: the view does not read x{list(value.shape)} "
                          "whole, row-major")
    cut = value if value.shape == tuple(sizes) else b.op("reshape", value, shape=tuple(sizes))
    labels = [(d, 0) for d in order]
    if windowed is not None:
        at = order.index(windowed)
        cut = b.op("windows", cut, axis=at, size=width, step=step)
        labels = labels[:at] + [(windowed, 0), (windowed, 1)] + labels[at + 1 :]
    wanted = [(d, k) for d in range(len(merged)) for k in ((0, 1) if d == windowed else (0,))]
    perm = tuple(labels.index(label) for label in wanted)
    cut = cut if perm == tuple(range(len(perm))) else b.op("transpose", cut, perm=perm)
    return cut if cut.shape == b.shape else b.op("reshape", cut, shape=b.shape)
