"""cumsum(x, axis): out[i] = Σ_{j <= i} x[j] along the axis.

A scan is not a box-to-box map along its axis (output i reads x[0..i]), so the signature models it as a masked
sum: the index space is x's dims plus `source` (j, the position read), with out[i] += x[j] where j <= i. Then
the output position is parallel (a block of positions reads every source position before it: the box of
`source` it is given) and `source` is an additive reduction (a device holding x[j0:j1] adds those terms to
every position after j0). A block computes its part in O(|i| + |j|) from a local cumsum (`block_start` says
where it lies), so the signature counts no FLOPs per point (there are |i|·|j| points) and the bytes price it.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.reductions import _axis
from tapestry.kernels.registry import register


def cumsum_signature(x: Shape, axis: int) -> SignatureSpec:
    ax, n = _axis(x, axis), len(x)
    reads = [n if d == ax else d for d in range(n)]
    return SignatureSpec(
        dims=(*(f"d{d}" for d in range(n)), "source"),
        sizes=(*x, x[ax]),
        inputs=(follow(n + 1, reads),),
        output=follow(n + 1, range(n)),
        flops_per_point=0,
    )


def _counts(axis: int, block_start: tuple[int, ...], out_len: int, block_len: int) -> np.ndarray:
    """Per output position of the block: how many of the block's source positions it sums (j <= i)."""
    first, source = block_start[axis], block_start[-1]
    return np.clip(first + np.arange(out_len) - source + 1, 0, block_len)


def _cumsum_numpy(x, axis: int, block_start: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    ax = axis % x.ndim
    zero = np.zeros_like(x, shape=tuple(1 if d == ax else s for d, s in enumerate(x.shape)))
    running = np.concatenate([zero, np.cumsum(x, axis=ax)], axis=ax)  # running[c]: the sum of the first c
    return np.take(running, _counts(ax, block_start, out_shape[ax], x.shape[ax]), axis=ax)


def _cumsum_torch(x, axis: int, block_start: tuple[int, ...], out_shape: tuple[int, ...]):
    ax = axis % x.dim()
    running = torch.cumsum(x, dim=ax)
    zero = running.new_zeros(tuple(1 if d == ax else s for d, s in enumerate(running.shape)))
    running = torch.cat([zero, running], ax)
    counts = torch.from_numpy(_counts(ax, block_start, out_shape[ax], x.shape[ax])).to(x.device)
    return running.index_select(ax, counts)


def _rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """torch sums integers and bools as int64."""
    return in_dtypes[0] if dtypes.is_float(in_dtypes[0]) else "int64"


def _sample(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return (shape,), {"axis": axis}, (draw(st.sampled_from(("float", "int32", "bool"))),)


register(
    Kernel(
        name="cumsum",
        inputs=("x",),
        signature=cumsum_signature,
        numpy=_cumsum_numpy,
        torch=_cumsum_torch,
        sample=_sample,
        params={"axis": 0},
        additive=frozenset({"source"}),
        needs_block_start=True,
        needs_out_shape=True,
        dtype_rule=_rule,
        takes_zero_size=False,
        doc="running sum along `axis` (integers and bools sum to int64)",
    )
)
