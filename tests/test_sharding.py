"""Candidate partitions, the layouts they imply, and communication sets (checked against islpy)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapestry.kernels import get_kernel
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import CommError, box_difference, received_elements, transfers
from tapestry.sharding.partition import candidate_partitions, needed_layout, output_layout, partition_issues
from tapestry.zspace import ZRange, difference, is_partition, set_size, to_isl_set


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


@settings(max_examples=200, deadline=None)
@given(a=boxes, b=boxes)
def test_box_difference_agrees_with_islpy(a, b):
    pieces = box_difference(a, b)
    assert sum(p.size for p in pieces) == set_size(difference(a, b))
    union = to_isl_set(ZRange((0, 0), (0, 0)))
    for p in pieces:
        assert a.contains(p)
        assert to_isl_set(p).intersect(to_isl_set(b)).is_empty()
        assert union.intersect(to_isl_set(p)).is_empty()
        union = union.union(to_isl_set(p))


layouts_1d = st.lists(st.integers(0, 12), min_size=3, max_size=3).map(sorted).map(
    lambda cuts: Layout(tuple(ZRange((lo,), (hi,)) if hi > lo else None
                              for lo, hi in zip([0, *cuts], [*cuts, 12]))))


@settings(max_examples=200, deadline=None)
@given(src=layouts_1d, dst=layouts_1d)
def test_transfers_deliver_exactly_what_each_device_lacks(src, dst):
    received = received_elements(src, dst)
    for k, need in enumerate(dst.blocks):
        lacking = 0 if need is None else set_size(difference(need, src.blocks[k] or ZRange((0,), (0,))))
        assert received[k] == lacking
    moved = transfers(src, dst)
    assert all(src.blocks[t.src].contains(t.region) and dst.blocks[t.dst].contains(t.region) for t in moved)


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
