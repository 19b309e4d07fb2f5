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

from tapestry import dtypes
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
    "bitwise_and": "logical_and", "bitwise_or": "logical_or", "floor_divide": "floor_divide",
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
    if rounding_mode not in (None, "floor"):
        raise Unsupported(f"rounding_mode={rounding_mode!r}")
    return binary(b, "floor_divide" if rounding_mode else BINARY[packet], lhs, _scaled(b, rhs, alpha))


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


@converts("aten.copy.default")
def _copy(b: Builder, into: Any, src: Any, non_blocking: bool = False) -> Value:
    """`into.copy_(src)`'s functional twin: `src` in `into`'s dtype and shape (a training step's buffer update)."""
    value = b.tensor(src)
    value = value if value.dtype == b.dtype else b.op("cast", value, dtype=b.dtype)
    return value if value.shape == b.shape else b.op("expand", value, shape=b.shape)


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
    if is_causal and attn_mask is not None:
        raise Unsupported("a mask together with is_causal")
    mask = b.tensor(attn_mask) if attn_mask is not None else None
    grouped = qv.ndim >= 3 and kv.ndim == qv.ndim and qv.shape[-3] != kv.shape[-3]
    if grouped:  # enable_gqa: query head h reads kv head h // G
        qv, kv, vv, mask = _grouped(b, qv, kv, vv, mask)
    elif qv.shape[:-2] != kv.shape[:-2]:
        raise Unsupported(f"q{list(qv.shape)} and k{list(kv.shape)} differ in batch dims")
    scale = 0.0 if scale is None else float(scale)
    if mask is None:
        out = b.op("sdpa", qv, kv, vv, causal=bool(is_causal), scale=scale)
    else:
        out = b.op("sdpa_masked", qv, kv, vv, mask, scale=scale)
    return b.op("reshape", out, shape=b.shape) if grouped else out


def _grouped(b: Builder, q: Value, k: Value, v: Value, mask: Value | None) -> tuple[Any, ...]:
    """Grouped-query attention as sdpa with shared kv heads: the head dim of q (H = Hkv·G) split into [Hkv, G],
    k's and v's into [Hkv, 1] (broadcast over the group), a mask's into [Hkv, G] or [1, 1]. Both Hkv and G are
    then index dims of sdpa, so heads shard consistently: q head h = G·kv + g and its kv head h // G together."""
    heads, shared = q.shape[-3], k.shape[-3]
    if shared == 0 or heads % shared or v.shape[-3] != shared:
        raise Unsupported(f"{heads} query heads over {shared} key and {v.shape[-3]} value heads")
    group = heads // shared

    def split(x: Value, into: tuple[int, int]) -> Value:
        return b.op("reshape", x, shape=(*x.shape[:-3], *into, *x.shape[-2:]))

    if mask is not None:
        mask = mask if mask.ndim >= 3 else b.op("reshape", mask, shape=(*(1,) * (3 - mask.ndim), *mask.shape))
        mask = split(mask, (shared, group) if mask.shape[-3] == heads else (1, 1))
    return split(q, (shared, group)), split(k, (shared, 1)), split(v, (shared, 1)), mask


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


# -- scans, indexing and orderings ------------------------------------------------------------------------------
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


@converts("aten.index.Tensor")
def _index(b: Builder, x: Any, indices: list[Any]) -> Value:
    """x[idx], x[:, idx] (one integer index tensor) and x[i, j] (CLIP's pooling, `h[arange(B), ids.argmax(-1)]`):
    the indexed dims (moved first when not adjacent, as torch does) merged into one (`reshape`) and read at the
    flat position Σ i_k · stride_k (negatives wrapped, the indices broadcast), a `take`."""
    value = b.tensor(x)
    given = [(axis, b.tensor(i)) for axis, i in enumerate(indices) if i is not None]
    axes = [axis for axis, _ in given]
    if axes != list(range(axes[0], axes[0] + len(axes))):  # not adjacent: torch puts the index dims first
        value = b.op("transpose", value, perm=(*axes, *(d for d in range(value.ndim) if d not in axes)))
        given = [(k, i) for k, (_, i) in enumerate(given)]
        axes = list(range(len(given)))
    if any(i.dtype not in ("int32", "int64") for _, i in given):
        raise Unsupported("a bool mask index (its result's shape depends on the values)")
    first = axes[0]
    if len(given) == 1:
        return b.op("take", value, given[0][1], axis=first)
    shape = tuple(torch.broadcast_shapes(*(i.shape for _, i in given)))
    sizes = [value.shape[a] for a in axes]
    flat = None
    for k, (axis, idx) in enumerate(given):
        idx = idx if idx.dtype == "int64" else b.op("cast", idx, dtype="int64")
        negative = b.op("cast", b.op("lt_scalar", idx, value=0.0), dtype="int64")
        idx = b.op("add", idx, b.op("mul_scalar", negative, value=float(sizes[k])))  # wrapped
        stride = math.prod(sizes[k + 1 :])
        term = idx if stride == 1 else b.op("mul_scalar", idx, value=float(stride))
        term = term if term.shape == shape else b.op("expand", term, shape=shape)
        flat = term if flat is None else b.op("add", flat, term)
    merged = b.op("reshape", value, shape=(*value.shape[:first], math.prod(sizes), *value.shape[axes[-1] + 1 :]))
    return b.op("take", merged, flat, axis=first)


@converts("aten.index_select.default")
def _index_select(b: Builder, x: Any, dim: int, idx: Any) -> Value:
    value = b.tensor(x)
    return b.op("take", value, b.tensor(idx), axis=_axis(dim, value.ndim))


@converts("aten.gather.default")
def _gather(b: Builder, x: Any, dim: int, index: Any, sparse_grad: bool = False) -> Value:
    value = b.tensor(x)
    return b.op("gather", value, b.tensor(index), axis=_axis(dim, value.ndim))


@converts("aten.scatter_add.default")
def _scatter_add(b: Builder, x: Any, dim: int, index: Any, src: Any) -> Value:
    value, idx, source = b.tensor(x), b.tensor(index), b.tensor(src)
    if idx.shape != source.shape:
        raise Unsupported(f"src{list(source.shape)} larger than index{list(idx.shape)} (torch reads a box of it)")
    return b.op("scatter_add", value, idx, source, axis=_axis(dim, value.ndim))


def _index_add(b: Builder, x: Value, axis: int, idx: Value, src: Value) -> Value:
    """x with src[..., k, ...] added at row idx[k] of `axis` (1-D idx): a scatter_add of idx broadcast to src."""
    if idx.ndim != 1:
        raise Unsupported(f"a {idx.ndim}-D index (1-D is taken)")
    full = (*x.shape[:axis], idx.shape[0], *x.shape[axis + 1 :])
    src = src if src.shape == full else b.op("expand", src, shape=full)
    column = b.op("reshape", idx, shape=tuple(s if d == axis else 1 for d, s in enumerate(full)))
    return b.op("scatter_add", x, b.op("expand", column, shape=full), src, axis=axis)


@converts("aten.index_add.default")
def _index_add_op(b: Builder, x: Any, dim: int, index: Any, source: Any, alpha: Any = 1) -> Value:
    value = b.tensor(x)
    return _index_add(b, value, _axis(dim, value.ndim), b.tensor(index), _scaled(b, b.tensor(source), alpha))


@converts("aten.index_put.default")
def _index_put(b: Builder, x: Any, indices: list[Any], values: Any, accumulate: bool = False) -> Value:
    """x[idx] += v (accumulate) is a scatter_add. Without accumulate, repeated indices write in an unspecified
    order, so only a permutation is taken: the indices of a full sort of the axis (MoE's inverse permutation,
    `inv[perm] = arange`) write every row once, which is a scatter_add into zeros."""
    given = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        raise Unsupported(f"{len(given)} index tensors (one is taken: x[idx] += v, x[:, idx] += v)")
    (axis, idx), = given
    idx, value = b.tensor(idx), b.tensor(x)
    if idx.dtype == "bool":
        raise Unsupported("a bool mask index")
    if accumulate:
        return _index_add(b, value, axis, idx, b.tensor(values))
    if not (_is_permutation(b, idx) and idx.shape[0] == value.shape[axis]):
        raise Unsupported("index_put without accumulate of indices not known to be a permutation (repeated "
                          "indices write in an unspecified order)")
    zeros = b.constant(torch.zeros(value.shape, dtype=getattr(torch, value.dtype)))
    return _index_add(b, zeros, axis, idx, b.tensor(values))


def _is_permutation(b: Builder, idx: Value) -> bool:
    """idx is the positions of a full 1-D sort (a `topk` with indices and k the whole axis)."""
    if idx.ndim != 1 or idx.name not in b.graph:
        return False
    node = b.graph[idx.name]
    return node.op == "topk" and dict(node.params)["indices"] and b.graph[node.args[0]].shape == idx.shape


def _ordered(b: Builder, x: Value, axis: int, k: int, largest: bool) -> tuple[Value, Value]:
    return tuple(b.op("topk", x, axis=axis, k=k, largest=largest, indices=i) for i in (False, True))


@converts("aten.topk.default")
def _topk(b: Builder, x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple[Value, Value]:
    if not sorted:
        raise Unsupported("sorted=False (torch leaves the order unspecified)")
    value = b.tensor(x)
    return _ordered(b, value, _axis(dim, value.ndim), int(k), bool(largest))


@converts("aten.sort.default", "aten.sort.stable")
def _sort(b: Builder, x: Any, dim: int = -1, descending: bool = False, *, stable: bool | None = None
          ) -> tuple[Value, Value]:
    """A stable sort is one valid answer of an unstable one."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    return _ordered(b, value, axis, value.shape[axis], bool(descending))


@converts("aten.argsort.default", "aten.argsort.stable")
def _argsort(b: Builder, x: Any, dim: int = -1, descending: bool = False, *, stable: bool | None = None) -> Value:
    return _sort(b, x, dim, descending)[1]


# -- einsum --------------------------------------------------------------------------------------------------
def _einsum_labels(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Each operand's labels and the output's, with `...` spelled as fresh upper-case labels (torch's implicit
    output: the ellipsis, then the labels seen once, in alphabetical order)."""
    spec = equation.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported(f"{len(terms)} terms for {len(ranks)} operands")
    fresh = max((rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(chr(ord("Z") - i) for i in reversed(range(fresh)))
    if any(c.isupper() for c in spec):
        raise Unsupported("upper-case labels")
    labels = []
    for term, rank in zip(terms, ranks):
        own = rank - len(term.replace("...", ""))
        labels.append(term.replace("...", ellipsis[fresh - own :]) if "..." in term else term)
        if len(labels[-1]) != rank:
            raise Unsupported(f"term {term!r} does not fit a {rank}-D operand")
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:
        seen = "".join(labels)
        output = ellipsis + "".join(sorted(c for c in set(seen) if seen.count(c) == 1 and c.islower()))
    for term in (*labels, output):
        if len(set(term)) != len(term):
            raise Unsupported(f"a label repeated within {term!r} (a diagonal)")
    return labels, output


def _arranged(b: Builder, value: Value, labels: str, order: str) -> Value:
    """`value` (dims named by `labels`) transposed to `order`."""
    perm = tuple(labels.index(c) for c in order)
    return value if perm == tuple(range(len(perm))) else b.op("transpose", value, perm=perm)


def _reshaped(b: Builder, value: Value, shape: tuple[int, ...]) -> Value:
    return value if value.shape == shape else b.op("reshape", value, shape=shape)


def _summed(b: Builder, value: Value, labels: str, keep: set[str]) -> tuple[Value, str]:
    """Labels not in `keep` summed away (they appear in no other operand and not in the output)."""
    for axis in reversed(range(len(labels))):
        if labels[axis] not in keep:
            value = b.op("sum", value, axis=axis, keepdim=False)
    return value, "".join(c for c in labels if c in keep)


def _contract(b: Builder, a: Value, la: str, c: Value, lc: str, keep: set[str]) -> tuple[Value, str]:
    """a·c over their shared labels not in `keep`, as one matmul: a to [batch, m, k], c to [batch, k, n] (no
    batch: a keeps its m dims as matmul's leading dims and c is 2-D, so a linear-style einsum shards like one)."""
    a, la = _summed(b, a, la, keep | set(lc))
    c, lc = _summed(b, c, lc, keep | set(la))
    size = {**dict(zip(la, a.shape)), **dict(zip(lc, c.shape))}
    if any(dict(zip(la, a.shape))[x] != dict(zip(lc, c.shape))[x] for x in set(la) & set(lc)):
        raise Unsupported("a label of different sizes in two operands (broadcasting)")
    batch = [x for x in la if x in lc and x in keep]
    inner = [x for x in la if x in lc and x not in keep]
    m, n = [x for x in la if x not in lc], [x for x in lc if x not in la]
    k = math.prod(size[x] for x in inner)
    if batch:
        shape_a = (*(size[x] for x in batch), math.prod(size[x] for x in m), k)
        shape_c = (*(size[x] for x in batch), k, math.prod(size[x] for x in n))
    else:
        shape_a = (*(size[x] for x in m), k) if m else (1, k)
        shape_c = (k, math.prod(size[x] for x in n))
    left = _reshaped(b, _arranged(b, a, la, "".join(batch + m + inner)), shape_a)
    right = _reshaped(b, _arranged(b, c, lc, "".join(batch + inner + n)), shape_c)
    labels = "".join(batch + m + n)
    return _reshaped(b, b.op("matmul", left, right), tuple(size[x] for x in labels)), labels


@converts("aten.einsum.default")
def _einsum(b: Builder, equation: str, operands: list[Any], path: Any = None) -> Value:
    """Pairwise, left to right (torch's order without opt_einsum): each pair one matmul with transposes and
    reshapes around it, so einsum attention and einsum linears shard as matmuls do."""
    values = [b.tensor(t) for t in operands]
    labels, output = _einsum_labels(equation, [v.ndim for v in values])
    value, have = _summed(b, values[0], labels[0], set(output).union(*labels[1:]))
    for i in range(1, len(values)):
        later = set(output).union(*labels[i + 1 :])
        value, have = _contract(b, value, have, values[i], labels[i], later)
    if set(have) != set(output):
        raise Unsupported(f"output labels {output!r} not among the operands' {have!r}")
    return _arranged(b, value, have, output)


# -- padding, 1-D and transposed convolution, upsampling ---------------------------------------------------------
@converts("aten.constant_pad_nd.default", "aten.pad.default")
def _pad(b: Builder, x: Any, pad: list[int], mode: str = "constant", value: float | None = None) -> Value:
    if mode != "constant":
        raise Unsupported(f"mode={mode!r} (constant padding is taken)")
    tensor = b.tensor(x)
    return tensor if not any(pad) else b.op("pad", tensor, pad=tuple(int(p) for p in pad), value=float(value or 0.0))


def _per_dim(name: str, value: Any, n: int) -> list[int]:
    values = [int(value)] * n if isinstance(value, int) else [int(v) for v in value]
    if len(values) == 1:
        values *= n
    if len(values) != n:
        raise Unsupported(f"{name} {values} for {n} spatial dims")
    return values


@converts("aten.conv1d.default")
def _conv1d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            groups: int = 1) -> Value:
    """conv2d over [N, C, 1, L]: the padding made explicit (a `pad` of L), the kernel one row high."""
    value, weight = b.tensor(x), b.tensor(w)
    if isinstance(padding, str) or _per_dim("dilation", dilation, 1) != [1] or value.ndim != 3:
        raise Unsupported("string padding, dilation or a non-NCL input")
    (p,), (s,) = _per_dim("padding", padding, 1), _per_dim("stride", stride, 1)
    padded = b.op("pad", value, pad=(p, p), value=0.0) if p else value
    rows = b.op("reshape", padded, shape=(padded.shape[0], padded.shape[1], 1, padded.shape[2]))
    kernel = b.op("reshape", weight, shape=(weight.shape[0], weight.shape[1], 1, weight.shape[2]))
    params = {"stride": s, "padding": 0, "groups": int(groups)}
    out = b.op("conv2d", rows, kernel, **params) if bias is None else \
        b.op("conv2d_bias", rows, kernel, b.tensor(bias), **params)
    return b.op("reshape", out, shape=b.shape)


@converts("aten.conv_transpose2d.input")
def _conv_transpose2d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
                      output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Value:
    """A transposed conv is a conv2d (stride 1) of x with stride-1 zeros put between its cells and k-1-p padding
    around, by the weight flipped in space with its channel axes swapped (per group)."""
    value, weight = b.tensor(x), b.tensor(w)
    if value.ndim != 4 or _per_dim("dilation", dilation, 2) != [1, 1]:
        raise Unsupported("dilation or a non-NCHW input")
    strides, pads, extra = (_per_dim(n, v, 2) for n, v in (("stride", stride), ("padding", padding),
                                                           ("output_padding", output_padding)))
    n, c, h, wd = value.shape
    cin, kg, kh, kw = weight.shape
    spread = value
    if strides != [1, 1]:  # [N, C, H, 1, W, 1] padded to [N, C, H, sh, W, sw]: each cell, then sh-1 zeros
        (sh, sw) = strides
        spread = b.op("reshape", value, shape=(n, c, h, 1, wd, 1))
        spread = b.op("pad", spread, pad=(0, sw - 1, 0, 0, 0, sh - 1), value=0.0)
        spread = b.op("reshape", spread, shape=(n, c, h * sh, wd * sw))
    # then (k-1-p) on each side, less the trailing stride-1 zeros, plus output_padding at the end
    around = []
    for size, k, s, p, op in ((wd, kw, strides[1], pads[1], extra[1]), (h, kh, strides[0], pads[0], extra[0])):
        around += [k - 1 - p, k - 1 - p - (s - 1) + op]
    padded = b.op("pad", spread, pad=tuple(around), value=0.0) if any(around) else spread
    flipped = weight
    for axis, size in ((2, kh), (3, kw)):
        if size > 1:
            flipped = b.op("take", flipped, b.constant(torch.arange(size - 1, -1, -1)), axis=axis)
    swapped = b.op("reshape", flipped, shape=(groups, cin // groups, kg, kh, kw))
    swapped = b.op("transpose", swapped, perm=(0, 2, 1, 3, 4))
    swapped = b.op("reshape", swapped, shape=(groups * kg, cin // groups, kh, kw))
    params = {"stride": 1, "padding": 0, "groups": int(groups)}
    if bias is None:
        return b.op("conv2d", padded, swapped, **params)
    return b.op("conv2d_bias", padded, swapped, b.tensor(bias), **params)


def _upsampled_size(b: Builder) -> tuple[int, int]:
    return b.shape[-2], b.shape[-1]


@converts("aten.upsample_nearest2d.vec", "aten.upsample_nearest2d.default")
def _upsample_nearest(b: Builder, x: Any, *rest: Any) -> Value:
    """Whole scale factors are views (each cell repeated: reshape, expand, reshape); others a `take` of the rows
    and columns torch picks (read off torch's own op applied to their positions)."""
    value = b.tensor(x)
    (n, c, h, w), (oh, ow) = value.shape, _upsampled_size(b)
    if oh % h == 0 and ow % w == 0 and _nearest_index(b, rest, h, oh, 2) == [i // (oh // h) for i in range(oh)] \
            and _nearest_index(b, rest, w, ow, 3) == [i // (ow // w) for i in range(ow)]:
        fh, fw = oh // h, ow // w
        cells = b.op("reshape", value, shape=(n, c, h, 1, w, 1))
        cells = b.op("expand", cells, shape=(n, c, h, fh, w, fw))
        return b.op("reshape", cells, shape=(n, c, oh, ow))
    rows = b.op("take", value, b.constant(torch.tensor(_nearest_index(b, rest, h, oh, 2))), axis=2)
    return b.op("take", rows, b.constant(torch.tensor(_nearest_index(b, rest, w, ow, 3))), axis=3)


def _nearest_index(b: Builder, rest: tuple[Any, ...], size: int, out: int, axis: int) -> list[int]:
    """The input position torch's op reads for each output position along `axis`: the op run on positions."""
    shape = [1, 1, 1, 1]
    shape[axis] = size
    positions = torch.arange(size, dtype=torch.float64).reshape(shape)
    other = 3 if axis == 2 else 2
    positions = positions.expand(*(s if d != other else b.node.args[0].meta["val"].shape[other]
                                   for d, s in enumerate(shape)))
    picked = b.node.target(positions, *rest)
    return [int(v) for v in picked.select(other, 0).flatten()]


@converts("aten.upsample_bilinear2d.vec", "aten.upsample_bilinear2d.default")
def _upsample_bilinear(b: Builder, x: Any, *rest: Any) -> Value:
    """Bilinear interpolation is separable and linear: x @ Aw then Ah @ (that), two matmuls by constant
    matrices read off torch's own op applied to unit vectors (so align_corners and scales are torch's)."""
    value = b.tensor(x)
    (n, c, h, w), (oh, ow) = value.shape, _upsampled_size(b)
    if not dtypes.is_float(value.dtype):
        raise Unsupported(f"a {value.dtype} input")
    a_h, a_w = (_interpolation(b, rest, size, axis) for size, axis in ((h, 2), (w, 3)))  # [size, out]
    dtype = getattr(torch, value.dtype)
    across = b.op("matmul", value, b.constant(a_w.to(dtype)))  # [N, C, H, OW]
    down = b.op("matmul", b.op("transpose", across, perm=(0, 1, 3, 2)), b.constant(a_h.to(dtype)))  # [N, C, OW, OH]
    return b.op("transpose", down, perm=(0, 1, 3, 2))


def _interpolation(b: Builder, rest: tuple[Any, ...], size: int, axis: int) -> torch.Tensor:
    """[size, out]: row j is the op's output along `axis` for the unit vector e_j (constant along the other
    spatial axis, which interpolation keeps constant)."""
    shape = list(b.node.args[0].meta["val"].shape[2:])
    units = torch.eye(size, dtype=torch.float64).reshape(size, 1, *(size if d == axis - 2 else 1 for d in range(2)))
    units = units.expand(size, 1, *shape)
    out = b.node.target(units, *rest)  # [size, 1, OH, OW]
    return out[:, 0, :, 0] if axis == 2 else out[:, 0, 0, :]


# -- group norm, weight norm, embedding bags, histograms ---------------------------------------------------------
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


@converts("aten.embedding_bag.padding_idx", "aten._embedding_bag.default", "aten.embedding_bag.default")
def _embedding_bag(b: Builder, weight: Any, ids: Any, offsets: Any, scale_grad_by_freq: bool = False,
                   mode: int = 0, sparse: bool = False, per_sample_weights: Any = None,
                   include_last_offset: bool = False, padding_idx: int | None = None) -> tuple[Any, ...]:
    """Bags of rows, summed (mode 0) or averaged (mode 1): the rows are an `embedding`, each id's bag is the
    number of offsets at or before its position, less one (`ge`, `sum`), and the bags are a `scatter_add` into
    zeros; a mean divides by the bag sizes (an empty bag gives zeros, as torch). Only the bags are converted
    (the other three outputs serve the backward)."""
    table, index = b.tensor(weight), b.tensor(ids)
    if mode not in (0, 1) or (padding_idx is not None and padding_idx >= 0):
        raise Unsupported(f"mode {mode} (0: sum and 1: mean are taken) or a padding_idx")
    if per_sample_weights is not None and mode != 0:
        raise Unsupported("per_sample_weights with a mean")
    rows = b.op("embedding", index, table)
    if index.ndim == 2:  # [B, L]: fixed-size bags, no offsets
        if per_sample_weights is not None:
            rows = b.op("mul", rows, b.op("reshape", b.tensor(per_sample_weights), shape=(*index.shape, 1)))
        return (b.op("sum" if mode == 0 else "mean", rows, axis=1, keepdim=False), None, None, None)
    starts = b.tensor(offsets)
    if include_last_offset:
        starts = b.op("slice", starts, axis=0, start=0, stop=starts.shape[0] - 1, step=1)
    count, dim = index.shape[0], table.shape[1]
    bags = starts.shape[0]
    positions = b.constant(torch.arange(count, dtype=getattr(torch, starts.dtype)).reshape(count, 1))
    started = b.op("ge", positions, b.op("reshape", starts, shape=(1, bags)))  # [T, B]: bag b began at or before t
    bag = b.op("sub_scalar", b.op("sum", started, axis=1, keepdim=False), value=1.0)  # [T]
    if per_sample_weights is not None:
        rows = b.op("mul", rows, b.op("reshape", b.tensor(per_sample_weights), shape=(count, 1)))
    column = b.op("expand", b.op("reshape", bag, shape=(count, 1)), shape=(count, dim))
    zeros = b.constant(torch.zeros(bags, dim, dtype=getattr(torch, table.dtype)))
    total = b.op("scatter_add", zeros, column, rows, axis=0)
    if mode == 1:
        ones = b.constant(torch.ones(count, 1, dtype=getattr(torch, table.dtype)))
        sizes = b.op("scatter_add", b.constant(torch.zeros(bags, 1, dtype=getattr(torch, table.dtype))),
                     b.op("reshape", bag, shape=(count, 1)), ones, axis=0)
        total = b.op("div", total, b.op("maximum_scalar", sizes, value=1.0))
    return (total, None, None, None)


@converts("aten.histc.default")
def _histc(b: Builder, *args: Any) -> Value:
    raise Unsupported("histc's bins depend on the values' min and max over the whole tensor; it runs whole")


# -- recurrent layers: a loop of cells ----------------------------------------------------------------------------
def _unit_major(b: Builder, w: Value, gates: int) -> Value:
    """torch's gate-major weight [gates·H, in] as [in, H·gates]: column h·gates + gate, so a block of hidden units
    holds all the gates of each unit (splitting H then splits every gate alike). Weights are static: free."""
    hidden = w.shape[0] // gates
    split = b.op("reshape", w, shape=(gates, hidden, w.shape[1]))
    return b.op("reshape", b.op("transpose", split, perm=(2, 1, 0)), shape=(w.shape[1], hidden * gates))


def _unit_major_bias(b: Builder, bias: Value, gates: int) -> Value:
    hidden = bias.shape[0] // gates
    split = b.op("transpose", b.op("reshape", bias, shape=(gates, hidden)), perm=(1, 0))
    return b.op("reshape", split, shape=(hidden * gates,))


def _project(b: Builder, x: Value, w: Value, bias: Value | None, gates: int) -> Value:
    """x[..., in] · w (gate-major) + bias, as [..., H, gates]."""
    weight = _unit_major(b, w, gates)
    out = b.op("matmul", x, weight) if bias is None else b.op("linear", x, weight, _unit_major_bias(b, bias, gates))
    return b.op("reshape", out, shape=(*x.shape[:-1], w.shape[0] // gates, gates))


def _gate(b: Builder, gates: Value, index: int) -> Value:
    return b.op("select", gates, axis=gates.ndim - 1, index=index)


def _lstm_step(b: Builder, inputs: Value, h: Value, state: list[Value], w_hh: Value, b_hh: Value | None
               ) -> tuple[Value, list[Value]]:
    gates = b.op("add", inputs, _project(b, h, w_hh, b_hh, 4))  # [B, H, 4]: i, f, g, o
    i, f, g, o = (_gate(b, gates, k) for k in range(4))
    c = b.op("add", b.op("mul", b.op("sigmoid", f), state[0]), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)))
    return b.op("mul", b.op("sigmoid", o), b.op("tanh", c)), [c]


def _gru_step(b: Builder, inputs: Value, h: Value, state: list[Value], w_hh: Value, b_hh: Value | None
              ) -> tuple[Value, list[Value]]:
    hidden = _project(b, h, w_hh, b_hh, 3)  # [B, H, 3]: r, z, n
    r = b.op("sigmoid", b.op("add", _gate(b, inputs, 0), _gate(b, hidden, 0)))
    z = b.op("sigmoid", b.op("add", _gate(b, inputs, 1), _gate(b, hidden, 1)))
    n = b.op("tanh", b.op("add", _gate(b, inputs, 2), b.op("mul", r, _gate(b, hidden, 2))))
    return b.op("add", n, b.op("mul", z, b.op("sub", h, n))), []  # (1 - z)·n + z·h


def _stacked(b: Builder, values: list[Value]) -> Value:
    """[*shape] values as [len, *shape] (a concat chain, as `stack`)."""
    lifted = [b.op("reshape", v, shape=(1, *v.shape)) for v in values]
    out = lifted[0]
    for v in lifted[1:]:
        out = b.op("concat", out, v, axis=0)
    return out


def _recurrent(b: Builder, kind: str, x: Any, hx: list[Any], params: list[Any], has_biases: bool, num_layers: int,
               dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Value, ...]:
    """An LSTM or GRU unrolled over time: per layer and direction, one input projection of the whole sequence,
    then per step a cell (its hidden projection, gates, state update). Batch and hidden units shard; the hidden
    projection reads the whole previous h, so sharding hidden units gathers h every step."""
    gates, step = {"lstm": (4, _lstm_step), "gru": (3, _gru_step)}[kind]
    value = b.tensor(x)
    if train and dropout:
        raise Unsupported("dropout between layers in training")
    if value.ndim != 3:
        raise Unsupported(f"a {value.ndim}-D input (batched [T, B, in] or [B, T, in] is taken)")
    per, directions = (4 if has_biases else 2), (2 if bidirectional else 1)
    if len(params) != num_layers * directions * per:
        raise Unsupported(f"{len(params)} weights for {num_layers} layer(s) (projections are not taken)")
    sequence = b.op("transpose", value, perm=(1, 0, 2)) if batch_first else value  # [T, B, in]
    states = [b.tensor(h) for h in hx]  # each [layers·directions, B, H]
    finals: list[list[Value]] = [[] for _ in states]
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            slot = layer * directions + direction
            w_ih, w_hh, *biases = (b.tensor(p) for p in params[slot * per : (slot + 1) * per])
            b_ih, b_hh = biases or (None, None)
            inputs = _project(b, sequence, w_ih, b_ih, gates)  # [T, B, H, gates]
            h, *state = (b.op("select", s, axis=0, index=slot) for s in states)
            steps = range(sequence.shape[0])
            seen: dict[int, Value] = {}
            for t in reversed(steps) if direction else steps:
                h, state = step(b, b.op("select", inputs, axis=0, index=t), h, state, w_hh, b_hh)
                seen[t] = h
            outputs.append(_stacked(b, [seen[t] for t in steps]))
            for final, last in zip(finals, [h, *state]):
                final.append(last)
        sequence = outputs[0] if directions == 1 else b.op("concat", outputs[0], outputs[1], axis=2)
    output = b.op("transpose", sequence, perm=(1, 0, 2)) if batch_first else sequence
    return (output, *(_stacked(b, final) for final in finals))


@converts("aten.lstm.input")
def _lstm(b: Builder, x: Any, hx: list[Any], params: list[Any], *flags: Any) -> tuple[Value, ...]:
    return _recurrent(b, "lstm", x, list(hx), list(params), *flags)


@converts("aten.gru.input")
def _gru(b: Builder, x: Any, hx: Any, params: list[Any], *flags: Any) -> tuple[Value, ...]:
    return _recurrent(b, "gru", x, [hx], list(params), *flags)


# -- MoE expert dispatch ------------------------------------------------------------------------------------------
@converts("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
def _grouped_mm(b: Builder, x: Any, w: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Value:
    """Rows sorted by expert, `offs` each expert's end row: `grouped_mm`, whose expert dim shards (expert
    parallelism)."""
    value, weight = b.tensor(x), b.tensor(w)
    if offs is None or bias is not None or out_dtype is not None or value.ndim != 2 or weight.ndim != 3:
        raise Unsupported("a grouped mm other than x[R, D] by w[E, D, F] with offsets (no bias, no out_dtype)")
    return b.op("grouped_mm", value, weight, b.tensor(offs))
