"""Mesh symmetries price one layout pair per orbit (sharding.symmetry): swapping axes of equal size and equal
link maps fibres onto fibres; between layouts that split each dim over one axis at most, a reshard and its image
cost exactly the same, and the memo that answers the image from the original never differs from pricing it."""
from __future__ import annotations

import itertools
import operator
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_helpers import layouts, pairs
from sweeps import draws, strided

from tapestry.cost import comm, load_profile
from tapestry.cost.comm import AlphaBeta
from tapestry.cost.profile import Link
from tapestry.plan.plan import Reshard
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import CommError
from tapestry.sharding.symmetry import permuted, relabellings
from tapestry.zspace import ZRange

MESHES = [Mesh(4), Mesh(2, 2), Mesh(2, 4), Mesh(3, 3), Mesh(2, 2, 2), Mesh(1, 2, 2), Mesh(2, 2, 4)]
PROFILES = [load_profile(name) for name in ("cpu-gloo", "gpu-h100-nccl")]


def always(a: int, b: int) -> bool:
    return True


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_each_permutation_of_equal_axes_maps_fibres_onto_fibres(mesh: Mesh) -> None:
    found = relabellings(mesh, always)
    expected = math.prod(math.factorial(list(mesh.shape).count(size)) for size in set(mesh.shape))
    assert len(found) == expected and found[0].devices == tuple(mesh.devices)
    for relabelling in found:
        assert sorted(relabelling.devices) == list(mesh.devices)
        for n in range(mesh.ndim + 1):
            for axes in itertools.combinations(range(mesh.ndim), n):
                fibres = {tuple(sorted(relabelling.devices[d] for d in fibre)) for fibre in mesh.fibres(axes)}
                assert fibres == set(mesh.fibres(tuple(sorted(relabelling.axes[a] for a in axes))))


def test_axes_with_different_links_are_not_swapped() -> None:
    fast, slow = Link(1e-6, 1e11), Link(1e-5, 1e10)
    assert len(comm._orbit_prices((fast, slow), Mesh(2, 2))[0].relabellings) == 1
    assert len(comm._orbit_prices((fast, fast), Mesh(2, 2))[0].relabellings) == 2
    assert len(comm._orbit_prices((fast,), Mesh(2, 2, 2))[0].relabellings) == 6


@st.composite
def priced_pairs(draw: st.DrawFn) -> tuple[Reshard, Mesh]:
    mesh = draw(st.sampled_from([Mesh(2, 2), Mesh(2, 2, 2), Mesh(1, 2, 2)]))
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return Reshard("y", "x", shape, draw(layouts(shape, mesh)), draw(layouts(shape, mesh)), dtype), mesh


def _price(model: AlphaBeta, step: Reshard, mesh: Mesh) -> float | type[CommError]:
    try:
        return model.reshard_time(step, mesh)
    except CommError:
        return CommError


@draws(60, 300)
def test_the_orbit_memo_answers_every_image_as_pricing_it_afresh_would(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(pair=priced_pairs(), profile=st.sampled_from(PROFILES))
    def check(pair, profile) -> None:
        step, mesh = pair
        model = AlphaBeta(profile)
        comm._orbit_prices.cache_clear()
        _price(model, step, mesh)  # now in the memo: its images are answered from it
        for image in _images(step, mesh):
            remembered = _price(model, image, mesh)
            comm._orbit_prices.cache_clear()
            assert remembered == _price(model, image, mesh)

    check()


@pytest.mark.parametrize(("mesh", "shape", "every"), strided(
    itertools.product([Mesh(2, 2), Mesh(2, 2, 2), Mesh(2, 2, 4)], [(4, 4), (8, 4, 2), (2, 6)]),
    {"2x2x2-(4, 4)": 3, "2x2x2-(8, 4, 2)": 7, "2x2x4-(4, 4)": 3, "2x2x4-(8, 4, 2)": 7}))
def test_relabellings_that_keep_splits_keep_prices(mesh: Mesh, shape: tuple[int, ...], every: int) -> None:
    """Every even split of the dims over the axes (a dim over several axes too), plain and partial, to every
    other (or each every-th pair): each image `pair_images` offers costs what the pair costs, and the memo prices
    fewer pairs than there are."""
    named = _named(shape, mesh)
    checked = pairs(named, named, every)
    model = AlphaBeta(PROFILES[1])
    comm._orbit_prices.cache_clear()
    symmetries, prices = comm._orbit_prices(PROFILES[1].links, mesh)
    for src, dst in checked:
        step = Reshard("y", "x", shape, src, dst)
        own = _raw(model, step, mesh)
        for image_src, image_dst in symmetries.pair_images(src, dst, shape):
            assert _raw(model, Reshard("y", "x", shape, image_src, image_dst), mesh) == own
        _price(model, step, mesh)
    assert len(prices) < 0.8 * len(checked)


def _named(shape: tuple[int, ...], mesh: Mesh, uneven: bool = False) -> list[Layout]:
    """Every split of `shape`'s dims over `mesh`'s axes whose pieces divide their dims (or, `uneven`, every one),
    plain and partial."""
    named = [Layout.split(shape, mesh, dims) for dims in itertools.product([None, *range(len(shape))], repeat=mesh.ndim)
             if uneven or all(shape[d] % math.prod(mesh.shape[a] for a, e in enumerate(dims) if e == d) == 0
                              for d in dims if d is not None)]
    return named + [Layout(layout.blocks, partial=True) for layout in named]


@pytest.mark.parametrize(("mesh", "shape", "every"), strided(
    itertools.product([Mesh(4), Mesh(2, 2), Mesh(2, 2, 2)], [(4, 8), (8, 5, 6), (3, 13)]),
    {"2x2x2-(4, 8)": 5, "2x2x2-(8, 5, 6)": 15, "2x2x2-(3, 13)": 5}))
def test_a_pair_of_splits_is_priced_on_its_least_shape_as_on_its_own(mesh: Mesh, shape: tuple[int, ...],
                                                                      every: int) -> None:
    """Every pair of splits (plain and partial, a dim over several axes too, uneven ones; or each every-th pair)
    costs, priced on its least shape (`comm.least_pair`: the same splits, each dim its pieces divide shrunk to
    their least common multiple, the cells scaled), what it costs priced on its own shape, to the bit, under both
    profiles (a cluster's axes over different links)."""
    named = _named(shape, mesh, uneven=True)
    assert len(named) > 2
    scaled = 0
    for profile in PROFILES:
        model = AlphaBeta(profile)
        for src, dst in pairs(named, named, every):
            step = Reshard("y", "x", shape, src, dst, "bfloat16")
            least = comm.least_pair(src, dst, shape, mesh)
            scaled += least is not None
            assert _price(model, step, mesh) == _raw(model, step, mesh)
            if least is not None:
                assert math.prod(least.shape) * least.cells == math.prod(shape)
                assert model._priced(step, mesh, None, least) == _raw(model, step, mesh)
    assert scaled > 0


def test_blocks_of_no_split_and_a_least_shape_have_no_least_pair() -> None:
    mesh = Mesh(2, 2)
    even = Layout.split((8, 6), mesh, (0, None))
    assert comm.least_pair(even, Layout.split((8, 6), mesh, (0, 1)), (8, 6), mesh).shape == (2, 2)
    assert comm.least_pair(even, Layout.split((8, 6), mesh, (1, 1)), (8, 6), mesh).shape == (2, 6)  # 6 in 4 kept
    shifted = Layout(tuple(b.translate((0, 1)) for b in Layout.split((8, 5), mesh, (0, None)).blocks))
    assert comm.least_pair(shifted, even, (8, 6), mesh) is None  # blocks of no split
    assert comm.least_pair(Layout.replicated((2, 1), mesh), Layout.split((2, 1), mesh, (0, None)), (2, 1),
                           mesh) is None  # already the least shape


def _raw(model: AlphaBeta, step: Reshard, mesh: Mesh) -> float | type[CommError]:
    try:
        return model._priced(step, mesh)
    except CommError:
        return CommError


def _images(step: Reshard, mesh: Mesh) -> list[Reshard]:
    return [Reshard("y", "x", step.shape, permuted(step.src_layout, r.devices), permuted(step.layout, r.devices),
                    step.dtype) for r in relabellings(mesh, always)]


def _shifted(layout: Layout, offset: tuple[int, ...]) -> Layout:
    def moved(b):  # noqa: ANN001, ANN202
        return None if b is None else ZRange(tuple(map(operator.add, b.start, offset)),
                                             tuple(map(operator.add, b.end, offset)))

    return Layout(tuple(map(moved, layout.blocks)), layout.partial)


@draws(60, 300)
def test_a_reshard_elsewhere_in_a_larger_tensor_costs_the_same_and_is_priced_once(examples: int) -> None:
    """A layout that holds only what a reader reads (a third of a fused q/k/v output) moves its blocks as the
    same layout at the tensor's origin would: one price for both."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=priced_pairs(), offset=st.lists(st.integers(0, 5), min_size=3, max_size=3),
           profile=st.sampled_from(PROFILES))
    def check(pair, offset, profile) -> None:
        step, mesh = pair
        offset = tuple(offset[:len(step.shape)])
        far = Reshard("y", "x", tuple(n + o + 2 for n, o in zip(step.shape, offset)),
                      _shifted(step.src_layout, offset), _shifted(step.layout, offset), step.dtype)
        model = AlphaBeta(profile)
        assert _raw(model, far, mesh) == _raw(model, step, mesh)
        comm._orbit_prices.cache_clear()
        assert _price(model, step, mesh) == _price(model, far, mesh)
        held = any(b is not None for layout in (step.src_layout, step.layout) for b in layout.blocks)
        assert len(comm._orbit_prices(profile.axis_links(mesh.shape), mesh)[1]) <= (1 if held else 2)

    check()
