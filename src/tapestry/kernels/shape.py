"""Shape kernels: slice, select, concat, expand, pad, windows.

All are affine, so every output dim stays an index dim and splittable. slice
reads its axis with offset `start` and scale `step`; select reads one cell of
its axis; expand reads one cell of x's broadcast size-1 dims. concat is the
sum of two zero-padded reads: on its axis a is read in place and b shifted by
len(a), and reads outside a tensor are zeros, so each output block is
a_block + b_block (logical or for bool), whichever side of the seam it lies. windows reads
`size` cells of its axis every `step`: where windows overlap, neighbouring blocks read a halo.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow, promoted
from tapestry.kernels.reductions import _axis
from tapestry.kernels.registry import register

_DTYPES = ("float", "bool", "int64")


def _along(ndim: int, axis: int, item: slice | int) -> tuple[slice | int, ...]:
    """An index applying `item` to `axis` (possibly negative) of an ndim-dim array."""
    return (*[slice(None)] * (axis % ndim), item)


def _dims(n: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(n))


def slice_signature(x: Shape, axis: int, start: int, stop: int, step: int) -> SignatureSpec:
    ax = _axis(x, axis)
    if step < 1:
        raise KernelError(f"slice needs step >= 1; got step={step}")
    lo, hi, _ = slice(start, stop, step).indices(x[ax])
    out = tuple(len(range(lo, hi, step)) if d == ax else s for d, s in enumerate(x))
    n = len(x)
    at_axis = [d == ax for d in range(n)]
    scale, offset = [step if a else 1 for a in at_axis], [lo if a else 0 for a in at_axis]
    projection = follow(n, range(n), scale=scale, offset=offset)
    return SignatureSpec(_dims(n), out, (projection,), follow(n, range(n)), 0)


def _every_step(x, axis: int, start: int, stop: int, step: int):
    """The block read starts at a selected cell and spans step·(n-1)+1 cells: keep every step-th (numpy or torch)."""
    return x[_along(x.ndim, axis, slice(None, None, step))]


def _sample_slice(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[axis]
    lo = draw(st.integers(0, size - 1))
    hi = draw(st.integers(lo + 1, size + 2))
    start = lo - size if draw(st.booleans()) else lo
    params = {"axis": axis, "start": start, "stop": hi, "step": draw(st.integers(1, 3))}
    return (shape,), params, (draw(st.sampled_from(_DTYPES)),)


register(
    Kernel(
        name="slice",
        inputs=("x",),
        signature=slice_signature,
        numpy=_every_step,
        torch=_every_step,
        sample=_sample_slice,
        params={"axis": 0, "start": 0, "stop": 0, "step": 1},
        is_view=True,
        always_view=True,
        dtype_rule=promoted,
        takes_zero_size=False,
        doc="x[start:stop:step] along `axis` (Python's clipping; step >= 1)",
    )
)


def select_signature(x: Shape, axis: int, index: int) -> SignatureSpec:
    ax = _axis(x, axis)
    if not -x[ax] <= index < x[ax]:
        raise KernelError(f"select index {index} is out of range for axis {axis} of x{list(x)}")
    n = len(x) - 1
    rows = [None if d == ax else d - (d > ax) for d in range(len(x))]
    offset = [index % x[ax] if d == ax else 0 for d in range(len(x))]
    return SignatureSpec(_dims(n), x[:ax] + x[ax + 1 :], (follow(n, rows, offset=offset),), follow(n, range(n)), 0)


def _sample_select(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    index = draw(st.integers(-shape[axis], shape[axis] - 1))
    return (shape,), {"axis": axis, "index": index}, (draw(st.sampled_from(_DTYPES)),)


register(
    Kernel(
        name="select",
        inputs=("x",),
        signature=select_signature,
        numpy=lambda x, axis, index: x[_along(x.ndim, axis, 0)],
        torch=lambda x, axis, index: x.select(axis % x.ndim, 0),
        sample=_sample_select,
        params={"axis": 0, "index": 0},
        is_view=True,
        always_view=True,
        dtype_rule=promoted,
        doc="x[..., index, ...] along `axis`, which is dropped",
    )
)


def concat_signature(a: Shape, b: Shape, axis: int) -> SignatureSpec:
    ax = _axis(a, axis)
    if len(a) != len(b) or any(p != q for d, (p, q) in enumerate(zip(a, b)) if d != ax):
        raise KernelError(f"concat along axis {axis} needs equal shapes off that axis; got a{list(a)}, b{list(b)}")
    n = len(a)
    out = tuple(a[d] + b[d] if d == ax else a[d] for d in range(n))
    shifted = follow(n, range(n), offset=[-a[ax] if d == ax else 0 for d in range(n)])
    return SignatureSpec(_dims(n), out, (follow(n, range(n)), shifted), follow(n, range(n)), 1)


def _sample_concat(draw):
    shape = list(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    other = list(shape)
    other[axis] = draw(st.integers(1, 5))
    pair = draw(st.sampled_from([("float", "float"), ("bool", "bool"), ("int32", "int64"), ("float", "int64")]))
    return (tuple(shape), tuple(other)), {"axis": axis}, pair


register(
    Kernel(
        name="concat",
        inputs=("a", "b"),
        signature=concat_signature,
        numpy=lambda a, b, axis: a + b,  # numpy's + on bools is logical or
        torch=lambda a, b, axis: a + b,  # so is torch's
        sample=_sample_concat,
        params={"axis": 0},
        dtype_rule=promoted,
        takes_zero_size=False,
        doc="a and b joined along `axis` (each block is the sum of two zero-padded reads)",
    )
)


def _expanded(x: Shape, shape: tuple[int, ...]) -> Shape:
    """numpy broadcasting of x to `shape`; -1 keeps x's size, as in torch's expand."""
    lead = len(shape) - len(x)
    if lead < 0:
        raise KernelError(f"cannot expand x{list(x)} to fewer dims {list(shape)}")
    out = tuple(x[d - lead] if s == -1 and d >= lead else s for d, s in enumerate(shape))
    if any(s < 0 for s in out) or any(x[r] not in (1, out[lead + r]) for r in range(len(x))):
        raise KernelError(f"cannot expand x{list(x)} to {list(shape)}")
    return out


def expand_signature(x: Shape, shape: tuple[int, ...]) -> SignatureSpec:
    out = _expanded(x, shape)
    n, lead = len(out), len(out) - len(x)
    rows = [None if s == 1 and out[lead + r] != 1 else lead + r for r, s in enumerate(x)]
    return SignatureSpec(_dims(n), out, (follow(n, rows),), follow(n, range(n)), 0)


def _sample_expand(draw):
    out = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    keep = draw(st.integers(0, len(out)))
    x = tuple(s if draw(st.booleans()) else 1 for s in out[len(out) - keep :])
    shape = tuple(-1 if d >= len(out) - keep and x[d - len(out) + keep] == s and draw(st.booleans()) else s
                  for d, s in enumerate(out))
    return (x,), {"shape": shape}, (draw(st.sampled_from(_DTYPES)),)


register(
    Kernel(
        name="expand",
        inputs=("x",),
        signature=expand_signature,
        numpy=lambda x, shape, out_shape: np.broadcast_to(x, out_shape),
        torch=lambda x, shape, out_shape: x.expand(out_shape),
        sample=_sample_expand,
        params={"shape": ()},
        is_view=True,
        always_view=True,
        needs_out_shape=True,
        dtype_rule=promoted,
        takes_zero_size=False,
        doc="x broadcast to `shape` (numpy rules; -1 keeps x's size)",
    )
)


def pad_signature(x: Shape, pad: tuple[int, ...], value: float) -> SignatureSpec:
    """torch's pad list: (before, after) pairs from the last dim backwards; negative pads crop."""
    if len(pad) % 2 or len(pad) // 2 > len(x):
        raise KernelError(f"pad needs (before, after) pairs for at most {len(x)} dims; got pad={list(pad)}")
    before, after = [0] * len(x), [0] * len(x)
    for i in range(len(pad) // 2):
        before[-1 - i], after[-1 - i] = pad[2 * i], pad[2 * i + 1]
    out = tuple(s + b + a for s, b, a in zip(x, before, after))
    if any(s < 1 for s in out):
        raise KernelError(f"pad={list(pad)} leaves x{list(x)} with no cells along some dim")
    n = len(x)
    return SignatureSpec(_dims(n), out, (follow(n, range(n), offset=[-b for b in before]),), follow(n, range(n)), 0)


def _pad_fill(x, pad: tuple[int, ...], value: float, read_pad):
    """The block read (zeros outside x), its outside cells set to `value` (numpy or torch)."""
    out = x.copy() if isinstance(x, np.ndarray) else x.clone()
    if value != 0:
        for axis, (lead, trail) in enumerate(read_pad[0]):
            out[_along(x.ndim, axis, slice(0, lead))] = value
            out[_along(x.ndim, axis, slice(x.shape[axis] - trail, x.shape[axis]))] = value
    return out


def _sample_pad(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    pad = []
    for size in reversed(shape[len(shape) - draw(st.integers(1, len(shape))):]):
        crop = (size - 1) // 2
        pad += [draw(st.integers(-crop, 2)), draw(st.integers(-crop, 2))]
    return (shape,), {"pad": tuple(pad), "value": draw(st.sampled_from([0.0, 1.5, -2.0]))}, ("float",)


register(
    Kernel(
        name="pad",
        inputs=("x",),
        signature=pad_signature,
        numpy=_pad_fill,
        torch=_pad_fill,
        sample=_sample_pad,
        params={"pad": (), "value": 0.0},
        needs_read_pad=True,
        dtype_rule=promoted,
        takes_zero_size=False,
        doc="x padded with `value` (torch's pad list: (before, after) from the last dim; negative crops)",
    )
)


def windows_signature(x: Shape, axis: int, size: int, step: int) -> SignatureSpec:
    """Index dims are x's with `axis` replaced by the window count; a window reads `size` cells of x's axis from
    `step` times its position, so where windows overlap (step < size) that dim is windowed: blocks read halos."""
    ax = _axis(x, axis)
    if size < 1 or step < 1 or size > x[ax]:
        raise KernelError(f"windows needs 1 <= size <= x's axis {axis} ({x[ax]}) and step >= 1; "
                          f"got size={size}, step={step}")
    n = len(x)
    count = (x[ax] - size) // step + 1
    read = follow(n, range(n), shape=[size if d == ax else 1 for d in range(n)],
                  scale=[step if d == ax else 1 for d in range(n)])
    rows = [*range(ax + 1), None, *range(ax + 1, n)]
    out = follow(n, rows, shape=[size if r is None else 1 for r in rows])
    return SignatureSpec(_dims(n), tuple(count if d == ax else s for d, s in enumerate(x)), (read,), out, 0)


def _windows_numpy(x: np.ndarray, axis: int, size: int, step: int) -> np.ndarray:
    ax = axis % x.ndim
    every = np.lib.stride_tricks.sliding_window_view(x, size, axis=ax)[_along(x.ndim, ax, slice(None, None, step))]
    return np.moveaxis(every, -1, ax + 1).copy()


def _sample_windows(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    params = {"axis": axis, "size": draw(st.integers(1, shape[axis])), "step": draw(st.integers(1, 3))}
    return (shape,), params, (draw(st.sampled_from(_DTYPES)),)


register(
    Kernel(
        name="windows",
        inputs=("x",),
        signature=windows_signature,
        numpy=_windows_numpy,
        torch=lambda x, axis, size, step: x.unfold(axis % x.ndim, size, step).movedim(-1, axis % x.ndim + 1),
        sample=_sample_windows,
        params={"axis": 0, "size": 1, "step": 1},
        dtype_rule=promoted,
        takes_zero_size=False,
        doc="x's `axis` cut into windows of `size` cells every `step` cells, a new dim of `size` after it: "
            "out[..., c, i, ...] = x[..., c·step + i, ...] (torch's unfold with the window dim in place; an "
            "as_strided of overlapping chunks, Longformer's)",
    )
)
