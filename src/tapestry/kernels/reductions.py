"""Kernels that read a whole axis: sum (additive, so its axis is an index dim); mean, amax, softmax,
log_softmax, layer_norm and rms_norm (not additive, so their axis is inside the block)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, numeric
from tapestry.kernels.registry import register


def _axis(shape: Shape, axis: int) -> int:
    if not -len(shape) <= axis < len(shape):
        raise KernelError(f"axis {axis} is out of range for shape {list(shape)}")
    return axis % len(shape)


def _sample_axis(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    return (shape,), {"axis": draw(st.integers(-len(shape), len(shape) - 1))}


def _sample_keepdim(in_dtypes: tuple[str, ...]):
    """One axis and keepdim over shapes of 2+ dims (so some index dim is left to split), x's dtype from `in_dtypes`."""

    def sample(draw):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=2, max_size=3)))
        params = {"axis": draw(st.integers(-len(shape), len(shape) - 1)), "keepdim": draw(st.booleans())}
        return (shape,), params, (draw(st.sampled_from(in_dtypes)),)

    return sample


def sum_signature(x: Shape, axis: int, keepdim: bool) -> SignatureSpec:
    ax = _axis(x, axis)
    n = len(x)
    out = [None if d == ax else d for d in range(n)] if keepdim else [d for d in range(n) if d != ax]
    return SignatureSpec(
        dims=tuple("reduce" if d == ax else f"d{d}" for d in range(n)),
        sizes=x,
        inputs=(follow(n, range(n)),),
        output=follow(n, out),
    )


def _sum_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """torch sums integers and bools as int64."""
    return in_dtypes[0] if dtypes.is_float(in_dtypes[0]) else "int64"


register(
    Kernel(
        name="sum",
        inputs=("x",),
        signature=sum_signature,
        numpy=lambda x, axis, keepdim: x.sum(axis=axis, keepdims=keepdim),
        torch=lambda x, axis, keepdim: x.sum(dim=axis, keepdim=keepdim),
        sample=_sample_keepdim(("float", "int32", "bool")),
        params={"axis": -1, "keepdim": False},
        additive=frozenset({"reduce"}),
        dtype_rule=_sum_rule,
        doc="sum over one axis (dropped unless keepdim)",
    )
)


def whole_axis_signature(
    x: Shape, axis: int, extra: tuple[Shape, ...] = (), flops: int = 5, out: str = "whole"
) -> SignatureSpec:
    """Index dims are x's dims but `axis`; every block reads that axis whole, and writes it whole (`out`
    "whole"), as one cell ("keep": a keepdim reduction) or not at all ("drop")."""
    ax = _axis(x, axis)
    kept = [d for d in range(len(x)) if d != ax]
    n = len(kept)
    rows = [kept.index(d) if d != ax else None for d in range(len(x))]
    block = follow(n, rows, shape=[x[ax] if d == ax else 1 for d in range(len(x))])
    output = {"whole": block, "keep": follow(n, rows), "drop": follow(n, range(n))}[out]
    params = tuple(follow(n, [None] * len(s), shape=s) for s in extra)
    return SignatureSpec(
        tuple(f"d{d}" for d in kept), tuple(x[d] for d in kept), (block, *params), output, flops * x[ax]
    )


def _mean_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if not dtypes.is_float(in_dtypes[0]):
        raise KernelError(f"mean needs a float x, got {in_dtypes[0]} (torch has no integer mean); cast it first")
    return in_dtypes[0]


def _reduce_whole(name: str, np_fn, torch_fn, rule, sample_dtypes: tuple[str, ...], doc: str) -> Kernel:
    """A one-axis reduction whose axis is read whole inside each block (not additive, so never split)."""
    return register(
        Kernel(
            name=name,
            inputs=("x",),
            signature=lambda x, axis, keepdim: whole_axis_signature(
                x, axis, flops=1, out="keep" if keepdim else "drop"
            ),
            numpy=lambda x, axis, keepdim: np_fn(x, axis=axis, keepdims=keepdim),
            torch=lambda x, axis, keepdim: torch_fn(x, dim=axis, keepdim=keepdim),
            sample=_sample_keepdim(sample_dtypes),
            params={"axis": -1, "keepdim": False},
            dtype_rule=rule,
            takes_zero_size=False,
            doc=doc,
        )
    )


_reduce_whole("mean", np.mean, torch.mean, _mean_rule, ("float",), "mean over one axis (dropped unless keepdim)")
_reduce_whole("amax", np.max, torch.amax, None, ("float", "int64"), "max over one axis (dropped unless keepdim)")


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _whole_axis_map(name: str, np_fn, torch_fn, doc: str) -> Kernel:
    """A map along one axis (softmax and its log), read and written whole inside each block."""
    return register(
        Kernel(
            name=name,
            inputs=("x",),
            signature=lambda x, axis: whole_axis_signature(x, axis),
            numpy=np_fn,
            torch=lambda x, axis: torch_fn(x, dim=axis),
            sample=_sample_axis,
            params={"axis": -1},
            dtype_rule=numeric(name, ("x",), floats_only=True),
            takes_zero_size=False,
            doc=doc,
        )
    )


_whole_axis_map("softmax", _softmax, torch.softmax, "softmax over one axis")
_whole_axis_map("log_softmax", _log_softmax, torch.log_softmax, "log of softmax over one axis, computed stably")


def _norm_signature(name: str, x: Shape, *params: Shape) -> SignatureSpec:
    if not x or any(p != x[-1:] for p in params):
        got = ", ".join(f"{list(p)}" for p in params)
        size = x[-1] if x else "?"
        raise KernelError(f"{name} needs params of shape [{size}] over x{list(x)}'s last axis; got {got}")
    return whole_axis_signature(x, -1, extra=params, flops=8)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _sample_norm(params: int, eps: tuple[float, ...]):
    def sample(draw):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=2, max_size=3)))
        return (shape, *[shape[-1:]] * params), {"eps": draw(st.sampled_from(eps))}

    return sample


register(
    Kernel(
        name="layer_norm",
        inputs=("x", "w", "b"),
        signature=lambda x, w, b, eps: _norm_signature("layer_norm", x, w, b),
        numpy=_layer_norm,
        torch=lambda x, w, b, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps),
        sample=_sample_norm(2, (1e-5, 1e-12)),
        params={"eps": 1e-5},
        dtype_rule=numeric("layer_norm", ("x", "w", "b"), floats_only=True),
        doc="layer norm over the last axis, with scale w and shift b",
    )
)

register(
    Kernel(
        name="rms_norm",
        inputs=("x", "w"),
        signature=lambda x, w, eps: _norm_signature("rms_norm", x, w),
        numpy=_rms_norm,
        torch=lambda x, w, eps: torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps),
        sample=_sample_norm(1, (1e-6, 1e-5)),
        params={"eps": 1e-6},
        dtype_rule=numeric("rms_norm", ("x", "w"), floats_only=True),
        doc="x / √(mean(x²) + eps) · w over the last axis",
    )
)


def _index_rule(name: str):
    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        if in_dtypes[0] == "bool":
            raise KernelError(f"{name} does not take a bool x (torch has no bool {name}); cast it first")
        return "int64"

    return rule


_reduce_whole("argmax", np.argmax, torch.argmax, _index_rule("argmax"), ("float", "int64"),
              "position of the first largest value along one axis (int64; dropped unless keepdim)")
_reduce_whole("argmin", np.argmin, torch.argmin, _index_rule("argmin"), ("float", "int64"),
              "position of the first smallest value along one axis (int64; dropped unless keepdim)")


# -- histc -----------------------------------------------------------------------------------------------------------
HISTC_DTYPES = ("float32", "float64")  # torch bins half precision in its own arithmetic, which the reference does not


def histc_signature(x: Shape, bins: int, min: float, max: float) -> SignatureSpec:
    """Counts of a flat x in `bins` equal bins over [min, max]: each element adds one to one bin, so x's dim is
    an additive reduction (a device counts its elements; the counts sum) and every block writes all the bins."""
    if len(x) != 1:
        raise KernelError(f"histc counts a flat x; got x{list(x)} (reshape it to one dim first)")
    if bins < 1 or not max > min:
        raise KernelError(f"histc needs bins >= 1 and max > min (fixed bins); got bins={bins}, [{min}, {max}]")
    return SignatureSpec(dims=("elements",), sizes=x, inputs=(follow(1, [0]),),
                         output=follow(1, [None], shape=[bins]), flops_per_point=2)


def _histc_numpy(x: np.ndarray, bins: int, min: float, max: float) -> np.ndarray:
    """torch's CPU histc: bin ⌊(x − min) · bins / (max − min)⌋ in x's dtype, x = max in the last bin, values
    outside [min, max] (and NaN) not counted."""
    lo, hi = x.dtype.type(min), x.dtype.type(max)
    inside = x[(x >= lo) & (x <= hi)]
    position = ((inside - lo) * x.dtype.type(bins) / (hi - lo)).astype(np.int64)
    return np.bincount(np.minimum(position, bins - 1), minlength=bins).astype(x.dtype)


def _histc_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if in_dtypes[0] not in HISTC_DTYPES:
        raise KernelError(f"histc takes a float32 or float64 x, got {in_dtypes[0]}; cast it first")
    return in_dtypes[0]


def _sample_histc(draw):
    low = draw(st.sampled_from((-1.0, 0.0, 0.5)))
    params = {"bins": draw(st.integers(1, 6)), "min": low, "max": low + draw(st.sampled_from((0.5, 1.0, 3.0)))}
    return ((draw(st.integers(1, 40)),),), params


register(
    Kernel(
        name="histc",
        inputs=("x",),
        signature=histc_signature,
        numpy=_histc_numpy,
        torch=lambda x, bins, min, max: torch.histc(x, bins, min, max),
        sample=_sample_histc,
        params={"bins": 100, "min": 0.0, "max": 1.0},
        additive=frozenset({"elements"}),
        dtype_rule=_histc_rule,
        doc="counts of a flat x in bins equal bins over [min, max] (fixed: torch's default min = max reads the"
            " data's range, which the importer leaves opaque)",
    )
)
