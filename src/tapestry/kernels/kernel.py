"""What a kernel is: a polyhedral signature plus implementations and a cost formula.

A kernel never sees whole tensors. Given an index block, each input's
IndexProjection selects the block of that input the kernel reads, and the
kernel computes the output block. Unsharded evaluation is the one-block case,
so sharded and unsharded runs go through the same code.
"""
from __future__ import annotations

import enum
import math
from fractions import Fraction
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import sympy

from tapestry import dtypes
from tapestry.kernels.ring import Ring
from tapestry.zspace import IndexProjection, ZAffineMap, ZRange

Shape = tuple[int, ...]
ParamValue = bool | int | float | str | tuple[int, ...]
Params = tuple[tuple[str, ParamValue], ...]
DtypeRule = Callable[[tuple[str, ...], Mapping[str, ParamValue]], str]


class DimKind(enum.Enum):
    """How splitting one index dim affects the kernel's outputs and inputs."""

    PARALLEL = "parallel"  # output blocks tile the output
    REDUCTION = "reduction"  # output blocks overlap: partial results must be summed
    WINDOWED = "windowed"  # output tiles, but some input blocks overlap (halos)


def follow(
    index_ndim: int,
    rows: Sequence[int | None],
    shape: Sequence[int] | None = None,
    scale: Sequence[int] | None = None,
    offset: Sequence[int] | None = None,
) -> IndexProjection:
    """A projection where tensor dim r follows index dim rows[r] (None: a constant block).

    Almost every kernel's projections have this form, so signatures are written
    as one line per tensor instead of as matrices.
    """
    scale = scale or [1] * len(rows)
    matrix = [[scale[r] if c == col else 0 for c in range(index_ndim)] for r, col in enumerate(rows)]
    affine = ZAffineMap(matrix, offset, in_dim=index_ndim)
    return IndexProjection(affine, tuple(shape) if shape is not None else None)


@dataclass(frozen=True)
class SignatureSpec:
    """What a kernel's signature function returns for concrete input shapes."""

    dims: tuple[str, ...]
    sizes: Shape
    inputs: tuple[IndexProjection, ...]
    output: IndexProjection
    flops_per_point: int | Fraction = 1  # a Fraction where index points outnumber the work (grouped_mm's experts)


class KernelError(ValueError):
    """An op's inputs or params do not fit its kernel."""


def matching(kernel_inputs: tuple[str, ...]) -> DtypeRule:
    """The result dtype of a kernel whose floating inputs must agree (torch raises on mixed matmul operands)."""

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        floats = {d for d in in_dtypes if dtypes.is_float(d)}
        if len(floats) > 1:
            listed = ", ".join(f"{n}: {d}" for n, d in zip(kernel_inputs, in_dtypes))
            raise KernelError(f"operands have different float dtypes ({listed}); cast them to one dtype first")
        return floats.pop() if floats else dtypes.promote(*in_dtypes) if in_dtypes else "float32"

    return rule


def promoted(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """torch's type promotion over the tensor operands: the rule of elementwise ops."""
    return dtypes.promote(*in_dtypes)


def numeric(name: str, kernel_inputs: tuple[str, ...], floats_only: bool = False) -> DtypeRule:
    """`matching`, refusing the operands torch has no kernel for: bool (no bool matmul or relu; and a bool sum is
    an or, so matmul would not distribute over a bool add) and, with `floats_only`, integers (no integer gelu,
    softmax or norms). The graph must not promise a result the runtime cannot compute."""
    agree = matching(kernel_inputs)

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        refused = [f"{n}: {d}" for n, d in zip(kernel_inputs, in_dtypes)
                   if d == "bool" or (floats_only and not dtypes.is_float(d))]
        if refused:
            kind = "non-float" if floats_only else "bool"
            raise KernelError(f"{name} does not take {kind} operands ({', '.join(refused)}); cast them first")
        return agree(in_dtypes, params)

    return rule


@dataclass(frozen=True)
class Exchange:
    """A kernel whose every row meets one block of a data-named dim (grouped_mm, grouped_mm_k: one expert, by
    its sorted rows and `ends`; take_rows: one table row, by its index): rows and that dim (`experts`) may split
    together over one mesh axis, each row sent to the device holding its block and its result sent back inside
    the step, by all-to-all (sharding.partition, plan.exchange). One of the two is an additive reduction: the
    experts where the output follows the rows (grouped_mm, take_rows), else the rows, whose sums then stay on
    the experts' device (grouped_mm_k).

    `select(sig, held, src, dst)`: which rows of index block `src` meet `dst`'s experts, as positions from the
    start of src's rows, ascending; `held` is src's blocks of the inputs (numpy or torch). A kernel computes a
    route's rows as one block starting at the first of them, so one whose rows need not be contiguous must not
    depend on where its rows start. `leaving(p)`: the share of a device's rows that go to other devices under
    even routing, over p devices: what the cost model prices. `counted`: select reads only inputs every member
    holds whole (grouped_mm's ends), so a receiver counts its rows itself; else the counts are exchanged first."""

    rows: str
    experts: str
    select: Callable[[Any, Sequence[Any], ZRange, ZRange], list[int]]
    leaving: Callable[[int], float]
    counted: bool = False


@dataclass(frozen=True)
class Kernel:
    """One registry entry. See docs/kernels.md for how to add one."""

    name: str
    inputs: tuple[str, ...]
    signature: Callable[..., SignatureSpec]
    numpy: Callable[..., np.ndarray]
    torch: Callable[..., Any]
    sample: Callable[[Callable[[Any], Any]], tuple[tuple[Shape, ...], dict[str, ParamValue]]]
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    additive: frozenset[str] = frozenset()
    exchange: Exchange | None = None  # MoE: rows and experts may split together (expert parallel)
    ring: Ring | None = None  # attention: queries and keys may split together, merged by log-sum-exp (kernels.ring)
    # Index dims that split only in a ring, never alone: the fused attention backward's rows (a row block's dk and
    # dv need every query). Not in `Signature.splittable`; a plan splitting one outside a ring is refused.
    ring_only: frozenset[str] = frozenset()
    # (signature, index block) -> the share of the block's FLOPs that are done (a causal attention skips the
    # query-key pairs it masks, as flash kernels skip masked tiles); None: all of them.
    work: Callable[[Signature, ZRange], float] | None = None
    is_view: bool = False
    # torch always answers with a view of x, never a copy (reshape copies where strides do not allow a view): a
    # lowered step's result then shares its argument's storage (lower.program.viewed, cost.memory)
    always_view: bool = False
    # False: its numpy or torch impl cannot run on a tensor with a zero-size dim (or gives another shape), so
    # bind refuses one rather than let a run fail inside a rank.
    takes_zero_size: bool = True
    needs_out_shape: bool = False  # the impls take out_shape=: a block alone does not determine it
    needs_block_start: bool = False  # the impls take block_start= (the index block's start): causal masks need it
    # The impls take read_pad=: per input, per dim, the (before, after) cells of the block's read that lie
    # outside the tensor (zeros). Pools need it: their padding is not a zero (max) or not counted (mean).
    needs_read_pad: bool = False
    dtype_rule: DtypeRule | None = None  # None: floating inputs must agree (`matching`)
    # Inputs held wide for accuracy (a flash backward's float32 log-sum-exp beside bfloat16 q, k, v) that do not
    # set the dtype the arithmetic runs in, and so the peak it is priced at (cost.roofline.compute_dtype).
    accumulators: frozenset[str] = frozenset()
    # For integer inputs that index a table (an embedding's ids, a gather's index): (input shapes, slot, params)
    # -> one past the largest valid value, or None. Random inputs are drawn below it.
    index_bound: Callable[[tuple[Shape, ...], int, Mapping[str, ParamValue]], int | None] | None = None
    # (input shapes, params) -> the one form of params that mean the same (transpose's perm=(1, 0) on a matrix is
    # its default): graph nodes, and so the e-graph's terms, hold that form, so rules written for it match.
    canonical: Callable[[tuple[Shape, ...], Params], Params] | None = None
    doc: str = ""

    def bind(
        self,
        shapes: Sequence[Shape],
        params: Mapping[str, ParamValue] | None = None,
        in_dtypes: Sequence[str] | None = None,
    ) -> Signature:
        """Instantiate the signature for concrete shapes and dtypes (float32 when not given), checking arity,
        params and dtypes."""
        if len(shapes) != len(self.inputs):
            raise KernelError(
                f"{self.name}: expected {len(self.inputs)} inputs ({', '.join(self.inputs)}), got {len(shapes)}"
            )
        full = normalize_params(self, params or {})
        if self.canonical is not None:
            full = self.canonical(tuple(tuple(s) for s in shapes), full)
        if not self.takes_zero_size:
            for slot, shape in zip(self.inputs, shapes):
                if 0 in shape:
                    raise KernelError(f"{self.name}: input {slot!r} has a zero-size dim ({slot}{list(shape)}); "
                                      f"{self.name} does not take zero-size tensors")
        in_dtypes = tuple(in_dtypes) if in_dtypes is not None else ("float32",) * len(shapes)
        for slot, d in zip(self.inputs, in_dtypes):
            dtypes.check(d, f"{self.name} input {slot!r}")
        rule = self.dtype_rule or matching(self.inputs)
        out_dtype = rule(in_dtypes, dict(full))
        spec = self.signature(*[tuple(s) for s in shapes], **dict(full))
        if any(s < 0 for s in spec.sizes):
            raise KernelError(f"{self.name}: negative index-space size {list(spec.sizes)}")
        return Signature(self, tuple(tuple(s) for s in shapes), full, spec, in_dtypes, out_dtype)


def _param_value(kernel: Kernel, name: str, value: Any) -> ParamValue:
    """`value` checked against the type of the param's default: never truncated or coerced silently."""
    default = kernel.params[name]
    expected = type(default).__name__
    if isinstance(value, np.generic):
        value = value.item()
    ok: bool
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        expected = "list of ints"
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
    if not ok:
        raise KernelError(f"{kernel.name}: param {name!r} must be {expected}, got {value!r}")
    return value


def normalize_params(kernel: Kernel, params: Mapping[str, Any]) -> Params:
    unknown = set(params) - set(kernel.params)
    if unknown:
        raise KernelError(
            f"{kernel.name}: unknown param(s) {sorted(unknown)}; expected some of {sorted(kernel.params) or 'none'}"
        )
    merged = {**kernel.params, **params}
    return tuple((k, _param_value(kernel, k, v)) for k, v in sorted(merged.items()))


@dataclass(frozen=True)
class Signature:
    """A kernel bound to concrete input shapes and params: everything sharding needs."""

    kernel: Kernel
    input_shapes: tuple[Shape, ...]
    params: Params
    spec: SignatureSpec
    input_dtypes: tuple[str, ...] = ()
    dtype: str = "float32"  # the output's

    @cached_property
    def index(self) -> ZRange:
        return ZRange.from_shape(self.spec.sizes)

    @property
    def dims(self) -> tuple[str, ...]:
        return self.spec.dims

    @property
    def projections(self) -> tuple[IndexProjection, ...]:
        return self.spec.inputs

    @property
    def output(self) -> IndexProjection:
        return self.spec.output

    @cached_property
    def output_shape(self) -> Shape:
        return self.output.extent(self.index)

    @cached_property
    def dim_kinds(self) -> tuple[DimKind, ...]:
        from tapestry.kernels.classify import classify_dims

        return classify_dims(self)

    def dims_of(self, kind: DimKind) -> tuple[int, ...]:
        return tuple(d for d, k in enumerate(self.dim_kinds) if k is kind)

    @property
    def splittable(self) -> tuple[int, ...]:
        """Dims a partition may split: all but reductions the kernel is not additive in, and those that split only
        in a ring (`Kernel.ring_only`)."""
        return tuple(
            d
            for d, k in enumerate(self.dim_kinds)
            if (k is not DimKind.REDUCTION or self.dims[d] in self.kernel.additive)
            and self.dims[d] not in self.kernel.ring_only
        )

    def index_bound(self, slot: int) -> int | None:
        """For an integer input that indexes a table: one past its largest valid value (else None)."""
        if self.kernel.index_bound is None:
            return None
        return self.kernel.index_bound(self.input_shapes, slot, dict(self.params))

    def call_kwargs(self, index_block: ZRange) -> dict[str, Any]:
        """Keyword arguments for the numpy or torch impl computing `index_block`."""
        kwargs: dict[str, Any] = dict(self.params)
        if self.kernel.needs_out_shape:
            kwargs["out_shape"] = self.output.apply(index_block).shape
        if self.kernel.needs_block_start:
            kwargs["block_start"] = index_block.start
        if self.kernel.needs_read_pad:
            kwargs["read_pad"] = tuple(
                _outside(p.apply(index_block), shape) for p, shape in zip(self.projections, self.input_shapes)
            )
        return kwargs

    def compute(self, blocks: Sequence[np.ndarray], index_block: ZRange) -> np.ndarray:
        """The numpy impl on `blocks`: half-precision floats computed in float32, the result in `dtype`."""
        args = [
            b.astype(dtypes.compute_dtype(d), copy=False) if dtypes.is_float(d) else b
            for b, d in zip(blocks, self.input_dtypes)
        ]
        return dtypes.cast(self.kernel.numpy(*args, **self.call_kwargs(index_block)), self.dtype)

    # -- cost formulas -------------------------------------------------------------------------
    @cached_property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        return tuple(sympy.Symbol(name, positive=True, integer=True) for name in self.dims)

    @cached_property
    def flops_expr(self) -> sympy.Expr:
        """FLOPs of one index block, over the block's extent per index dim."""
        return sympy.Rational(self.spec.flops_per_point) * sympy.Mul(*self.symbols)

    def footprint_expr(self, projection: IndexProjection) -> sympy.Expr:
        """Elements of the box an index block selects: per tensor dim, Σ|A|·(extent−1) + shape."""
        extents = [
            sum((abs(a) * (s - 1) for a, s in zip(row, self.symbols)), sympy.Integer(0)) + size
            for row, size in zip(projection.matrix, projection.shape)
        ]
        return sympy.Mul(*extents)

    @cached_property
    def bytes_expr(self) -> sympy.Expr:
        """Bytes read and written by one index block, each tensor at its dtype's size."""
        if self.kernel.is_view:
            return sympy.Integer(0)
        sizes = [dtypes.itemsize(d) for d in (*self.input_dtypes, self.dtype)]
        pairs = zip((*self.projections, self.output), sizes)
        return sum((size * self.footprint_expr(p) for p, size in pairs), sympy.Integer(0))

    @cached_property
    def _cost_fn(self) -> Callable[..., tuple[float, float]]:
        return sympy.lambdify(self.symbols, (self.flops_expr, self.bytes_expr), modules="math")

    def cost(self, block: ZRange) -> tuple[float, float]:
        """(flops, bytes) of computing one index block."""
        if block.is_empty:
            return (0.0, 0.0)
        flops, nbytes = self._cost_fn(*block.shape)
        done = 1.0 if self.kernel.work is None else self.kernel.work(self, block)
        return float(flops) * done, float(nbytes)

    def __str__(self) -> str:
        args = ", ".join(f"{n}{list(s)}" for n, s in zip(self.kernel.inputs, self.input_shapes))
        params = "".join(f", {k}={v}" for k, v in self.params)
        return f"{self.kernel.name}({args}{params}) -> {self.dtype}{list(self.output_shape)}"


def _outside(box: ZRange, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per dim, how many of `box`'s leading and trailing cells lie outside [0, shape)."""
    return tuple((min(e - s, max(0, -s)), min(e - s, max(0, e - n))) for s, e, n in zip(box.start, box.end, shape))


def prod(values: Sequence[int]) -> int:
    return math.prod(values)
