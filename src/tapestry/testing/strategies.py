"""Hypothesis strategies: kernel cases, index partitions, random block graphs."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels import Kernel, Signature
from tapestry.zspace import ZRange


@st.composite
def signatures(draw, kernel: Kernel, float_dtype: str = "float64") -> Signature:
    """A kernel bound to random shapes, params and dtypes from its own sampler. A sampler returns
    (shapes, params) or (shapes, params, dtypes); "float" in its dtypes (or no dtypes) means `float_dtype`."""
    shapes, params, *rest = kernel.sample(draw)
    in_dtypes = rest[0] if rest else ("float",) * len(shapes)
    return kernel.bind(shapes, params, [float_dtype if d == "float" else d for d in in_dtypes])


@st.composite
def cuts(draw, size: int, cut: bool = False) -> list[tuple[int, int]]:
    """Split [0, size) into 1–4 contiguous pieces at random points (uneven, possibly empty); `cut` (size >= 2):
    two or more, at least two of them nonempty."""
    n = draw(st.integers(2 if cut else 1, 4))
    inside = [draw(st.integers(1, size - 1))] if cut else []
    points = sorted(inside + draw(st.lists(st.integers(0, size), min_size=n - 1 - len(inside),
                                           max_size=n - 1 - len(inside))))
    bounds = [0, *points, size]
    return list(zip(bounds, bounds[1:]))


@st.composite
def partitions(draw, index: ZRange, dims: tuple[int, ...], cut: bool = False) -> list[ZRange]:
    """A grid partition of `index` cut along a random subset of `dims`; `cut`: along one or two of them of size 2
    or more, each into two or more nonempty blocks (the whole index where no dim is that long)."""
    if cut:
        dims = tuple(d for d in dims if index.shape[d] >= 2)
    chosen = draw(st.sets(st.sampled_from(dims), min_size=int(cut), max_size=2)) if dims else set()
    per_dim = [
        draw(cuts(index.shape[d], cut)) if d in chosen else [(index.start[d], index.end[d])] for d in range(index.ndim)
    ]
    return [ZRange(tuple(lo for lo, _ in combo), tuple(hi for _, hi in combo)) for combo in itertools.product(*per_dim)]


def arrays_for(sig: Signature, seed: int) -> list[np.ndarray]:
    """Random arguments for `sig`: normal floats, random booleans, integers below each slot's index bound."""
    rng = np.random.default_rng(seed)
    return [dtypes.random_array(rng, shape, dtype, sig.index_bound(slot))
            for slot, (shape, dtype) in enumerate(zip(sig.input_shapes, sig.input_dtypes))]
