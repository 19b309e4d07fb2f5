"""Elementwise kernels: unary maps, numpy-broadcasting binary ops with torch's type promotion, each binary
op's scalar twin (x OP value), where and masked_fill.

Each family is one table and one factory, so a new op is one row. The torch impls cast their operands to
the dtype the kernel's dtype rule computes in before calling torch: the runtime does not cast results, so
the impl must give exactly the dtype the graph promised (torch would let a 0-dim operand give way in
promotion; a graph dtype rule sees dtypes, not shapes).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.special
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import DtypeRule, Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, promoted
from tapestry.kernels.registry import register

def _shape(draw, min_dims: int = 1, max_dims: int = 3) -> Shape:
    return tuple(draw(st.lists(st.integers(1, 7), min_size=min_dims, max_size=max_dims)))


def _quiet(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """`fn` without numpy's warnings for results outside the real domain: NaN and inf are the answer, as in torch."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return quiet


def float_result(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """The dtype of a map into the reals (sqrt, exp…): x's if float, else float32, as torch gives."""
    return in_dtypes[0] if dtypes.is_float(in_dtypes[0]) else "float32"


def to_bool(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """Comparisons and logical ops give bool whatever their operands."""
    return "bool"


def no_bool(name: str, rule: DtypeRule | None) -> DtypeRule:
    """`rule` (None: promotion), refusing operands that would compute in bool: numpy and torch have no bool
    negation, subtraction, power, relu or abs, so the graph must not promise one."""

    def refuse(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        computed = (rule or promoted)(in_dtypes, params)
        if computed == "bool":
            raise KernelError(f"{name}: bool operands are not supported (numpy and torch refuse bool {name}); "
                              "cast them first, e.g. cast(x, 'int64'), or use the logical_* ops")
        return computed

    return refuse


def _check_bool(kernel: str, slot: str, dtype: str) -> None:
    if dtype != "bool":
        raise KernelError(f"{kernel}: {slot} must be bool, got {dtype}")


# -- unary ------------------------------------------------------------------------------------


def unary_signature(flops: int) -> Callable[..., SignatureSpec]:
    def signature(x: Shape, **params: ParamValue) -> SignatureSpec:
        n = len(x)
        ident = follow(n, range(n))
        return SignatureSpec(tuple(f"d{i}" for i in range(n)), x, (ident,), ident, flops)

    return signature


def _floating(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch `fn` with integer and bool x computed as float32, like torch's sqrt (torch has no integer gelu)."""
    return lambda x, **params: fn(x if x.is_floating_point() else x.float(), **params)


def _gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))


def _gelu_signature(x: Shape, approximate: str) -> SignatureSpec:
    if approximate not in ("none", "tanh"):
        raise KernelError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return unary_signature(8)(x)


@dataclass(frozen=True)
class Unary:
    """One elementwise map of x."""

    name: str
    numpy: Callable[..., np.ndarray]
    torch: Callable[..., Any]
    flops: int
    result: DtypeRule | None  # None: x's dtype
    samples: tuple[str, ...]  # sampled x dtypes
    doc: str
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    signature: Callable[..., SignatureSpec] | None = None  # None: the identity on x's shape
    takes_bool: bool = True  # False: torch has no bool version, so bool x is refused when the graph is built


REAL = ("float",)  # maps into the reals are only sampled at floats: float32 results from integers round differently

UNARY: tuple[Unary, ...] = (
    Unary("relu", lambda x: np.maximum(x, 0), torch.relu, 1, None, ("float", "int64"), "max(x, 0)", takes_bool=False),
    Unary("neg", np.negative, torch.neg, 1, None, ("float", "int64"), "-x", takes_bool=False),
    Unary("abs", np.abs, torch.abs, 1, None, ("float", "int32"), "|x|", takes_bool=False),
    Unary("exp", np.exp, torch.exp, 4, float_result, REAL, "e^x"),
    Unary("log", np.log, torch.log, 4, float_result, REAL, "natural log (NaN below 0)"),
    Unary("sqrt", np.sqrt, torch.sqrt, 4, float_result, REAL, "√x (NaN below 0)"),
    Unary("rsqrt", lambda x: 1.0 / np.sqrt(x), torch.rsqrt, 5, float_result, REAL, "1/√x"),
    Unary("tanh", np.tanh, torch.tanh, 8, float_result, REAL, "tanh x"),
    Unary("erf", scipy.special.erf, torch.erf, 8, float_result, REAL, "the error function (gelu's backward)"),
    Unary("sin", np.sin, torch.sin, 8, float_result, REAL, "sin x (rotary position embeddings)"),
    Unary("cos", np.cos, torch.cos, 8, float_result, REAL, "cos x (rotary position embeddings)"),
    Unary("sigmoid", scipy.special.expit, torch.sigmoid, 6, float_result, REAL, "1/(1 + e^-x)"),
    Unary("silu", lambda x: x * scipy.special.expit(x), F.silu, 7, float_result, REAL, "x·sigmoid(x)"),
    Unary("logical_not", np.logical_not, torch.logical_not, 1, to_bool, ("bool", "float"), "not x (x ≠ 0 is true)"),
    Unary(
        "gelu", _gelu, lambda x, approximate: F.gelu(x, approximate=approximate), 8, float_result,
        REAL, "x·Φ(x): approximate 'none' is the erf form, 'tanh' the tanh approximation",
        params={"approximate": "none"}, signature=_gelu_signature,
    ),
)


def _unary(op: Unary) -> Kernel:
    def sample(draw):
        return (_shape(draw, 0),), {}, (draw(st.sampled_from(op.samples)),)

    return register(
        Kernel(
            name=op.name,
            inputs=("x",),
            signature=op.signature or unary_signature(op.flops),
            numpy=_quiet(op.numpy),
            torch=_floating(op.torch) if op.result is float_result else op.torch,
            sample=sample,
            params=op.params,
            dtype_rule=op.result if op.takes_bool else no_bool(op.name, op.result),
            doc=op.doc,
        )
    )


for _unary_op in UNARY:
    _unary(_unary_op)


# -- binary, with numpy broadcasting ----------------------------------------------------------


def broadcast_signature(*shapes: Shape, **params: ParamValue) -> SignatureSpec:
    """Index space is the broadcast shape; a size-1 input dim reads the same cell everywhere (params play no
    part)."""
    try:
        out = tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise KernelError(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast") from None
    n = len(out)

    def projection(shape: Shape):
        lead = n - len(shape)
        return follow(n, [None if size == 1 and out[lead + r] != 1 else lead + r for r, size in enumerate(shape)])

    inputs = tuple(projection(s) for s in shapes)
    return SignatureSpec(tuple(f"d{i}" for i in range(n)), out, inputs, follow(n, range(n)))


def _broadcast_shapes(draw, count: int) -> tuple[Shape, ...]:
    """`count` shapes that broadcast: one of them the full shape, or each a random suffix with random 1s."""
    out = _shape(draw, 0)

    def operand() -> Shape:
        keep = draw(st.integers(0, len(out)))
        return tuple(s if draw(st.booleans()) else 1 for s in out[len(out) - keep :])

    if draw(st.booleans()):
        return tuple(operand() for _ in range(count))
    full = draw(st.integers(0, count - 1))
    return tuple(out if i == full else operand() for i in range(count))


def _binary_sample(draw):
    return _broadcast_shapes(draw, 2), {}


def true_division(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """torch's `/`: promoted, and integer operands give float32."""
    d = dtypes.promote(*in_dtypes)
    return d if dtypes.is_float(d) else "float32"


def in_dtype(rule: DtypeRule | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch `fn` on its tensor operands cast to the dtype `rule` computes in (None: as given)."""
    if rule is None:
        return fn

    def impl(*args: Any) -> Any:
        dtype = dtypes.to_torch(rule(tuple(dtypes.name_of(a) for a in args), {}))
        return fn(*(a.to(dtype) for a in args))

    return impl


@dataclass(frozen=True)
class Binary:
    """One binary op: its scalar twin (`<name>_scalar`) is derived from the same row."""

    name: str
    numpy: Callable[..., np.ndarray]
    torch: Callable[..., Any]  # on two tensors of the compute dtype
    flops: int
    compute: DtypeRule | None  # the dtype operands are cast to before the op (None: as given)
    result: DtypeRule
    samples: tuple[tuple[str, str], ...]  # sampled operand dtypes
    doc: str
    twin: bool = True
    takes_bool: bool = True  # False: numpy and torch have no bool version; bool operands are refused


ARITHMETIC = (("float", "float"), ("float", "int64"), ("int32", "int64"))
LOGICAL = (("bool", "bool"), ("bool", "float"))

BINARY: tuple[Binary, ...] = (
    Binary("add", np.add, torch.add, 1, promoted, promoted, ARITHMETIC, "a + b"),
    Binary("sub", np.subtract, torch.sub, 1, promoted, promoted, ARITHMETIC, "a - b", takes_bool=False),
    Binary("mul", np.multiply, torch.mul, 1, promoted, promoted, ARITHMETIC, "a · b"),
    Binary("div", np.true_divide, torch.div, 1, true_division, true_division, ARITHMETIC, "a / b, true division"),
    Binary("floor_divide", np.floor_divide, torch.floor_divide, 1, promoted, promoted, ARITHMETIC[:2],
           "⌊a / b⌋ (Python's //)", takes_bool=False),
    Binary("pow", np.power, torch.pow, 8, promoted, promoted, ARITHMETIC, "a ** b", takes_bool=False),
    Binary("maximum", np.maximum, torch.maximum, 1, promoted, promoted, ARITHMETIC, "max(a, b), NaN if either is"),
    Binary("minimum", np.minimum, torch.minimum, 1, promoted, promoted, ARITHMETIC, "min(a, b), NaN if either is"),
    Binary("eq", np.equal, torch.eq, 1, promoted, to_bool, ARITHMETIC, "a == b"),
    Binary("ne", np.not_equal, torch.ne, 1, promoted, to_bool, ARITHMETIC, "a != b"),
    Binary("lt", np.less, torch.lt, 1, promoted, to_bool, ARITHMETIC, "a < b"),
    Binary("le", np.less_equal, torch.le, 1, promoted, to_bool, ARITHMETIC, "a <= b"),
    Binary("gt", np.greater, torch.gt, 1, promoted, to_bool, ARITHMETIC, "a > b"),
    Binary("ge", np.greater_equal, torch.ge, 1, promoted, to_bool, ARITHMETIC, "a >= b"),
    Binary("logical_and", np.logical_and, torch.logical_and, 1, None, to_bool, LOGICAL, "a and b (≠ 0 is true)",
           twin=False),
    Binary("logical_or", np.logical_or, torch.logical_or, 1, None, to_bool, LOGICAL, "a or b (≠ 0 is true)",
           twin=False),
)


def _refusing_bool(op: Binary) -> DtypeRule:
    """op's result rule, after refusing operands whose compute dtype is bool."""
    compute = no_bool(op.name, op.compute)

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        compute(in_dtypes, params)
        return op.result(in_dtypes, params)

    return rule


def _binary(op: Binary) -> Kernel:
    def sample(draw):
        return _broadcast_shapes(draw, 2), {}, draw(st.sampled_from(op.samples))

    return register(
        Kernel(
            name=op.name,
            inputs=("a", "b"),
            signature=broadcast_signature,
            numpy=_quiet(op.numpy),
            torch=in_dtype(op.compute, op.torch),
            sample=sample,
            dtype_rule=op.result if op.takes_bool else _refusing_bool(op),
            doc=f"{op.doc}, numpy broadcasting, torch promotion",
        )
    )


# -- scalar twins: x OP value, or value OP x ------------------------------------------------------


def scalar_compute(x: str, value: float) -> str:
    """The dtype torch computes `x OP value` in for a Python number: x's if float; an integral value keeps an
    integer x (bool becomes int64); otherwise float32."""
    if dtypes.is_float(x):
        return x
    if float(value).is_integer():
        return "int64" if x == "bool" else x
    return "float32"


def _scalar_twin(op: Binary) -> Kernel:
    name = f"{op.name}_scalar"

    def compute(x: str, value: float) -> str:
        d = scalar_compute(x, value)
        return op.compute((d,), {}) if op.compute else d

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        return op.result((scalar_compute(in_dtypes[0], params["value"]),), params)

    def numpy_impl(x: np.ndarray, value: float, reverse: bool) -> np.ndarray:
        return op.numpy(value, x) if reverse else op.numpy(x, value)

    def torch_impl(x: Any, value: float, reverse: bool) -> Any:
        dtype = dtypes.to_torch(compute(dtypes.name_of(x), value))
        x = x.to(dtype)
        v = torch.full((), value if dtype.is_floating_point else int(value), dtype=dtype, device=x.device)
        return op.torch(v, x) if reverse else op.torch(x, v)

    def sample(draw):
        x = draw(st.sampled_from(op.samples))[0]
        # Integers only meet integral values here: their float32 results would round differently from
        # numpy's float64 ones (tests/test_kernels_more.py covers them).
        # (torch raises on an integer // 0, numpy gives 0)
        ints = {"pow": [0.0, 1.0, 2.0, 3.0], "floor_divide": [1.0, 2.0, -3.0]}.get(op.name, [0.0, 1.0, 2.0, -1.0])
        values = [0.0, 1.0, -2.0, 0.5, 1.5, 3.0] if x == "float" else ints
        params = {"value": draw(st.sampled_from(values)), "reverse": draw(st.booleans())}
        return (_shape(draw, 0),), params, (x,)

    return register(
        Kernel(
            name=name,
            inputs=("x",),
            signature=unary_signature(op.flops),
            numpy=_quiet(numpy_impl),
            torch=torch_impl,
            sample=sample,
            params={"value": 0.0, "reverse": False},
            dtype_rule=rule,
            doc=f"{op.doc} with a number for one operand (reverse: value OP x)",
        )
    )


for _binary_op in BINARY:
    _binary(_binary_op)
    if _binary_op.twin:
        _scalar_twin(_binary_op)


# -- selection and casts -------------------------------------------------------------------------------


def _where_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    _check_bool("where", "cond", in_dtypes[0])
    return dtypes.promote(*in_dtypes[1:])


def _where_torch(cond: Any, a: Any, b: Any) -> Any:
    dtype = dtypes.to_torch(dtypes.promote(dtypes.name_of(a), dtypes.name_of(b)))
    return torch.where(cond, a.to(dtype), b.to(dtype))


def _where_sample(draw):
    return _broadcast_shapes(draw, 3), {}, ("bool", *draw(st.sampled_from(ARITHMETIC)))


register(
    Kernel(
        name="where",
        inputs=("cond", "a", "b"),
        signature=broadcast_signature,
        numpy=np.where,
        torch=_where_torch,
        sample=_where_sample,
        dtype_rule=_where_rule,
        doc="a where cond else b; cond bool, a and b promoted",
    )
)


def _masked_fill_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    _check_bool("masked_fill", "mask", in_dtypes[1])
    return in_dtypes[0]


register(
    Kernel(
        name="masked_fill",
        inputs=("x", "mask"),
        signature=broadcast_signature,
        numpy=lambda x, mask, value: np.where(mask, value, x),
        torch=lambda x, mask, value: x.masked_fill(mask, value),
        sample=lambda draw: (_broadcast_shapes(draw, 2), {"value": draw(st.sampled_from([0.0, -1e9, float("-inf")]))},
                             ("float", "bool")),
        params={"value": 0.0},
        dtype_rule=_masked_fill_rule,
        doc="value where mask else x (x's dtype; mask bool)",
    )
)


def _cast_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    target = str(params["dtype"])
    if target not in dtypes.DTYPES:
        raise KernelError(f"cast: dtype {target!r} is not one of {', '.join(dtypes.DTYPES)}")
    return target


def _cast_sample(draw):
    # No bfloat16 here: the generic torch-vs-numpy test reads results with .numpy(); test_kernels_more covers it.
    names = ["float", "bool", "int32", "int64", "float16", "float32"]
    return (_shape(draw, 0),), {"dtype": draw(st.sampled_from(names[1:]))}, (draw(st.sampled_from(names)),)


register(
    Kernel(
        name="cast",
        inputs=("x",),
        signature=unary_signature(1),
        numpy=lambda x, dtype: dtypes.cast(x, dtype),
        torch=lambda x, dtype: x.to(dtypes.to_torch(dtype)),
        sample=_cast_sample,
        params={"dtype": "float32"},
        dtype_rule=_cast_rule,
        doc="x as `dtype` (floats to integers truncate toward zero, nonzero to bool is true)",
    )
)
