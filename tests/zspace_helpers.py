"""Builders shared by the ZSpace tests (test_zspace, test_zspace_isl): box shorthands and hypothesis strategies
for ranges and the projections that accept them."""
from hypothesis import settings
from hypothesis import strategies as st

from tapestry.zspace import IndexProjection, ZAffineMap, ZRange

zr = ZRange.parse
R = zr("zr[0:2, 0:3]")
PROPERTY = settings(max_examples=150, deadline=None)
F = IndexProjection(ZAffineMap([[1, 0], [0, 1], [1, 1]], [10, 20, 30]), shape=(4, 4, 1))


@st.composite
def zranges(draw, ndim=None, max_extent=4):
    n = draw(st.integers(0, 3)) if ndim is None else ndim
    start = draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n))
    shape = draw(st.lists(st.integers(0, max_extent), min_size=n, max_size=n))
    return ZRange(start, [s + k for s, k in zip(start, shape)])


@st.composite
def projections(draw, in_dim):
    out_dim = draw(st.integers(0, 3))
    ints = lambda lo, hi, n: st.lists(st.integers(lo, hi), min_size=n, max_size=n)  # noqa: E731
    matrix = draw(st.lists(ints(-3, 3, in_dim), min_size=out_dim, max_size=out_dim))
    affine = ZAffineMap(matrix, draw(ints(-10, 10, out_dim)), in_dim=in_dim)
    return IndexProjection(affine, draw(ints(0, 3, out_dim)))


@st.composite
def projected_ranges(draw):
    """An index range and a projection that accepts it."""
    r = draw(zranges())
    return draw(projections(r.ndim)), r
