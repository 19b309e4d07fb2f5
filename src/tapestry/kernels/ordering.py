"""topk and sort along one axis: values or their positions (int64).

An ordering needs its whole axis, so the axis is inside every block (not an index dim) and the other dims
split. Ties keep their original order (a stable sort), in numpy and torch alike, so sharded, whole and
reference runs pick the same positions; NaN counts as the largest value, as in torch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.reductions import _axis
from tapestry.kernels.registry import register


def topk_signature(x: Shape, axis: int, k: int, largest: bool, indices: bool) -> SignatureSpec:
    ax = _axis(x, axis)
    if not 1 <= k <= x[ax]:
        raise KernelError(f"topk: k={k} is out of range for axis {axis} of x{list(x)}")
    kept = [d for d in range(len(x)) if d != ax]
    rows = [None if d == ax else kept.index(d) for d in range(len(x))]
    n = len(kept)
    return SignatureSpec(
        dims=tuple(f"d{d}" for d in kept),
        sizes=tuple(x[d] for d in kept),
        inputs=(follow(n, rows, shape=[x[ax] if d == ax else 1 for d in range(len(x))]),),
        output=follow(n, rows, shape=[k if d == ax else 1 for d in range(len(x))]),
        flops_per_point=x[ax] * max(1, math.ceil(math.log2(x[ax] + 1))),  # a comparison sort
    )


def _order(x: np.ndarray, axis: int, largest: bool) -> np.ndarray:
    """Stable order along `axis`, largest first when `largest` (ties keep their order: the sort of the reversed
    axis, reversed). numpy sorts NaN last, so it comes first when largest, as in torch."""
    if not largest:
        return np.argsort(x, axis=axis, kind="stable")
    n = x.shape[axis]
    return n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)


def _topk_numpy(x, axis: int, k: int, largest: bool, indices: bool) -> np.ndarray:
    ax = axis % x.ndim
    order = np.take(_order(x, ax, largest), np.arange(k), axis=ax)
    return order if indices else np.take_along_axis(x, order, axis=ax)


def _topk_torch(x, axis: int, k: int, largest: bool, indices: bool):
    values, order = torch.sort(x, dim=axis, descending=largest, stable=True)
    return (order if indices else values).narrow(axis, 0, k)


def _rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if in_dtypes[0] == "bool":
        raise KernelError("topk does not take a bool x; cast it first")
    return "int64" if params["indices"] else in_dtypes[0]


def _sample(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    params = {"axis": axis, "k": draw(st.integers(1, shape[axis])), "largest": draw(st.booleans()),
              "indices": draw(st.booleans())}
    return (shape,), params, (draw(st.sampled_from(("float", "int64"))),)


register(
    Kernel(
        name="topk",
        inputs=("x",),
        signature=topk_signature,
        numpy=_topk_numpy,
        torch=_topk_torch,
        sample=_sample,
        params={"axis": -1, "k": 1, "largest": True, "indices": False},
        dtype_rule=_rule,
        takes_zero_size=False,
        doc="the k largest (or smallest) values along `axis`, sorted, or their positions (`indices`, int64); "
            "sort and argsort are topk with k = the axis' size",
    )
)
