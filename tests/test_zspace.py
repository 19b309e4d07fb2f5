"""Specification of the ZSpace closed forms: ZRange, ZAffineMap, IndexProjection."""

import json
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sweeps import draws
from zspace_helpers import F, PROPERTY, R, projected_ranges, zr, zranges

from tapestry.zspace import IndexProjection, ZAffineMap, ZRange, zrange
from tapestry.zspace.zrange import covered, tiles


# --- ZRange: construction and properties ---


def test_from_shape_starts_at_the_origin():
    r = ZRange.from_shape((2, 3))
    assert (r.ndim, r.size, r.start) == (2, 6, (0, 0))


def test_zero_dim_range_is_one_point_and_not_empty():
    r = ZRange((), ())
    assert (r.size, r.is_empty, str(r)) == (1, False, "zr[]")


def test_inclusive_end_is_the_last_cell():
    assert ZRange((2, 3), (4, 5)).inclusive_end == (3, 4)


def test_equal_start_and_end_is_empty():
    assert ZRange((2, 3), (2, 3)).is_empty


def test_empty_range_has_no_inclusive_end():
    with pytest.raises(IndexError, match="empty range"):
        ZRange((2, 3), (2, 3)).inclusive_end


def test_bounds_are_stored_as_int_tuples():
    r = ZRange(np.array([1, 2]), [3, 4])
    assert r.start == (1, 2) and r.end == (3, 4)
    assert all(type(v) is int for v in r.start)


def test_constructor_rejects_ndim_mismatch():
    with pytest.raises(ValueError, match="ndim mismatch"):
        ZRange((0, 0), (1,))


def test_constructor_rejects_start_after_end_in_any_dim():
    # The original accepted this incomparable pair, giving a negative shape.
    with pytest.raises(ValueError, match=r"start \[1, 0\] must be <= end \[0, 1\] \(dim 0\)"):
        ZRange((1, 0), (0, 1))


def test_ranges_are_hashable_and_ordered():
    assert len({zr("zr[0:1]"), zr("zr[0:1]"), zr("zr[1:2]")}) == 2
    assert sorted([zr("zr[1:2]"), zr("zr[0:1]")]) == [zr("zr[0:1]"), zr("zr[1:2]")]


# --- ZRange: containment ---


@pytest.mark.parametrize("point", [(0, 0), (1, 2), (1, 1)])
def test_contains_points_inside(point):
    assert R.contains(point)


@pytest.mark.parametrize("point", [(2, 3), (-2, 1), (2, 1)])
def test_does_not_contain_points_outside_in_any_coordinate(point):
    # (2, 1) is the original's dominance-order bug: it is outside dim 0.
    assert not R.contains(point)


@pytest.mark.parametrize("inner", ["zr[0:1, 0:1]", "zr[1:2, 2:3]", "zr[2:2, 3:3]"])
def test_contains_ranges_inside_including_empty_ones_on_the_boundary(inner):
    assert R.contains(zr(inner))


@pytest.mark.parametrize("outer", ["zr[0:1, -1:1]", "zr[0:3, 0:1]"])
def test_does_not_contain_ranges_sticking_out(outer):
    assert not R.contains(zr(outer))


def test_zero_dim_range_contains_every_zero_dim_point_and_range():
    assert ZRange((), ()).contains(()) and ZRange((), ()).contains(ZRange((), ()))


@pytest.mark.parametrize("x", [(0,), zr("zr[0:1]")])
def test_contains_rejects_ndim_mismatch(x):
    with pytest.raises(ValueError, match="ndim mismatch"):
        R.contains(x)


# --- ZRange: intersection and bounding ---


def test_intersection_of_overlapping_boxes():
    assert R.intersection(zr("zr[-2:2, 1:5]")) == zr("zr[0:2, 1:3]")


def test_intersection_of_disjoint_boxes_is_none():
    assert R.intersection(zr("zr[-5:-1, -5:-1]")) is None


def test_intersection_of_touching_boxes_is_empty_not_none():
    assert R.intersection(zr("zr[2:4, 0:3]")) == zr("zr[2:2, 0:3]")


def test_intersection_rejects_ndim_mismatch():
    with pytest.raises(ValueError, match="ndim mismatch"):
        R.intersection(zr("zr[0:1]"))


def test_bounding_counts_empty_ranges():
    assert ZRange.bounding([zr("zr[1:2, 1:2]"), zr("zr[5:5, 0:0]")]) == zr("zr[1:5, 0:2]")


def test_bounding_of_no_ranges_raises():
    with pytest.raises(ValueError, match="no ranges"):
        ZRange.bounding([])


def test_bounding_rejects_mixed_ndim():
    with pytest.raises(ValueError, match="ndim mismatch"):
        ZRange.bounding([zr("zr[0:1]"), R])


# --- ZRange: splitting ---


def test_split_makes_a_smaller_last_piece():
    assert R.split(1, 2) == [zr("zr[0:2, 0:2]"), zr("zr[0:2, 2:3]")]


def test_split_makes_ceil_n_over_chunk_pieces():
    # The original computed n/k + n%k pieces and failed here.
    assert zr("zr[0:11]").split(0, 3) == [zr("zr[0:3]"), zr("zr[3:6]"), zr("zr[6:9]"), zr("zr[9:11]")]


def test_split_with_chunk_at_least_n_returns_self():
    assert R.split(0, 5) == [R]


def test_split_accepts_negative_dims():
    assert R.split(-1, 2) == R.split(1, 2)


def test_split_rejects_non_positive_chunk():
    with pytest.raises(ValueError, match="non-positive chunk"):
        R.split(0, -2)


@pytest.mark.parametrize("dim", [2, -3])
def test_split_rejects_bad_dim(dim):
    with pytest.raises(IndexError, match=f"dim {dim} out of range"):
        R.split(dim, 1)


def test_split_even_puts_larger_pieces_first():
    assert [p.size for p in zr("zr[0:10]").split_even(0, 4)] == [3, 3, 2, 2]


def test_split_even_gives_empty_pieces_when_parts_exceed_extent():
    assert zr("zr[0:2]").split_even(0, 3) == [zr("zr[0:1]"), zr("zr[1:2]"), zr("zr[2:2]")]


def test_split_even_rejects_non_positive_parts():
    with pytest.raises(ValueError, match="non-positive number of parts"):
        R.split_even(0, 0)


@PROPERTY
@given(st.integers(0, 20), st.integers(1, 8))
def test_split_pieces_number_ceil_n_over_chunk(n, chunk):
    assert len(ZRange.from_shape((n,)).split(0, chunk)) == max(1, math.ceil(n / chunk))


@st.composite
def tilings(draw):
    """A box and boxes that may partition it: the grid of an even split over one or two dims, then perhaps a
    piece dropped, grown, moved or doubled."""
    whole = draw(zranges(ndim=draw(st.integers(0, 3)), max_extent=5))
    pieces = [whole]
    for dim in draw(st.lists(st.integers(0, max(whole.ndim - 1, 0)), max_size=2 if whole.ndim else 0)):
        parts = draw(st.integers(1, 4))
        pieces = [p for piece in pieces for p in piece.split_even(dim, parts)]
    i = draw(st.integers(0, len(pieces) - 1))
    change = draw(st.sampled_from(["none", "drop", "grow", "move", "double"]))
    if change == "drop":
        pieces.pop(i)
    elif change == "double":
        pieces.append(pieces[i])
    elif change in ("grow", "move") and whole.ndim:
        d = draw(st.integers(0, whole.ndim - 1))
        step = [int(k == d) for k in range(whole.ndim)]
        p = pieces[i]
        pieces[i] = p.translate(step) if change == "move" else ZRange(p.start, [e + s for e, s in zip(p.end, step)])
    return pieces, whole


def _tiles_by_counting(parts, whole):
    """The partition test cell by cell: every cell of whole held once, no cell of a part outside it."""
    held = {}
    for p in parts:
        for cell in p.points():
            held[cell] = held.get(cell, 0) + 1
    return all(whole.contains(cell) for cell in held) and all(held.get(c) == 1 for c in whole.points())


@draws(50, 150)
def test_tiles_agrees_with_counting_cells(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(tilings())
    def check(case):
        parts, whole = case
        assert tiles(parts, whole) == _tiles_by_counting(parts, whole)

    check()


@draws(50, 150)
def test_tiles_by_box_pairs_where_the_grid_is_too_fine_agrees_with_counting_cells(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(tilings())
    def check(case):
        parts, whole = case
        with mock.patch.object(zrange, "GRID_CELLS_PER_BOX", 0), mock.patch.object(zrange, "PAIRED_BOXES", 0):
            assert tiles(parts, whole) == _tiles_by_counting(parts, whole)

    check()


@draws(50, 150)
def test_tiles_by_the_grid_past_a_few_boxes_agrees_with_counting_cells(examples: int) -> None:
    """Up to PAIRED_BOXES boxes `tiles` tests each pair in turn; past them it counts on the grid (forced here)."""
    @settings(PROPERTY, max_examples=examples)
    @given(tilings())
    def check(case):
        parts, whole = case
        with mock.patch.object(zrange, "PAIRED_BOXES", 0):
            assert tiles(parts, whole) == _tiles_by_counting(parts, whole)

    check()


@draws(50, 150)
def test_covered_agrees_with_counting_cells_or_declines(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(tilings())
    def check(case):
        parts, whole = case
        found = covered(parts, whole)
        assert found is None or found == all(any(p.contains(c) for p in parts) for c in whole.points())

    check()


def test_covered_counts_overlapping_and_stray_parts():
    assert covered([zr("zr[0:2, 0:3]"), zr("zr[1:4, 0:3]"), zr("zr[5:9, 0:1]")], zr("zr[0:4, 0:3]")) is True
    assert covered([zr("zr[0:2, 0:3]"), zr("zr[2:4, 0:2]"), zr("zr[2:4, 3:9]")], zr("zr[0:4, 0:3]")) is False


def test_tiles_finds_an_overlap_whose_sizes_add_up():
    assert not tiles([zr("zr[0:2]"), zr("zr[1:3]")], zr("zr[0:4]"))  # 2 + 2 cells, but cell 3 left and 1 twice
    assert tiles([zr("zr[0:2]"), zr("zr[2:4]"), zr("zr[4:4]")], zr("zr[0:4]"))


@PROPERTY
@given(st.integers(0, 20), st.integers(1, 8))
def test_split_even_sizes_differ_by_at_most_one_larger_first(n, parts):
    sizes = [p.size for p in ZRange.from_shape((n,)).split_even(0, parts)]
    assert len(sizes) == parts and sum(sizes) == n
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


# --- ZRange: moving, iterating, indexing ---


def test_translate_shifts_both_corners():
    assert R.translate((1, -1)) == zr("zr[1:3, -1:2]")


def test_points_are_row_major():
    assert list(zr("zr[0:2, 5:7]").points()) == [(0, 5), (0, 6), (1, 5), (1, 6)]


def test_zero_dim_range_has_one_point():
    assert list(ZRange((), ()).points()) == [()]


def test_empty_range_has_no_points():
    assert list(zr("zr[0:2, 3:3]").points()) == []


def test_slices_index_an_array_at_the_origin():
    a = np.arange(20).reshape(4, 5)
    assert (a[zr("zr[1:3, 2:4]").slices()] == a[1:3, 2:4]).all()


def test_slices_reject_negative_starts():
    with pytest.raises(ValueError, match="negative start"):
        zr("zr[-1:1]").slices()


def test_relative_to_indexes_a_block_holding_the_outer_range():
    assert zr("zr[12:14, 3:5]").relative_to(zr("zr[10:20, 3:9]")) == (slice(2, 4), slice(0, 2))


def test_relative_to_rejects_ranges_outside_the_block():
    with pytest.raises(ValueError, match=r"zr\[0:3\] is not inside zr\[1:5\]"):
        zr("zr[0:3]").relative_to(zr("zr[1:5]"))


# --- ZRange: text and JSON ---


def test_str_is_half_open_slice_notation():
    assert str(ZRange((2, 3), (4, 5))) == "zr[2:4, 3:5]"


@pytest.mark.parametrize("text", ["zr[2:4,3:5]", " zr[ 2 : 4 , 3:5 ] "])
def test_parse_accepts_text_without_or_with_extra_spaces(text):
    assert zr(text) == ZRange((2, 3), (4, 5))


def test_parse_reads_zero_dim_range():
    assert zr("zr[]") == ZRange((), ())


@pytest.mark.parametrize("text", ["zr[1:2,]", "zr[1]", "[1:2]", "zr[a:b]", "zr[1:2"])
def test_parse_rejects_malformed_text_naming_it(text):
    with pytest.raises(ValueError, match="malformed ZRange string"):
        zr(text)


def test_parse_rejects_start_after_end_naming_the_text():
    with pytest.raises(ValueError, match=r"'zr\[3:1\]'.*must be <= end"):
        zr("zr[3:1]")


@PROPERTY
@given(zranges())
def test_str_parse_round_trips(r):
    assert zr(str(r)) == r


@draws(50, 150)
def test_json_round_trips(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(projected_ranges())
    def check(pr):
        p, r = pr
        for value in (r, p.affine, p):
            assert type(value).from_json(json.loads(json.dumps(value.to_json()))) == value

    check()


# --- ZAffineMap ---

A = ZAffineMap([[1, 0], [0, 2], [1, 2]], [4, 5, 6])


def test_affine_map_applies_matrix_then_offset():
    assert A.apply((1, 1)) == (5, 7, 9)


def test_affine_map_rejects_point_of_wrong_ndim():
    with pytest.raises(ValueError, match="ndim mismatch"):
        A.apply((1, 1, 1))


def test_affine_map_dims_are_rows_out_and_columns_in():
    assert (A.in_dim, A.out_dim) == (2, 3)


def test_affine_map_offset_defaults_to_zero():
    assert ZAffineMap([[1, 2]]).offset == (0,)


def test_affine_map_str_shows_offset_only_when_nonzero():
    assert str(A) == "λx.[[1,0],[0,2],[1,2]]⋅x + [4,5,6]"
    assert str(ZAffineMap([[1, 0]])) == "λx.[[1,0]]⋅x"


def test_affine_map_with_no_index_dims_is_a_constant():
    assert ZAffineMap([[], []], [3, 4]).apply(()) == (3, 4)


def test_affine_map_with_no_rows_keeps_explicit_in_dim():
    m = ZAffineMap([], in_dim=2)
    assert (m.in_dim, m.out_dim, m.apply((7, 8))) == (2, 0, ())


def test_affine_map_rejects_ragged_matrix():
    with pytest.raises(ValueError, match="ndim mismatch: matrix row 1"):
        ZAffineMap([[1, 0], [1]])


def test_affine_map_rejects_in_dim_contradicting_the_matrix():
    with pytest.raises(ValueError, match="ndim mismatch: matrix row 0"):
        ZAffineMap([[1, 0]], in_dim=3)


def test_affine_map_rejects_offset_of_wrong_length():
    with pytest.raises(ValueError, match="ndim mismatch: offset"):
        ZAffineMap([[1, 0]], [1, 2])


def test_identity_map_returns_its_input():
    assert ZAffineMap.identity(3).apply((4, 5, 6)) == (4, 5, 6)


# --- IndexProjection ---

def test_projection_of_a_point_is_a_box_of_its_shape():
    assert F.apply((5, 6)) == zr("zr[15:19, 26:30, 41:42]")


def test_projection_of_a_range_bounds_every_selected_box():
    assert F.apply(zr("zr[5:7, 6:8]")) == zr("zr[15:20, 26:31, 41:44]")


def test_projection_of_a_range_uses_all_corners_for_mixed_sign_rows():
    # The two extreme corners (0,0) and (1,1) both give 0, i.e. the wrong zr[0:1].
    p = IndexProjection(ZAffineMap([[1, -1]], [0]), (1,))
    assert p.apply(zr("zr[0:2, 0:2]")) == zr("zr[-1:2]")


def test_projection_of_an_empty_range_is_empty_at_the_projected_start():
    assert F.apply(zr("zr[5:5, 6:8]")) == zr("zr[15:15, 26:26, 41:41]")


def test_projection_of_an_empty_range_onto_a_scalar_is_the_scalar():
    # A 0-dim range cannot be empty; callers check the index range instead.
    assert IndexProjection(ZAffineMap([], in_dim=1)).apply(zr("zr[3:3]")) == ZRange((), ())


def test_projection_with_a_zero_in_its_shape_selects_nothing():
    p = IndexProjection(ZAffineMap([[1, 0], [0, 1]]), (2, 0))
    assert p.apply(zr("zr[0:4, 1:3]")) == zr("zr[0:0, 1:1]")


def test_projection_shape_defaults_to_ones():
    assert IndexProjection(A).shape == (1, 1, 1)


def test_projection_exposes_its_affine_map():
    assert (F.matrix, F.offset, F.in_dim, F.out_dim) == (((1, 0), (0, 1), (1, 1)), (10, 20, 30), 2, 3)


def test_projection_rejects_shape_of_wrong_length():
    with pytest.raises(ValueError, match="ndim mismatch: shape"):
        IndexProjection(A, (1, 1))


def test_projection_rejects_negative_shape():
    with pytest.raises(ValueError, match="negative shape"):
        IndexProjection(A, (1, -1, 1))


def test_projection_rejects_range_of_wrong_ndim():
    with pytest.raises(ValueError, match="ndim mismatch"):
        F.apply(zr("zr[0:1]"))


def test_identity_projection_maps_a_range_to_itself():
    assert IndexProjection.identity(2).apply(R) == R


# Linear: y[batch, out] = x[batch, :] @ w[:, out] + b[out], index space [batch, out].
LINEAR = {
    "x": IndexProjection(ZAffineMap([[1, 0], [0, 0]], [-40, 20]), (1, 12)),
    "w": IndexProjection(ZAffineMap([[0, 0], [0, 1]]), (12, 1)),
    "b": IndexProjection(ZAffineMap([[0, 1]]), (1,)),
    "y": IndexProjection.identity(2),
}


def test_linear_full_index_selects_every_whole_tensor():
    full = zr("zr[0:100, 0:32]")
    selected = {name: p.apply(full) for name, p in LINEAR.items()}
    assert selected == {
        "x": zr("zr[-40:60, 20:32]"),
        "w": zr("zr[0:12, 0:32]"),
        "b": zr("zr[0:32]"),
        "y": full,
    }


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [("x", "zr[10:60, 20:32]"), ("w", "zr[0:12, 16:32]"), ("b", "zr[16:32]"), ("y", "zr[50:100, 16:32]")],
)
def test_linear_shard_selects_its_slice_of_each_tensor(tensor, expected):
    assert LINEAR[tensor].apply(zr("zr[50:100, 16:32]")) == zr(expected)


@draws(50, 150)
def test_projection_of_a_range_is_the_bounding_box_of_its_points_boxes(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(projected_ranges())
    def check(pr):
        p, r = pr
        boxes = [b for b in map(p.apply, r.points()) if not b.is_empty]
        if boxes:
            assert p.apply(r) == ZRange.bounding(boxes)
        else:  # a 0-dim range cannot be empty, so a scalar tensor still yields zr[]
            assert p.apply(r).is_empty or p.out_dim == 0

    check()
