"""Reductions along axes (sum, mean, amax, max with its positions), softmax, scans (cumsum) and argmax/argmin."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch

from tapestry import dtypes
from tapestry.graph import Value
from tapestry.importer.aten.common import _axis
from tapestry.importer.translate import Builder, Unsupported, converts


@converts("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _softmax(b: Builder, x: Any, dim: int, *rest: Any) -> Value:
    value = b.tensor(x)
    kernel = "log_softmax" if "log_softmax" in str(b.node.target) else "softmax"
    return b.op(kernel, value, axis=_axis(dim, value.ndim))


def _reduce(b: Builder, kernel: str, x: Any, dims: Any, keepdim: bool) -> Value:
    value = b.tensor(x)
    axes = range(value.ndim) if dims is None or dims == [] else ([dims] if isinstance(dims, int) else dims)
    for axis in sorted({_axis(d, value.ndim) for d in axes}, reverse=True):  # last first: indices stay valid
        value = b.op(kernel, value, axis=axis, keepdim=bool(keepdim))
    return value


@converts("aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default")
def _reduction(b: Builder, x: Any, dims: Any = None, keepdim: bool = False, *rest: Any, **kwargs: Any) -> Value:
    kernel = {"sum": "sum", "mean": "mean", "amax": "amax"}[str(b.node.target).split(".")[1]]
    return _reduce(b, kernel, x, dims, keepdim)


@converts("aten.sum.default", "aten.mean.default")
def _reduce_all(b: Builder, x: Any, *rest: Any, **kwargs: Any) -> Value:
    return _reduce(b, str(b.node.target).split(".")[1], x, None, False)


@converts("aten.linalg_vector_norm.default")
def _vector_norm(b: Builder, x: Any, order: Any = 2, dims: Any = None, keepdim: bool = False,
                 dtype: Any = None) -> Value:
    """The 2-norm: the root of the sum of squares (ConvNeXt-V2's response norm, Swin-V2's cosine attention)."""
    if order != 2 or dtype is not None:
        raise Unsupported(f"ord={order!r}, dtype={dtype}")
    value = b.tensor(x)
    return b.op("sqrt", _reduce(b, "sum", b.op("mul", value, value), dims, keepdim))


@converts("aten.cumsum.default")
def _cumsum(b: Builder, x: Any, dim: int, dtype: torch.dtype | None = None) -> Value:
    value = b.tensor(x)
    if dtype is not None and value.dtype != dtypes.name_of(dtype):  # torch casts first, then sums
        value = b.op("cast", value, dtype=dtypes.name_of(dtype))
    return b.op("cumsum", value, axis=_axis(dim, value.ndim))


@converts("aten.argmax.default", "aten.argmin.default")
def _argmax(b: Builder, x: Any, dim: int | None = None, keepdim: bool = False) -> Value:
    value, kernel = b.tensor(x), str(b.node.target).split(".")[1]
    if dim is None:  # over the flattened tensor
        flat = b.op("reshape", value, shape=(math.prod(value.shape),)) if value.ndim != 1 else value
        found = b.op(kernel, flat, axis=0, keepdim=False)
        return b.op("reshape", found, shape=b.shape) if b.shape != found.shape else found
    return b.op(kernel, value, axis=_axis(dim, value.ndim), keepdim=bool(keepdim))


@converts("aten.max.dim")
def _max_dim(b: Builder, x: Any, dim: int, keepdim: bool = False) -> tuple[Value, Value | None]:
    """The largest values along `dim` and their positions: `amax` and `argmax` (the first of ties, NaN largest, as
    torch's max), each reading the axis whole, so the other dims split. A split axis would need each part's
    positions picked by its values, which no reduction here combines, so the axis stays whole. Positions no
    node reads (Switch's router keeps only the values) are not made."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    users = getattr(b.node, "users", None)  # an fx node's (a retargeted in-place op's are not known)
    read = {0, 1} if users is None or any(u.target is not operator.getitem for u in users) else {
        u.args[1] for u in users}
    return tuple(b.op(kernel, value, axis=axis, keepdim=bool(keepdim)) if k in read else None
                 for k, kernel in enumerate(("amax", "argmax")))
