"""Normalisation: layer, RMS, batch and group norm, and weight norm."""
from __future__ import annotations

import math
from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.aten.common import _axis
from tapestry.importer.aten.reductions import _reduce
from tapestry.importer.translate import Builder, Unsupported, converts


def _filled(b: Builder, size: int, like: Value, fill: float) -> Value:
    """A constant [size] of `fill` in `like`'s dtype: an affine weight or bias the module left out."""
    return b.constant(torch.full((size,), fill, dtype=getattr(torch, like.dtype)))


@converts("aten.layer_norm.default")
def _layer_norm(b: Builder, x: Any, shape: list[int], w: Any = None, bias: Any = None, eps: float = 1e-5,
                *rest: Any) -> Value:
    value = b.tensor(x)
    if len(shape) != 1:
        raise Unsupported(f"normalized_shape {list(shape)} (only the last dim)")
    weight = b.tensor(w) if w is not None else _filled(b, shape[0], value, 1.0)
    shift = b.tensor(bias) if bias is not None else _filled(b, shape[0], value, 0.0)
    return b.op("layer_norm", value, weight, shift, eps=float(eps))


@converts("aten.native_layer_norm.default")
def _native_layer_norm(b: Builder, x: Any, shape: list[int], w: Any = None, bias: Any = None,
                       eps: float = 1e-5) -> tuple[Value, Value, Value]:
    """(normalized, mean, 1/std) over the last dim, the statistics kept (keepdim) for the backward."""
    value = b.tensor(x)
    normalized = _layer_norm(b, value, shape, w, bias, eps)
    mean = b.op("mean", value, axis=-1, keepdim=True)
    centred = b.op("sub", value, mean)
    variance = b.op("mean", b.op("mul", centred, centred), axis=-1, keepdim=True)
    return normalized, mean, b.op("rsqrt", b.op("add_scalar", variance, value=float(eps)))


@converts("aten.rms_norm.default")
def _rms_norm(b: Builder, x: Any, shape: list[int], w: Any = None, eps: float | None = None) -> Value:
    value = b.tensor(x)
    if len(shape) != 1:
        raise Unsupported(f"normalized_shape {list(shape)} (only the last dim)")
    weight = b.tensor(w) if w is not None else _filled(b, shape[0], value, 1.0)
    eps = torch.finfo(getattr(torch, value.dtype)).eps if eps is None else eps
    return b.op("rms_norm", value, weight, eps=float(eps))


@converts("aten._native_batch_norm_legit_no_training.default")
def _batch_norm_eval(b: Builder, x: Any, w: Any, bias: Any, mean: Any, var: Any, momentum: float,
                     eps: float) -> tuple[Value, None, None]:
    return (_batch_norm(b, x, w, bias, mean, var, eps), None, None)


@converts("aten.batch_norm.default")
def _batch_norm_op(b: Builder, x: Any, w: Any, bias: Any, mean: Any, var: Any, training: bool, momentum: float,
                   eps: float, *rest: Any) -> Value:
    if training or mean is None:
        raise Unsupported("batch norm in training mode")
    return _batch_norm(b, x, w, bias, mean, var, eps)


def _batch_norm(b: Builder, x: Any, w: Any, bias: Any, mean: Any, var: Any, eps: float) -> Value:
    value = b.tensor(x)
    channels = value.shape[1]
    weight = b.tensor(w) if w is not None else _filled(b, channels, value, 1.0)
    shift = b.tensor(bias) if bias is not None else _filled(b, channels, value, 0.0)
    return b.op("batch_norm", value, b.tensor(mean), b.tensor(var), weight, shift, eps=float(eps))


@converts("aten._native_batch_norm_legit.no_stats")
def _batch_norm_batch_statistics(b: Builder, x: Any, w: Any, bias: Any, training: bool, momentum: float,
                                 eps: float) -> tuple[Value, Value, Value]:
    """A batch norm by the batch's own statistics, with no running ones to update (BiT's weight
    standardization): (normalized, mean, 1/std), the statistics per channel (dim 1)."""
    value = b.tensor(x)
    if not training or value.ndim < 2:
        raise Unsupported("an evaluation-mode batch norm without running statistics")
    axes = [0, *range(2, value.ndim)]
    mean = _reduce(b, "mean", value, axes, True)
    centred = b.op("sub", value, mean)
    inverse = b.op("rsqrt", b.op("add_scalar", _reduce(b, "mean", b.op("mul", centred, centred), axes, True),
                                 value=float(eps)))
    out = b.op("mul", centred, inverse)
    per_channel = (value.shape[1], *(1,) * (value.ndim - 2))
    if w is not None:
        out = b.op("mul", out, b.op("reshape", b.tensor(w), shape=per_channel))
    if bias is not None:
        out = b.op("add", out, b.op("reshape", b.tensor(bias), shape=per_channel))
    channels = (value.shape[1],)
    return out, b.op("reshape", mean, shape=channels), b.op("reshape", inverse, shape=channels)


@converts("aten.group_norm.default")
def _group_norm(b: Builder, x: Any, groups: int, w: Any = None, bias: Any = None, eps: float = 1e-5,
                cudnn_enabled: bool = True) -> Value:
    """x[N, C, *] as [N, G, C/G·*]: a layer norm of the last dim (no affine), back to x's shape, then the
    per-channel scale and shift."""
    value = b.tensor(x)
    n, c, rest = value.shape[0], value.shape[1], value.shape[2:]
    if value.ndim < 2 or c % groups:
        raise Unsupported(f"{groups} groups of {c} channels")
    cells = (c // groups) * math.prod(rest)
    grouped = b.op("reshape", value, shape=(n, groups, cells))
    normed = b.op("layer_norm", grouped, _filled(b, cells, value, 1.0), _filled(b, cells, value, 0.0), eps=float(eps))
    out = b.op("reshape", normed, shape=value.shape)
    per_channel = (c, *(1,) * len(rest))
    if w is not None:
        out = b.op("mul", out, b.op("reshape", b.tensor(w), shape=per_channel))
    if bias is not None:
        out = b.op("add", out, b.op("reshape", b.tensor(bias), shape=per_channel))
    return out


@converts("aten._weight_norm.default")
def _weight_norm(b: Builder, v: Any, g: Any, dim: int = 0) -> Value:
    """v · g / ‖v‖, the norm over every dim but `dim` (kept as size 1); from static weights, prepared once."""
    value, gain = b.tensor(v), b.tensor(g)
    if dim == -1:  # torch: the norm over the whole tensor
        axes = range(value.ndim)
    else:
        axes = [d for d in range(value.ndim) if d != _axis(dim, value.ndim)]
    squares = b.op("mul", value, value)
    for axis in sorted(axes, reverse=True):
        squares = b.op("sum", squares, axis=axis, keepdim=True)
    return b.op("mul", value, b.op("div", gain, b.op("sqrt", squares)))
