"""Kernels that read a whole axis: sum (additive, so its axis is an index dim),
softmax and layer_norm (not additive, so their axis is inside the block)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register

EPS = 1e-5


def _axis(shape: Shape, axis: int) -> int:
    if not -len(shape) <= axis < len(shape):
        raise KernelError(f"axis {axis} is out of range for shape {list(shape)}")
    return axis % len(shape)


def _sample_axis(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    return (shape,), {"axis": draw(st.integers(-len(shape), len(shape) - 1))}


def sum_signature(x: Shape, axis: int) -> SignatureSpec:
    ax = _axis(x, axis)
    n = len(x)
    return SignatureSpec(
        dims=tuple("reduce" if d == ax else f"d{d}" for d in range(n)),
        sizes=x,
        inputs=(follow(n, range(n)),),
        output=follow(n, [d for d in range(n) if d != ax]),
    )


register(
    Kernel(
        name="sum",
        inputs=("x",),
        signature=sum_signature,
        numpy=lambda x, axis: x.sum(axis=axis),
        torch=lambda x, axis: x.sum(dim=axis),
        sample=_sample_axis,
        params={"axis": -1},
        additive=frozenset({"reduce"}),
        doc="sum over one axis (the axis is dropped)",
    )
)


def whole_axis_signature(x: Shape, axis: int, extra: tuple[Shape, ...] = (), flops: int = 5) -> SignatureSpec:
    """Index dims are x's dims but `axis`; every block reads and writes that axis whole."""
    ax = _axis(x, axis)
    kept = [d for d in range(len(x)) if d != ax]
    n = len(kept)
    rows = [kept.index(d) if d != ax else None for d in range(len(x))]
    block = follow(n, rows, shape=[x[ax] if d == ax else 1 for d in range(len(x))])
    params = tuple(follow(n, [None], shape=s) for s in extra)
    return SignatureSpec(
        tuple(f"d{d}" for d in kept), tuple(x[d] for d in kept), (block, *params), block, flops * x[ax]
    )


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


register(
    Kernel(
        name="softmax",
        inputs=("x",),
        signature=lambda x, axis: whole_axis_signature(x, axis),
        numpy=_softmax,
        torch=lambda x, axis: torch.softmax(x, dim=axis),
        sample=_sample_axis,
        params={"axis": -1},
        doc="softmax over one axis",
    )
)


def layer_norm_signature(x: Shape, w: Shape, b: Shape) -> SignatureSpec:
    if not x or w != x[-1:] or b != x[-1:]:
        raise KernelError(f"layer_norm needs w and b of shape [{x[-1] if x else '?'}]; got w{list(w)}, b{list(b)}")
    return whole_axis_signature(x, -1, extra=(w, b), flops=8)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + EPS) * w + b).astype(x.dtype)


def _sample_layer_norm(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    return (shape, shape[-1:], shape[-1:]), {}


register(
    Kernel(
        name="layer_norm",
        inputs=("x", "w", "b"),
        signature=layer_norm_signature,
        numpy=_layer_norm,
        torch=lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS),
        sample=_sample_layer_norm,
        doc="layer norm over the last axis, with scale w and shift b",
    )
)
