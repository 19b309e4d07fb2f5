"""Elementwise ops: unary and binary kernels (a number operand becomes the `_scalar` twin), clamps,
selects, casts."""
from __future__ import annotations

from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.aten.common import _axis, _scalar
from tapestry.importer.translate import Builder, Unsupported, converts


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


@converts("aten.square.default")
def _square(b: Builder, x: Any) -> Value:
    value = b.tensor(x)
    return b.op("mul", value, value)


@converts("aten.softplus.default")
def _softplus(b: Builder, x: Any, beta: Any = 1, threshold: Any = 20) -> Value:
    """log(1 + exp(βx)) / β, and x itself where βx is above the threshold (torch's switch to the line)."""
    value = b.tensor(x)
    scaled = b.op("mul_scalar", value, value=beta) if beta != 1 else value
    soft = b.op("log", b.op("add_scalar", b.op("exp", scaled), value=1.0))
    soft = b.op("div_scalar", soft, value=beta) if beta != 1 else soft
    return b.op("where", b.op("gt_scalar", scaled, value=threshold), value, soft)


@converts("aten.hardswish.default")
def _hardswish(b: Builder, x: Any) -> Value:
    """x · min(max(x + 3, 0), 6) / 6, in torch's order."""
    value = b.tensor(x)
    gate = b.op("minimum_scalar", b.op("maximum_scalar", b.op("add_scalar", value, value=3.0), value=0.0), value=6.0)
    return b.op("div_scalar", b.op("mul", value, gate), value=6.0)


@converts("aten.glu.default")
def _glu(b: Builder, x: Any, dim: int = -1) -> Value:
    """The first half of `dim` gated by the sigmoid of the second."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    half = value.shape[axis] // 2
    first, second = (b.op("slice", value, axis=axis, start=start, stop=start + half, step=1) for start in (0, half))
    return b.op("mul", first, b.op("sigmoid", second))


BINARY = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow", "maximum": "maximum",
    "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "logical_and": "logical_and", "logical_or": "logical_or", "__and__": "logical_and", "__or__": "logical_or",
    "bitwise_and": "logical_and", "bitwise_or": "logical_or", "floor_divide": "floor_divide",
    "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub",  # ConvBERT's x.multiply(y)
}


def binary(b: Builder, kernel: str, lhs: Any, rhs: Any) -> Value:
    """A binary kernel, or its `_scalar` twin when one operand is a number (reverse when it is the left one)."""
    left, right = _scalar(lhs), _scalar(rhs)
    if kernel.startswith("logical") and b.dtype != "bool":
        raise Unsupported("a bitwise op on integers")
    if kernel.startswith("logical") and (left is None) != (right is None):  # no `_scalar` twin: the number decides
        value, number = (b.tensor(lhs), right) if right is not None else (b.tensor(rhs), left)
        if bool(number) != (kernel == "logical_and"):  # x and False, x or True: one value everywhere
            return b.filled(kernel == "logical_or", value.shape, "bool")
        return value if value.dtype == "bool" else b.op("ne_scalar", value, value=0.0)  # x and True, x or False
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


@converts("aten.max.other", "aten.min.other")
def _extremum(b: Builder, x: Any, other: Any) -> Value:
    """torch.max(x, y) elementwise (XGLM clamps its attention scores this way)."""
    return binary(b, "maximum" if str(b.node.target) == "aten.max.other" else "minimum", x, other)


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


@converts("aten.reciprocal.default")
def _reciprocal(b: Builder, x: Any) -> Value:
    return b.op("div_scalar", b.tensor(x), value=1.0, reverse=True)
