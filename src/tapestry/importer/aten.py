"""ATen op -> Tapestry kernels: one converter per op family, kept as data in CONVERTERS.

A converter receives the Builder and the op's arguments (graph Values for
tensors computed from inputs, torch tensors for constants, Python values for
the rest) and returns the Value (or tuple of Values) of the op. It raises
Unsupported for a form it does not map, and the op then runs opaque.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts

Scalar = (bool, int, float)


def _scalar(value: Any) -> float | None:
    """A Python number, or a 0-dim constant tensor, as a float; else None."""
    if isinstance(value, Scalar):
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return float(value.item())
    return None


def _axis(value: int, ndim: int) -> int:
    return value % ndim if ndim else 0


# -- elementwise -----------------------------------------------------------------------------------------
UNARY = {
    "aten.relu.default": "relu", "aten.exp.default": "exp", "aten.neg.default": "neg", "aten.sqrt.default": "sqrt",
    "aten.rsqrt.default": "rsqrt", "aten.tanh.default": "tanh", "aten.erf.default": "erf",
    "aten.sin.default": "sin", "aten.cos.default": "cos", "aten.sigmoid.default": "sigmoid",
    "aten.silu.default": "silu", "aten.log.default": "log", "aten.abs.default": "abs",
    "aten.logical_not.default": "logical_not", "aten.bitwise_not.default": "logical_not",
}


def _unary(b: Builder, x: Any) -> Value:
    kernel = UNARY[str(b.node.target)]
    if kernel == "logical_not" and b.dtype != "bool":
        raise Unsupported("bitwise_not of integers")
    return b.op(kernel, b.tensor(x))


converts(*UNARY)(_unary)


@converts("aten.gelu.default")
def _gelu(b: Builder, x: Any, approximate: str = "none") -> Value:
    return b.op("gelu", b.tensor(x), approximate=approximate)


BINARY = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow", "maximum": "maximum",
    "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "logical_and": "logical_and", "logical_or": "logical_or", "__and__": "logical_and", "__or__": "logical_or",
    "bitwise_and": "logical_and", "bitwise_or": "logical_or",
}


def binary(b: Builder, kernel: str, lhs: Any, rhs: Any) -> Value:
    """A binary kernel, or its `_scalar` twin when one operand is a number (reverse when it is the left one)."""
    left, right = _scalar(lhs), _scalar(rhs)
    if kernel.startswith("logical") and b.dtype != "bool":
        raise Unsupported("a bitwise op on integers")
    if right is not None:
        return b.op(f"{kernel}_scalar", b.tensor(lhs), value=right)
    if left is not None:
        return b.op(f"{kernel}_scalar", b.tensor(rhs), value=left, reverse=True)
    return b.op(kernel, b.tensor(lhs), b.tensor(rhs))


def _binary(b: Builder, lhs: Any, rhs: Any, alpha: Any = 1, rounding_mode: str | None = None) -> Value:
    packet = str(b.node.target).split(".")[1]
    if rounding_mode is not None:
        raise Unsupported(f"rounding_mode={rounding_mode!r}")
    return binary(b, BINARY[packet], lhs, _scaled(b, rhs, alpha))


def _scaled(b: Builder, x: Any, alpha: Any) -> Any:
    """add/sub/rsub's `alpha * x`: a number stays a number."""
    if alpha == 1:
        return x
    return _scalar(x) * alpha if _scalar(x) is not None else binary(b, "mul", x, alpha)


converts(*(f"aten.{packet}.{overload}" for packet in BINARY
           for overload in ("Tensor", "Scalar", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor", "default",
                            "Tensor_mode")
           if overload in getattr(torch.ops.aten, packet).overloads()))(_binary)


@converts("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(b: Builder, x: Any, other: Any, alpha: Any = 1) -> Value:
    return binary(b, "sub", other, _scaled(b, x, alpha))


@converts("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default", "aten.hardtanh.default")
def _clamp(b: Builder, x: Any, low: Any = None, high: Any = None) -> Value:
    if str(b.node.target) == "aten.hardtanh.default":
        low, high = (-1.0 if low is None else low), (1.0 if high is None else high)
    if str(b.node.target) == "aten.clamp_max.default":
        low, high = None, low
    value = b.tensor(x)
    if low is not None:
        value = binary(b, "maximum", value, low)
    if high is not None:
        value = binary(b, "minimum", value, high)
    return value


@converts("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar")
def _where(b: Builder, cond: Any, a: Any, c: Any) -> Value:
    fill_a, fill_c = _scalar(a), _scalar(c)
    if fill_a is None and fill_c is None:
        return b.op("where", b.tensor(cond), b.tensor(a), b.tensor(c))
    if fill_c is not None and fill_a is None:
        return b.op("masked_fill", b.tensor(a), b.op("logical_not", b.tensor(cond)), value=fill_c)
    if fill_a is not None and fill_c is None:
        return b.op("masked_fill", b.tensor(c), b.tensor(cond), value=fill_a)
    return b.op("masked_fill", b.filled(fill_c, b.shape, b.dtype), b.tensor(cond), value=fill_a)  # two numbers


@converts("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(b: Builder, x: Any, mask: Any, value: Any) -> Value:
    fill = _scalar(value)
    if fill is None:
        raise Unsupported("a tensor fill value")
    return b.op("masked_fill", b.tensor(x), b.tensor(mask), value=fill)


@converts("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default")
def _to(b: Builder, x: Any, *rest: Any, **kwargs: Any) -> Value:
    value = b.tensor(x)
    return value if value.dtype == b.dtype else b.op("cast", value, dtype=b.dtype)


# -- views -------------------------------------------------------------------------------------------
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


@converts("aten.stack.default")
def _stack(b: Builder, tensors: list[Any], dim: int = 0) -> Value:
    values = [b.tensor(t) for t in tensors]
    axis = dim % (values[0].ndim + 1)
    lifted = [b.op("reshape", v, shape=(*v.shape[:axis], 1, *v.shape[axis:])) for v in values]
    out = lifted[0]
    for v in lifted[1:]:
        out = b.op("concat", out, v, axis=axis)
    return out


# -- linear algebra ----------------------------------------------------------------------------------------
def _weight_t(b: Builder, w: Any) -> Value:
    """torch's weight is [out, in]; Tapestry's linear reads [in, out]."""
    return b.op("transpose", b.tensor(w), perm=(1, 0))


@converts("aten.linear.default")
def _linear(b: Builder, x: Any, w: Any, bias: Any = None) -> Value:
    value = b.tensor(x)
    if value.ndim < 2:
        raise Unsupported("a 1-D input")
    if bias is None:
        return b.op("matmul", value, _weight_t(b, w))
    return b.op("linear", value, _weight_t(b, w), b.tensor(bias))


@converts("aten.addmm.default")
def _addmm(b: Builder, bias: Any, m1: Any, m2: Any, beta: Any = 1, alpha: Any = 1) -> Value:
    bias_v = b.tensor(bias)
    if beta == 1 and alpha == 1 and bias_v.ndim == 1:
        return b.op("linear", b.tensor(m1), b.tensor(m2), bias_v)
    product = binary(b, "mul", b.op("matmul", b.tensor(m1), b.tensor(m2)), alpha) if alpha != 1 else \
        b.op("matmul", b.tensor(m1), b.tensor(m2))
    return binary(b, "add", product, bias_v if beta == 1 else binary(b, "mul", bias_v, beta))


@converts("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _matmul(b: Builder, x: Any, y: Any) -> Value:
    a, c = b.tensor(x), b.tensor(y)
    if a.ndim < 2 or c.ndim < 2:
        raise Unsupported("a 1-D operand")
    if c.ndim > 2 and a.shape[:-2] != c.shape[:-2]:
        batch = b.shape[:-2]
        a = a if a.shape[:-2] == batch else b.op("expand", a, shape=(*batch, *a.shape[-2:]))
        c = c if c.shape[:-2] == batch else b.op("expand", c, shape=(*batch, *c.shape[-2:]))
    return b.op("matmul", a, c)


@converts("aten.embedding.default")
def _embedding(b: Builder, weight: Any, ids: Any, *rest: Any) -> Value:
    return b.op("embedding", b.tensor(ids), b.tensor(weight))


# -- normalisation and attention ------------------------------------------------------------------------------
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


@converts("aten.reciprocal.default")
def _reciprocal(b: Builder, x: Any) -> Value:
    return b.op("div_scalar", b.tensor(x), value=1.0, reverse=True)


@converts("aten.rms_norm.default")
def _rms_norm(b: Builder, x: Any, shape: list[int], w: Any = None, eps: float | None = None) -> Value:
    value = b.tensor(x)
    if len(shape) != 1:
        raise Unsupported(f"normalized_shape {list(shape)} (only the last dim)")
    weight = b.tensor(w) if w is not None else _filled(b, shape[0], value, 1.0)
    eps = torch.finfo(getattr(torch, value.dtype)).eps if eps is None else eps
    return b.op("rms_norm", value, weight, eps=float(eps))


@converts("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _softmax(b: Builder, x: Any, dim: int, *rest: Any) -> Value:
    value = b.tensor(x)
    kernel = "log_softmax" if "log_softmax" in str(b.node.target) else "softmax"
    return b.op(kernel, value, axis=_axis(dim, value.ndim))


@converts("aten.scaled_dot_product_attention.default")
def _sdpa(b: Builder, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Value:
    qv, kv, vv = b.tensor(q), b.tensor(k), b.tensor(v)
    if dropout_p:
        raise Unsupported("attention dropout")
    if qv.shape[:-2] != kv.shape[:-2]:
        raise Unsupported("grouped-query attention (key heads differ)")
    scale = 0.0 if scale is None else float(scale)
    if attn_mask is None:
        return b.op("sdpa", qv, kv, vv, causal=bool(is_causal), scale=scale)
    if is_causal:
        raise Unsupported("a mask together with is_causal")
    return b.op("sdpa_masked", qv, kv, vv, b.tensor(attn_mask), scale=scale)


# -- reductions ----------------------------------------------------------------------------------------------
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


# -- vision ----------------------------------------------------------------------------------------------------
def _square(name: str, value: Any) -> int:
    values = [value] if isinstance(value, int) else list(value)
    if len(set(values)) != 1:
        raise Unsupported(f"{name} {values} differs between dims")
    return int(values[0])


@converts("aten.conv2d.default", "aten.convolution.default")
def _conv2d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            *rest: Any) -> Value:
    if str(b.node.target) == "aten.convolution.default":
        transposed, _, groups = rest
        if transposed:
            raise Unsupported("transposed convolution")
    else:
        groups = rest[0] if rest else 1
    if isinstance(padding, str) or _square("dilation", dilation) != 1 or b.tensor(x).ndim != 4:
        raise Unsupported("string padding, dilation or a non-NCHW input")
    params = {"stride": _square("stride", stride), "padding": _square("padding", padding), "groups": int(groups)}
    if bias is None:
        return b.op("conv2d", b.tensor(x), b.tensor(w), **params)
    return b.op("conv2d_bias", b.tensor(x), b.tensor(w), b.tensor(bias), **params)


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


@converts("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def _max_pool(b: Builder, x: Any, kernel: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1,
              ceil_mode: bool = False) -> Any:
    if ceil_mode or _square("dilation", dilation) != 1:
        raise Unsupported("ceil_mode or dilation")
    k = _square("kernel", kernel)
    pooled = b.op("max_pool2d", b.tensor(x), kernel=k, stride=_square("stride", stride or k),
                  padding=_square("padding", padding))
    return (pooled, None) if "with_indices" in str(b.node.target) else pooled


@converts("aten.avg_pool2d.default")
def _avg_pool(b: Builder, x: Any, kernel: Any, stride: Any = (), padding: Any = 0, ceil_mode: bool = False,
              count_include_pad: bool = True, divisor_override: Any = None) -> Value:
    if ceil_mode or divisor_override is not None:
        raise Unsupported("ceil_mode or divisor_override")
    k = _square("kernel", kernel)
    return b.op("avg_pool2d", b.tensor(x), kernel=k, stride=_square("stride", stride or k),
                padding=_square("padding", padding), count_include_pad=bool(count_include_pad))


@converts("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default")
def _adaptive_avg_pool(b: Builder, x: Any, size: Any) -> Value:
    value = b.tensor(x)
    h, w = value.shape[-2:]
    oh, ow = (size, size) if isinstance(size, int) else size
    if (oh, ow) == (1, 1):
        return _reduce(b, "mean", value, [-1, -2], True)
    if h % oh or w % ow or h // oh != w // ow:
        raise Unsupported(f"output {oh}x{ow} does not tile the input {h}x{w} evenly")
    k = h // oh
    return b.op("avg_pool2d", value, kernel=k, stride=k, padding=0, count_include_pad=True)
