"""Candidate partitions, the layouts they imply, and communication sets (checked against islpy)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sweeps import draws

from tapestry.kernels import get_kernel
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import CommError, box_difference, received_elements, transfers
from tapestry.sharding.layout import canonical, canonical_box
from tapestry.sharding.partition import (
    _clipped,
    _clipped_all,
    candidate_partitions,
    candidates,
    device_blocks,
    generation_order,
    needed_layout,
    output_layout,
    partition_issues,
)
from tapestry.zspace import IndexProjection, ZAffineMap, ZRange, difference, is_partition, set_size, to_isl_set



def test_a_partition_asked_again_reuses_its_blocks(monkeypatch) -> None:
    """A model's layers repeat index spaces and splits (a hand plan's ops on 8x8x8 ask for the same 512 blocks op
    after op): `make_partition` works out each distinct set of device blocks once, and a partition made again from
    them equals one made afresh."""
    import tapestry.sharding.partition as partition

    made = []
    monkeypatch.setattr(partition, "device_blocks", lambda *args: made.append(args) or device_blocks(*args))
    partition._kept_blocks.cache_clear()
    sig, mesh = get_kernel("matmul").bind([(8, 6), (6, 4)]), Mesh(2, 2)
    first = partition.make_partition(sig, mesh, (0, 2))
    again = partition.make_partition(get_kernel("matmul").bind([(8, 6), (6, 4)]), Mesh(2, 2), (0, 2))
    other = partition.make_partition(sig, mesh, (2, 0))
    assert len(made) == 2 and again == first and other != first
    assert first.blocks == device_blocks(sig.index, mesh, first.axes)


def names(sig, mesh):
    return sorted(p.name(sig) for p in candidate_partitions(sig, mesh))


def test_a_line_of_devices_splits_each_splittable_dim_or_replicates():
    sig = get_kernel("matmul").bind([(8, 6), (6, 4)])
    assert names(sig, Mesh(4)) == ["replicate", "split(k)", "split(m)", "split(n)"]


def test_a_grid_never_splits_a_reduction_while_replicating():
    sig = get_kernel("matmul").bind([(8, 6), (6, 4)])
    found = names(sig, Mesh(2, 2))
    assert "split(k,·)" not in found and "split(·,k)" not in found
    assert {"split(m,n)", "split(m,k)", "split(k,k)", "replicate"} <= set(found)


def test_dims_smaller_than_the_mesh_axis_are_not_split_alone_only_with_another_by_a_factorization():
    sig = get_kernel("relu").bind([(2, 16)])
    assert names(sig, Mesh(4)) == ["replicate", "split(d0/2×d1/2)", "split(d1)"]


def test_splitting_a_reduction_makes_the_output_partial_and_inputs_split_on_k():
    sig = get_kernel("matmul").bind([(8, 6), (6, 4)])
    part = next(p for p in candidate_partitions(sig, Mesh(2)) if p.name(sig) == "split(k)")
    assert output_layout(sig, part).partial
    assert needed_layout(sig, 0, part).name((8, 6), Mesh(2)) == "S(1)"
    assert needed_layout(sig, 1, part).name((6, 4), Mesh(2)) == "S(0)"


def test_windowed_splits_read_overlapping_halos():
    sig = get_kernel("conv2d").bind([(1, 1, 8, 8), (1, 1, 3, 3)], {"padding": 1})
    part = next(p for p in candidate_partitions(sig, Mesh(2)) if p.name(sig) == "split(oh)")
    a, b = needed_layout(sig, 0, part).blocks
    assert a == ZRange((0, 0, 0, 0), (1, 1, 5, 8)) and b == ZRange((0, 0, 3, 0), (1, 1, 8, 8))


@pytest.mark.parametrize("mesh", [Mesh(1), Mesh(3), Mesh(4), Mesh(2, 2), Mesh(2, 3)])
def test_every_candidate_is_a_legal_partition(mesh):
    for name, shapes in [("linear", [(10, 7), (7, 5), (5,)]), ("matmul", [(3, 9, 5), (5, 6)]),
                         ("conv2d", [(2, 3, 7, 7), (4, 3, 3, 3)]), ("softmax", [(5, 7)])]:
        sig = get_kernel(name).bind(shapes)
        for part in candidate_partitions(sig, mesh):
            assert partition_issues(sig, part.blocks) == [], (name, part.name(sig))


boxes = st.tuples(st.integers(-4, 4), st.integers(0, 5), st.integers(-4, 4), st.integers(0, 5)).map(
    lambda t: ZRange((t[0], t[2]), (t[0] + t[1], t[2] + t[3])))


@draws(66, 200)
def test_box_difference_agrees_with_islpy(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(a=boxes, b=boxes)
    def check(a, b):
        pieces = box_difference(a, b)
        assert sum(p.size for p in pieces) == set_size(difference(a, b))
        union = to_isl_set(ZRange((0, 0), (0, 0)))
        for p in pieces:
            assert a.contains(p)
            assert to_isl_set(p).intersect(to_isl_set(b)).is_empty()
            assert union.intersect(to_isl_set(p)).is_empty()
            union = union.union(to_isl_set(p))

    check()


layouts_1d = st.lists(st.integers(0, 12), min_size=3, max_size=3).map(sorted).map(
    lambda cuts: Layout(tuple(ZRange((lo,), (hi,)) if hi > lo else None
                              for lo, hi in zip([0, *cuts], [*cuts, 12]))))


@draws(66, 200)
def test_transfers_deliver_exactly_what_each_device_lacks(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(src=layouts_1d, dst=layouts_1d)
    def check(src, dst):
        received = received_elements(src, dst)
        for k, need in enumerate(dst.blocks):
            lacking = 0 if need is None else set_size(difference(need, src.blocks[k] or ZRange((0,), (0,))))
            assert received[k] == lacking
        moved = transfers(src, dst)
        assert all(src.blocks[t.src].contains(t.region) and dst.blocks[t.dst].contains(t.region) for t in moved)

    check()


def test_partial_sources_send_every_contribution():
    whole = ZRange((0,), (8,))
    partial = Layout((whole, whole), partial=True)
    assert received_elements(partial, Layout.replicated((8,), Mesh(2))) == (8, 8)


def test_nothing_reshards_into_a_partial_layout_or_from_missing_cells():
    with pytest.raises(CommError, match="partial"):
        transfers(Layout.replicated((4,), Mesh(2)), Layout((ZRange((0,), (4,)),) * 2, partial=True))
    with pytest.raises(CommError, match="no device holds it"):
        transfers(Layout((ZRange((0,), (2,)), None)), Layout.replicated((4,), Mesh(2)))


def test_layout_names_are_derived_from_blocks():
    shape, mesh = (8, 6), Mesh(2, 2)
    assert Layout.split(shape, mesh, (0, 1)).name(shape, mesh) == "S(0,1)"
    assert Layout.replicated(shape, mesh).name(shape, mesh) == "R"
    assert Layout(Layout.replicated(shape, mesh).blocks, partial=True).name(shape, mesh) == "P"
    uneven = Layout((ZRange((0, 0), (5, 6)), ZRange((5, 0), (8, 6)), None, None))
    assert uneven.name(shape, mesh) == "blocks"
    assert is_partition([b for b in uneven.blocks if b], ZRange.from_shape(shape))


@draws(33, 100)
def test_a_layouts_name_is_the_first_split_making_it(examples: int) -> None:
    """The named layouts by enumeration (every split, the first in order winning), against `Layout.name`, which
    reads the dims off device 0's neighbours; also on layouts no split makes (devices' blocks swapped)."""
    @settings(max_examples=examples, deadline=None)
    @given(st.sampled_from([(2, 2), (1, 4), (2, 1, 2), (2, 4), (3,), (2, 2, 2)]),
       st.lists(st.integers(0, 9), min_size=1, max_size=3), st.data())
    def check(mesh_shape, shape, data):
        mesh, shape = Mesh(*mesh_shape), tuple(shape)
        named = {}
        for dims in reversed(list(itertools.product([None, *range(len(shape))], repeat=mesh.ndim))[1:]):
            named[Layout.split(shape, mesh, dims)] = "S(" + ",".join("·" if d is None else str(d) for d in dims) + ")"
        named[Layout.replicated(shape, mesh)] = "R"
        dims = tuple(data.draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh.shape)
        layout = Layout.split(shape, mesh, dims)
        blocks = list(layout.blocks)
        i, j = data.draw(st.integers(0, mesh.size - 1)), data.draw(st.integers(0, mesh.size - 1))
        blocks[i], blocks[j] = blocks[j], blocks[i]
        for candidate in (layout, Layout(tuple(blocks))):
            assert candidate.name(shape, mesh) == named.get(candidate, "blocks")

    check()


def _blocks_one_device_at_a_time(index, mesh, splits, exchange=()):
    """The definition: each mesh axis cuts its dims evenly in turn (mixed radix, the last dim fastest)."""
    found = []
    for device in mesh.devices:
        block = index
        for axis, (split, coord) in enumerate(zip(splits, mesh.coords(device))):
            for dim, parts in (split if axis in exchange else reversed(split)):
                piece = coord if axis in exchange else coord % parts
                coord = coord if axis in exchange else coord // parts
                block = block.split_even(dim, parts)[piece]
        found.append(None if block.is_empty else block)
    return tuple(found)


@draws(50, 150)
def test_device_blocks_are_each_devices_even_cuts_also_ragged_and_empty(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(st.data())
    def check(data):
        shape = data.draw(st.sampled_from([(2, 4), (8, 8), (2, 2, 2), (4, 2, 3), (3, 5), (8,)]))
        mesh = Mesh(*shape)
        ndim = data.draw(st.integers(1, 4))
        start = tuple(data.draw(st.integers(0, 3)) for _ in range(ndim))
        index = ZRange(start, tuple(s + data.draw(st.integers(0, 20)) for s in start))
        splits, exchange = [], []
        for axis, size in enumerate(shape):
            factors = [f for f in range(1, size + 1) if size % f == 0]
            kind = data.draw(st.sampled_from(["none", "one", "two", "exchange"]))
            dims = st.integers(0, ndim - 1)
            if kind == "one":
                splits.append(((data.draw(dims), size),))
            elif kind == "two":
                f = data.draw(st.sampled_from(factors))
                splits.append(((data.draw(dims), f), (data.draw(dims), size // f)))
            elif kind == "exchange":
                splits.append(((data.draw(dims), size), (data.draw(dims), size)))
                exchange.append(axis)
            else:
                splits.append(())
        assert device_blocks(index, mesh, tuple(splits), exchange) == \
            _blocks_one_device_at_a_time(index, mesh, splits, exchange)

    check()


def test_candidates_are_the_distinct_block_assignments_most_devices_busy_first():
    sig = get_kernel("matmul").bind([(6, 2), (2, 16)])  # m = 6 over both axes: 3 rows cut 4 ways leave one empty
    mesh = Mesh(2, 4)
    made = candidate_partitions(sig, mesh)
    assert len({p.blocks for p in made}) == len(made)
    assert [len({b for b in p.blocks if b is not None}) for p in made] == [c.busy for c in candidates(sig, mesh)]
    assert [c.idles for c in candidates(sig, mesh)] == [any(b is None for b in p.blocks) for p in made]
    assert any(c.idles for c in candidates(sig, mesh))
    busy = [c.busy for c in generation_order(candidates(sig, mesh))]
    assert busy == sorted(busy, reverse=True) and busy[0] == 8


@draws(50, 150)
def test_the_boxes_blocks_read_are_worked_out_together_as_one_at_a_time(examples: int) -> None:
    """`_clipped_all` (numpy, distinct blocks at once) against `_clipped` (IndexProjection.apply, one block)."""
    @settings(max_examples=examples, deadline=None)
    @given(st.data())
    def check(data):
        in_dim, out_dim = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        entries = st.integers(-2, 2)
        matrix = [[data.draw(entries) for _ in range(in_dim)] for _ in range(out_dim)]
        projection = IndexProjection(ZAffineMap(matrix, [data.draw(st.integers(-3, 3)) for _ in range(out_dim)],
                                                in_dim=in_dim), [data.draw(st.integers(0, 3)) for _ in range(out_dim)])
        shape = tuple(data.draw(st.integers(0, 9)) for _ in range(out_dim))
        corner = st.lists(st.integers(0, 6), min_size=in_dim, max_size=in_dim)
        blocks = []
        for _ in range(data.draw(st.integers(1, 6))):
            start = data.draw(corner)
            blocks.append(data.draw(st.sampled_from([None, ZRange(start, [s + data.draw(st.integers(0, 3))
                                                                            for s in start])])))
        blocks.append(blocks[0])
        assert _clipped_all(projection, tuple(blocks), shape) == tuple(_clipped(projection, b, shape) for b in blocks)

    check()


def test_a_canonical_layout_is_the_first_equal_one_asked_for():
    """Pricing makes equal translated and clipped layouts as new objects; `canonical` hands back one of them, so the
    caches keyed by layouts find it by identity. Equal layouts only: a different one is its own."""
    made = [Layout((ZRange((0,), (2,)), ZRange((2,), (4,)))) for _ in range(2)]
    assert made[0] is not made[1]
    first, again = map(canonical, made)
    assert again is first and first == made[0]
    other = canonical(Layout(made[0].blocks, partial=True))
    assert other is not first and other == Layout(made[0].blocks, partial=True)
    assert canonical_box((0,), (2,)) is canonical_box((0,), (2,)) == ZRange((0,), (2,))


def _split_made_afresh(shape, mesh, dims):
    """`Layout.split` by its definition, one device at a time, never from a memo."""
    blocks = []
    for device in mesh.devices:
        block = ZRange.from_shape(shape)
        for axis, (dim, coord) in enumerate(zip(dims, mesh.coords(device))):
            if dim is not None:
                block = block.split_even(dim, mesh.shape[axis])[coord]
        blocks.append(block)
    return Layout(tuple(blocks))


def test_splits_and_names_made_once_are_the_layouts_made_afresh():
    """`Layout.split` and `Layout.replicated` hand back one object per shape, mesh and dims, and `plain_name`
    names a partial layout by one plain copy: each equal to what its definition makes, for shapes, meshes and
    dims that differ in one thing only (a memo keyed by fewer of them would hand back another's layout)."""
    for mesh, shape in itertools.product([Mesh(4), Mesh(2, 2), Mesh(4, 1), Mesh(2, 2, 2)], [(8, 6), (6, 8), (3, 5)]):
        for dims in itertools.product([None, 0, 1], repeat=mesh.ndim):
            made = Layout.split(shape, mesh, dims)
            assert made == _split_made_afresh(shape, mesh, dims) and Layout.split(list(shape), mesh, dims) is made
            partial = Layout(made.blocks, partial=True)
            assert partial.plain_name(shape, mesh) == made.name(shape, mesh) == Layout(made.blocks).name(shape, mesh)
            assert partial.name(shape, mesh) == ("P" if made.name(shape, mesh) == "R" else
                                                  f"P·{made.name(shape, mesh)}")
        assert Layout.replicated(shape, mesh) == Layout((ZRange.from_shape(shape),) * mesh.size)
        assert Layout.replicated(shape, mesh) is Layout.replicated(list(shape), mesh)
    assert Layout.split((8, 6), Mesh(4), (0,)) != Layout.split((6, 8), Mesh(4), (0,))
    assert Layout.split((8, 6), Mesh(4), (0,)) != Layout.split((8, 6), Mesh(4), (1,))
    assert Layout.split((8, 6), Mesh(4, 1), (0, None)) != Layout.split((8, 6), Mesh(2, 2), (0, None))


def test_a_meshs_hash_is_the_dataclass_hash_of_its_shape():
    """Made once (pricing keys its caches by the mesh), and what the dataclass's was: sets of meshes iterate as
    they did; a mesh unpickled from a file written before the cache still hashes."""
    import pickle

    mesh = Mesh(2, 2)
    assert hash(mesh) == hash(((2, 2),)) == hash(Mesh((2, 2)))
    old = object.__new__(Mesh)
    object.__setattr__(old, "shape", (2, 2))
    assert hash(pickle.loads(pickle.dumps(old))) == hash(mesh) and pickle.loads(pickle.dumps(old)) == mesh
