"""Hypothesis strategies: kernel cases, index partitions, random block graphs."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from tapestry.kernels import Kernel, Signature
from tapestry.zspace import ZRange


@st.composite
def signatures(draw, kernel: Kernel) -> Signature:
    """A kernel bound to random shapes and params from its own sampler."""
    shapes, params = kernel.sample(draw)
    return kernel.bind(shapes, params)


@st.composite
def cuts(draw, size: int) -> list[tuple[int, int]]:
    """Split [0, size) into 1–4 contiguous pieces at random points (uneven, possibly empty)."""
    n = draw(st.integers(1, 4))
    points = sorted(draw(st.lists(st.integers(0, size), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *points, size]
    return list(zip(bounds, bounds[1:]))


@st.composite
def partitions(draw, index: ZRange, dims: tuple[int, ...]) -> list[ZRange]:
    """A grid partition of `index` cut along a random subset of `dims`."""
    chosen = draw(st.sets(st.sampled_from(dims), max_size=2)) if dims else set()
    per_dim = [
        draw(cuts(index.shape[d])) if d in chosen else [(index.start[d], index.end[d])] for d in range(index.ndim)
    ]
    return [ZRange(tuple(lo for lo, _ in combo), tuple(hi for _, hi in combo)) for combo in itertools.product(*per_dim)]


def arrays_for(sig: Signature, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float64) for s in sig.input_shapes]
